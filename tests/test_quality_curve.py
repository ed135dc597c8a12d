"""The quality-against-compute study (issue 59): benchmarks/quality_curve.py over synthetic cell
tables (the JSON benchmarks/longer_functions_table.py writes), its fit, what it lists as missing;
the table's per-seed scores it reads; and benchmarks/quality_study.sh's entry and dry run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

PRE, RAND = "pretrained + fine-tune", "random init + fine-tune"
FPS = 2.5e10  # FLOPs per step of the synthetic cells
SLOPE, AT_1E14 = 0.1, 0.08  # the gain: AT_1E14 + SLOPE * (log10 FLOPs - 14)


def gain_at(steps: int) -> float:
  return AT_1E14 + SLOPE * (math.log10(steps * FPS) - 14)


def table(path, budget_s: int, steps: int, provenance: bool = True,
          sets: tuple = (("eval", 1000), ("eval2", 1000), ("eval3", 10000))) -> str:
  """One cell, seq256-instruction at ``steps``, two seeds whose gains sit ±0.01 about the
  line (so least squares recovers it exactly), in the table's per-seed form."""
  g = gain_at(steps)
  pre = {"ft-pre-s0@600": 0.40 + g + 0.01, "ft-pre-s1@600": 0.40 + g - 0.01}
  rand = {"ft-rand-s0@600": 0.40, "ft-rand-s1@600": 0.40}
  rows = [{"variant": "seq256-instruction", "set": s, "pair": "all", "pool": pool,
           "pretrained_ft": {"mean": 0.40 + g, "n": 2}, "random_ft": {"mean": 0.40, "n": 2},
           "gain": {"mean": g}, "per_seed": {
               "pretrained_ft": pre, "random_ft": rand, "gain": [g + 0.01, g - 0.01],
               "runs": [["ft-pre-s0@600", "ft-rand-s0@600"], ["ft-pre-s1@600", "ft-rand-s1@600"]]}}
          for s, pool in sets]
  cls = [{"variant": "seq256-instruction", "start": start, "runs": 2,
          "per_seed": {"0": {"accuracy": acc, "macro_f1": acc - 0.1},
                       "1": {"accuracy": acc, "macro_f1": acc - 0.1}}}
         for start, acc in ((PRE, 0.6 + g / 2), (RAND, 0.6))]
  doc = {"budget": {"budget_s": budget_s, "variants": {"seq256-instruction": {
      "seq_len": 256, "positions": "instruction", "norm": "post", "step_time": 0.5,
      "steps": steps}}}, "device": "cpu: synthetic", "rows": rows,
      "provenance": cls if provenance else [],
      "pretraining": {"seq256-instruction": {"steps": steps, "flops_per_step": FPS,
                                             "model": {"layers": 2, "hidden": 128},
                                             "corpus_tokens": 1000}}}
  path.write_text(json.dumps(doc))
  return str(path)


