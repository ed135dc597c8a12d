"""benchmarks/bench_step_profile.py (fixed per-step cost, jitter, straggler, step time vs batch)
and bench_allreduce.py's transport efficiency rows: real runs on localhost, small and short."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers import ROOT

CALIBRATION = os.path.join(ROOT, "benchmarks", "results", "2026-12-01-cpu-allreduce.jsonl")
FAST_XLA = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def bench(name: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", name), *args],
                        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                        env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_XLA))


def test_two_process_allreduce_gives_a_transport_row_per_point_and_an_ascending_curve(tmp_path):
  out = tmp_path / "allreduce.jsonl"
  run = bench("bench_allreduce.py", "--processes", "2", "--sizes-mb", "0.016,4", "--repeats",
              "3", "--out", str(out), timeout=120)
  assert run.returncode == 0, run.stderr[-2000:]
  assert "e (fit all)" in run.stdout
  rows = [json.loads(x) for x in open(out)]
  transport = [r for r in rows if r["kind"] == "transport"]
  assert sorted((r["processes"], r["bytes"]) for r in transport) == [(2, 16_000), (2, 4_000_000)]
  assert all(0 < r["efficiency"] <= 1.5 and r["busbw_bytes_per_s"] > 0 for r in transport)
  curve = rows[-1]  # the last line: what the cluster model reads
  assert (curve["kind"], curve["fit_of"], curve["heap"]) == ("transport-curve", "all", "keep")
  assert [m for m, _ in curve["points"]] == [16_000, 4_000_000]
  assert [e for _, e in curve["points"]] == [r["efficiency"] for r in sorted(
      transport, key=lambda r: r["bytes"])]  # one process count: the median is the point


def test_refit_of_an_old_file_writes_transport_rows_to_out_and_leaves_the_file_alone(tmp_path):
  old = tmp_path / "old.jsonl"
  shutil.copy(CALIBRATION, old)
  before = old.read_bytes()
  out = tmp_path / "refit.jsonl"
  run = bench("bench_allreduce.py", "--refit", str(old), "--out", str(out), timeout=60)
  assert run.returncode == 0, run.stderr[-2000:]
  assert old.read_bytes() == before
  rows = [json.loads(x) for x in open(out)]
  assert {r["kind"] for r in rows} == {"fit", "transport", "transport-curve"}
  sizes = [m for m, _ in rows[-1]["points"]]
  assert sizes == sorted(sizes) and len(sizes) == 9  # 1 … 256 MB, the 2026-12-01 sweep


def test_accumulation_fit_clamps_a_negative_fixed_cost_and_refits_through_the_origin():
  from benchmarks import bench_step_profile as sp

  got = sp.accumulation_fit([(1, 0.010), (2, 0.021), (4, 0.043)])
  assert got["fixed_clamped"] and got["fixed_s"] == 0 and got["fixed_unclamped_s"] < 0
  assert got["micro_s"] == pytest.approx((0.010 + 2 * 0.021 + 4 * 0.043) / 21)
  kept = sp.accumulation_fit([(1, 0.015), (2, 0.025), (4, 0.045)])
  assert not kept["fixed_clamped"]
  assert (kept["fixed_s"], kept["micro_s"]) == (pytest.approx(0.005), pytest.approx(0.010))


def test_step_profile_of_real_runs_gives_fixed_cost_jitter_batch_line_and_straggler(tmp_path):
  out = tmp_path / "profile.jsonl"
  run = bench("bench_step_profile.py", "--hidden", "64", "--steps", "8", "--skip", "2",
              "--micro", "2", "--accum", "1,2", "--batches", "2,4", "--calibration",
              CALIBRATION, "--out", str(out))
  assert run.returncode == 0, run.stderr[-2000:]
  rows = [json.loads(x) for x in open(out)]
  assert [r["kind"] for r in rows] == ["accumulation", "accumulation", "batch", "batch",
                                       "concurrent", "concurrent", "two-process", "fit"]
  assert all(len(r["step_times_s"]) >= 3 and r["median_s"] > 0 for r in rows[:-1])
  fit = rows[-1]
  # micro_s is a fitted slope of timings: its sign is a measurement, not what this checks (on a
  # loaded 2-core machine an 8-step run once gave -0.0026 s); fixed_s is clamped at 0
  assert fit["fixed_s"] >= 0 and math.isfinite(fit["micro_s"]) and fit["jitter_s"] >= 0
  assert fit["fixed_clamped"] == ("fixed_unclamped_s" in fit)
  assert fit["jitter_cv"] == pytest.approx(fit["jitter_s"] / rows[0]["median_s"])
  assert [b for b, _ in fit["batch_points"]] == [2, 4]
  assert fit["model"]["hidden"] == 64 and fit["model"]["params"] == rows[0]["params"] > 0
  s = fit["straggler"]
  assert s["predicted_s"] == pytest.approx(fit["jitter_s"] / math.sqrt(math.pi))
  assert s["measured_residual_s"] == pytest.approx(
      s["measured_two_process_s"] - s["concurrent_one_process_s"] - s["allreduce_s"])
  assert s["grad_bytes"] == 4 * fit["model"]["params"]
  assert "| kind | processes |" in run.stdout


def test_step_profile_without_accumulation_k_1_is_one_error_line():
  run = bench("bench_step_profile.py", "--accum", "2,4", timeout=60)
  assert run.returncode == 1 and run.stderr.count("\n") == 1 and "error:" in run.stderr