def curve(tmp_path, *args) -> tuple[subprocess.CompletedProcess, dict]:
  """Runs the tool in a process of its own, saying whether it imported JAX."""
  out = tmp_path / "curve.json"
  code = ("import runpy, sys; sys.argv = sys.argv[1:]\n"
          "try:\n  runpy.run_path(sys.argv[0], run_name='__main__')\n"
          "finally:\n  print('JAX imported:', 'jax' in sys.modules)")
  p = subprocess.run([sys.executable, "-c", code, "benchmarks/quality_curve.py", *args,
                      "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
  return p, (json.loads(out.read_text()) if out.exists() else {})


def test_the_fit_recovers_a_known_slope_and_reports_a_missing_cell_as_missing(tmp_path):
  tables = [table(tmp_path / f"{s}.json", s, round(s / 0.5)) for s in (900, 1800, 3600)]
  p, doc = curve(tmp_path, *tables, "--expect", "seq256-instruction@900,1800,3600,7200")
  assert p.returncode == 0, p.stderr
  assert "JAX imported: False" in p.stdout
  fit, = [f for f in doc["fits"] if f["task"] == "eval"]
  assert fit["gain"]["slope_per_decade"] == pytest.approx(SLOPE, abs=1e-9)
  assert fit["gain"]["intercept"] + 14 * SLOPE == pytest.approx(AT_1E14, abs=1e-9)
  lo, hi = fit["gain"]["slope_interval"]
  assert lo < SLOPE < hi and fit["gain"]["trend"] and fit["gain"]["n_points"] == 6
  prov, = [f for f in doc["fits"] if f["task"] == "provenance-accuracy"]
  assert prov["gain"]["slope_per_decade"] == pytest.approx(SLOPE / 2, abs=1e-9)
  assert doc["missing"] == [{"variant": "seq256-instruction", "budget_s": 7200,
                             "budget": "2 h", "what": "the whole cell"}]
  assert "- seq256-instruction at 2 h: the whole cell" in p.stdout
  hour = fit["predictions"]["1 H200-hour"]
  assert hour["flops"] == pytest.approx(424.7e12 * 3600)
  assert hour["gain"]["mean"] == pytest.approx(gain_at(hour["flops"] / FPS), abs=1e-9)


def test_a_task_a_cell_lacks_is_missing_and_two_budgets_make_no_trend(tmp_path):
  tables = [table(tmp_path / "a.json", 900, 1800, provenance=False),
            table(tmp_path / "b.json", 1800, 3600)]
  p, doc = curve(tmp_path, *tables)
  assert p.returncode == 0, p.stderr
  assert {"variant": "seq256-instruction", "budget_s": 900, "budget": "15 min",
          "what": "provenance accuracy"} in doc["missing"]
  assert not [f for f in doc["fits"] if f["task"].startswith("provenance")]  # one cell: no line
  fit, = [f for f in doc["fits"] if f["task"] == "eval"]
  assert not fit["gain"]["trend"] and fit["predictions"] == {}
  assert "no fit has 3 budgets: none stated" in p.stdout


def test_eval3_is_read_at_pool_10000_and_a_cell_without_it_lists_it_missing(tmp_path):
  """eval3 was built for pool 10,000 (issue 59): its pool-1,000 row (here scored 0) is not the
  task's; a cell scored before eval3 existed names it missing rather than being dropped."""
  with_eval3 = (("eval", 1000), ("eval2", 1000), ("eval3", 1000), ("eval3", 10000))
  t = table(tmp_path / "a.json", 900, 1800, sets=with_eval3)
  doc = json.loads(open(t).read())
  for r in doc["rows"]:
    if (r["set"], r["pool"]) == ("eval3", 1000):
      r["per_seed"]["pretrained_ft"] = {k: 0.0 for k in r["per_seed"]["pretrained_ft"]}
  open(t, "w").write(json.dumps(doc))
  before = table(tmp_path / "b.json", 1800, 3600, sets=with_eval3[:2])
  p, out = curve(tmp_path, t, before)
  assert p.returncode == 0, p.stderr
  first, second = out["cells"]
  assert first["tasks"]["eval3"]["pretrained_ft"] == pytest.approx([0.40 + gain_at(1800) + 0.01,
                                                                     0.40 + gain_at(1800) - 0.01])
  assert "eval3" not in second["tasks"]
  assert {"variant": "seq256-instruction", "budget_s": 1800, "budget": "30 min",
          "what": "eval3 R@1, pool 10,000, all pairs"} in out["missing"]


def test_a_cell_given_twice_is_one_error_line(tmp_path):
  t = table(tmp_path / "a.json", 900, 1800)
  p, _ = curve(tmp_path, t, table(tmp_path / "b.json", 900, 1800))
  assert p.returncode == 1 and p.stderr.count("\n") == 1
  assert p.stderr.startswith("error: ") and "give each cell once" in p.stderr


def test_the_study_table_keeps_each_seed_paired(tmp_path):
  """longer_functions_table.py's rows and provenance keep the seeds, as quality_curve reads."""
  (tmp_path / "budget.json").write_text(json.dumps({"budget_s": 900, "variants": {
      "v": {"seq_len": 256, "positions": "instruction", "norm": "post", "step_time": 0.5,
            "steps": 1800}}}))
  cells = [{"set": "eval", "label": label, "pair": "all", "pool": 1000, "runs": runs,
            "recall_at_1": r1, "recall_at_1_summary": {"mean": sum(r1) / 2, "min": min(r1),
                                                       "max": max(r1), "n": 2}}
           for label, runs, r1 in ((PRE, ["ft-pre-s0@600", "ft-pre-s1@600"], [0.5, 0.6]),
                                   (RAND, ["ft-rand-s0@600", "ft-rand-s1@600"], [0.45, 0.4]))]
  comparison = {"a": PRE, "b": RAND, "set": "eval", "pair": "all", "pool": 1000, "mean": 0.125,
                "min": 0.05, "max": 0.2, "holds_every_run": True, "recall_at_1_diff": [0.05, 0.2],
                "pairs_of_runs": [["ft-pre-s0@600", "ft-rand-s0@600"],
                                  ["ft-pre-s1@600", "ft-rand-s1@600"]]}
  (tmp_path / "v").mkdir()
  (tmp_path / "v" / "claims.json").write_text(json.dumps({"cells": cells,
                                                          "comparisons": [comparison]}))
  for start, acc in (("pre", (0.7, 0.8)), ("rand", (0.6, 0.65))):
    for seed in (0, 1):
      d = tmp_path / "v" / f"cls-{start}-s{seed}"
      d.mkdir()
      (d / "classification_eval.json").write_text(json.dumps(
          {"accuracy": acc[seed], "macro_f1": acc[seed] / 2}))
  windowed = tmp_path / "v" / "cls-pre-s0-w8"  # CLS_WINDOWS=8: a row of its own
  windowed.mkdir()
  (windowed / "classification_eval.json").write_text(json.dumps({"accuracy": 0.9,
                                                                 "macro_f1": 0.5}))
  out = tmp_path / "table.json"
  p = subprocess.run([sys.executable, "benchmarks/longer_functions_table.py", "--study",
                      str(tmp_path), "--json", str(out)], cwd=ROOT, capture_output=True,
                     text=True, timeout=120)
  assert p.returncode == 0, p.stderr
  doc = json.loads(out.read_text())
  row, = doc["rows"]
  assert row["per_seed"]["gain"] == [0.05, 0.2]
  assert row["per_seed"]["pretrained_ft"] == {"ft-pre-s0@600": 0.5, "ft-pre-s1@600": 0.6}
  pre = next(r for r in doc["provenance"] if r["start"] == PRE and r["windows"] == 1)
  assert pre["per_seed"] == {"0": {"accuracy": 0.7, "macro_f1": 0.35},
                             "1": {"accuracy": 0.8, "macro_f1": 0.4}}
  pre8, = [r for r in doc["provenance"] if r["windows"] == 8]
  assert pre8["start"] == PRE and pre8["per_seed"] == {"0": {"accuracy": 0.9, "macro_f1": 0.5}}
  assert len(doc["provenance"]) == 3 and "(1 seed, 8 windows)" in p.stdout + out.read_text()
  assert doc["pretraining"] == {}  # no pretraining run in this study: nothing recorded


def test_the_study_wants_its_directory_and_its_dry_run_runs_nothing(tmp_path):
  p = subprocess.run(["bash", "benchmarks/quality_study.sh"], cwd=ROOT, capture_output=True,
                     text=True, timeout=60)
  assert p.returncode == 1 and p.stderr.startswith("error: give the study's directory")
  p = subprocess.run(["bash", "benchmarks/quality_study.sh", "--help"], cwd=ROOT,
                     capture_output=True, text=True, timeout=60)
  assert p.returncode == 0 and "bash benchmarks/quality_study.sh OUT" in p.stdout
  out = tmp_path / "study"
  p = subprocess.run(["bash", "benchmarks/quality_study.sh", str(out)], cwd=ROOT,
                     capture_output=True, text=True, timeout=60,
                     env={**os.environ, "DRY_RUN": "1", "WIDE_BUDGETS": "3600"})
  assert p.returncode == 0, p.stderr
  assert not out.exists()
  for what in ("seq256-instruction at 15m: budget.json", "seq256-instruction at 4h: pretrain",
               "seq256-instruction-4x256: its step time",
               "seq256-instruction-4x256 at 1h: pretrain", "the curve: no finished cell yet"):
    assert f"== {what}" in p.stderr


def test_a_finished_cell_with_no_table_yet_goes_on_to_its_copy_and_the_curve(tmp_path):
  """The first copy of a cell's table: looking for an earlier one finds none, which under
  pipefail ended the study (exit 2) before the copy and the curve."""
  out = tmp_path / "study"
  cell = out / "zz-no-table-yet-15m"
  cell.mkdir(parents=True)
  (cell / "done").touch()
  (cell / "longer_functions.json").write_text("{}")
  p = subprocess.run(["bash", "benchmarks/quality_study.sh", str(out)], cwd=ROOT,
                     capture_output=True, text=True, timeout=60,
                     env={**os.environ, "DRY_RUN": "1", "BUDGETS": "", "WIDE_BUDGETS": ""})
  assert p.returncode == 0, p.stderr
  assert "== zz-no-table-yet-15m: its table into benchmarks/results" in p.stderr
  assert "== the curve over 1 cell tables" in p.stderr
  assert f"{cell}/longer_functions.json" in p.stderr  # DRY_RUN copied nothing: the cell's own
  assert not [f for f in os.listdir(os.path.join(ROOT, "benchmarks", "results")) if "zz-no-table" in f]


def test_eval3_without_its_benchmark_file_is_one_line_before_any_work(tmp_path):
  out = tmp_path / "claims"
  for env in ({"SETS": "eval eval3"}, {"SETS": "eval3", "EVAL3": str(tmp_path / "none.jsonl")}):
    p = subprocess.run(["bash", "benchmarks/similarity_claims.sh", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    assert p.returncode == 1 and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith("error: SETS has eval3 but EVAL3=") and "similarity-build" in p.stderr
    assert not out.exists()


def test_a_budget_is_the_seconds_over_the_shared_step_time(tmp_path):
  out = tmp_path / "budget.json"
  p = subprocess.run([sys.executable, "benchmarks/quality_budget.py", "--variant",
                      "v:256:instruction:post:layers=4,hidden=256", "--budget-s", "900",
                      "--step-time", "0.5222703018000174", "--output", str(out)], cwd=ROOT,
                     capture_output=True, text=True, timeout=60)
  assert p.returncode == 0, p.stderr
  v = json.loads(out.read_text())["variants"]["v"]
  assert v["steps"] == 1723 and v["model"] == "layers=4,hidden=256"  # as q-15m's budget.json
