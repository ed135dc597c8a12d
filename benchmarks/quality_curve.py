"""Downstream quality against pretraining compute (issue 59): a table, a plot, a trend.

The study's cells, each a table of benchmarks/longer_functions_table.py (one pretraining
budget of one model), as one table, one plot and a fitted trend with a stated extrapolation to
an H200:

  python benchmarks/quality_curve.py TABLE.json… [--variant NAME]… [--expect NAME@S,S,…]…
      [--json OUT.json] [--markdown OUT.md] [--plot OUT.png] [--rate-tflops 424.7]

Per cell (model, budget): its steps and pretraining FLOPs (steps × model/flops.py's
train_flops_per_step, from the run's config.json where the table recorded it, else configs/tiny.py
with budget.json's overrides and --vocab), and per task the scores of pretrained + fine-tune and
random init + fine-tune at each fine-tuning seed and their seed-paired difference (the
pretraining gain): eval and eval2 at pool 1,000 and eval3 at pool 10,000, over all pairs (R@1), compiler provenance's
held-out accuracy and macro-F1. Per model and task: least squares of the gain (and of the
pretrained score) on log10(FLOPs) over the per-seed points, slope ± its standard error and
Student-t 95% intervals (benchmarks/quality_fit.py), and the fitted mean at 1 H200-hour and 1
H200-day of pretraining FLOPs at --rate-tflops: an extrapolation to be checked on a GPU. A cell
of --expect that no table holds, or a task a cell lacks, is listed as missing; nothing is filled in.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import quality_fit  # noqa: E402
from lmscale_jax.cli import args as cli_args  # noqa: E402
from lmscale_jax.errors import UserError  # noqa: E402
from lmscale_jax.store import file_io, output_marks  # noqa: E402
from lmscale_jax.study.host import cpu_name  # noqa: E402

TOOL = "benchmarks/quality_curve.py"
PRE, RAND = "pretrained + fine-tune", "random init + fine-tune"
# Each similarity set at the pool its issue judges it by: eval3 was built for pool 10,000 (issue 59).
POOLS = {"eval": 1000, "eval2": 1000, "eval3": 10000}
TASKS = {"eval": "eval R@1, pool 1,000, all pairs",
         "eval2": "eval2 R@1, pool 1,000, all pairs",
         "eval3": "eval3 R@1, pool 10,000, all pairs",
         "provenance-accuracy": "provenance accuracy",
         "provenance-macro-f1": "provenance macro-F1"}
# The measured rate of a plain JAX/Flax BERT-base MLM step, bf16, on one H200 (seq 512, batch
# 184): the shared anchor. Base, not large (463.6): the lower of the two, and the size nearer
# what a first GPU run of this study would pretrain.
RATE_TFLOPS = 424.7
RATE_SOURCE = ("plain JAX/Flax BERT-base MLM, bf16, one H200, 424.7 model TFLOP/s "
               "(../shared/bench/h200-anchor-2026-11-29.jsonl)")
HORIZONS = {"1 H200-hour": 3600, "1 H200-day": 86400}
VOCAB = 1058  # the study's tokenizer (docs/data-preparation.md), for a table that records none


def read_json(path: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise UserError(f"{path}: not readable JSON ({e}): give the tables of "
                    "benchmarks/longer_functions_table.py (OUT/longer_functions.json)") from None


# --- one cell: a variant of a table ------------------------------------------------------------

def cells_of(path: str, doc: dict, variants: set[str] | None, vocab: int) -> list[dict]:
  budget = doc.get("budget")
  if not isinstance(budget, dict) or "variants" not in budget:
    raise UserError(f"{path}: no budget.variants: not a table of "
                    "benchmarks/longer_functions_table.py")
  return [cell(path, doc, name, info, vocab) for name, info in budget["variants"].items()
          if variants is None or name in variants]


def cell(path: str, doc: dict, name: str, info: dict, vocab: int) -> dict:
  costs = (doc.get("pretraining") or {}).get(name) or assumed_costs(info, vocab)
  steps = costs.get("steps", info["steps"])
  tasks = {t: task_scores(doc, name, t) for t in TASKS}
  return {"file": os.path.relpath(path, ROOT), "variant": name, "device": doc.get("device"),
          "budget_s": doc["budget"]["budget_s"], "steps": steps,
          "model": costs["model"], "costs_from": costs.get("from", "the run's config.json"),
          "corpus_tokens": costs.get("corpus_tokens"), "flops_per_step": costs["flops_per_step"],
          "pretraining_flops": steps * costs["flops_per_step"],
          "tasks": {t: v for t, v in tasks.items() if v is not None},
          "baselines": baselines(doc),
          "missing_tasks": [t for t, v in tasks.items() if v is None]}


def baselines(doc: dict) -> dict:
  """TF-IDF + logistic regression on the provenance split, where the table has it."""
  scores = (doc.get("provenance_baseline") or {}).get("scores")
  if not scores:
    return {}
  return {"provenance-accuracy": scores["accuracy"], "provenance-macro-f1": scores["macro_f1"]}


def assumed_costs(info: dict, vocab: int) -> dict:
  """A table written before the runs' costs were recorded: configs/tiny.py with budget.json's
  overrides (seq, positions, norm, model), the study's vocabulary (only the MLM head depends
  on it: about 4% of a step's FLOPs)."""
  import ml_collections  # here only: the FLOPs formula's config type (tests give FLOPs)

  from lmscale_jax.config import loader
  from lmscale_jax.input import masking
  from lmscale_jax.model import flops

  overrides = [("model.positions", info["positions"]), ("model.norm", info["norm"])]
  overrides += [tuple(kv.split("=", 1)) for kv in filter(None, info.get("model", "").split(","))]
  overrides = [(k if k.startswith("model.") else f"model.{k}", v) for k, v in overrides]
  config = loader.load("configs/tiny.py", overrides, root=ROOT)
  model = {**config.model.to_dict(), "seq_len": info["seq_len"], "vocab_size": vocab}
  predictions = masking.num_predictions(config.data.mask_prob, config.data.max_predictions,
                                        info["seq_len"])
  fps = flops.train_flops_per_step(ml_collections.ConfigDict(model), config.train.batch_size,
                                   info["seq_len"], predictions)
  keep = ("layers", "hidden", "heads", "ffn", "seq_len", "positions", "norm", "vocab_size")
  return {"model": {k: model[k] for k in keep}, "flops_per_step": fps,
          "from": f"assumed: configs/tiny.py + budget.json's overrides, vocab {vocab} "
                  "(the table records no run config)"}


def task_scores(doc: dict, name: str, task: str) -> dict | None:
  if task in POOLS:
    return similarity_scores(doc, name, task)
  return provenance_scores(doc, name, task.removeprefix("provenance-").replace("-", "_"))


def similarity_scores(doc: dict, name: str, set_name: str) -> dict | None:
  rows = [r for r in doc.get("rows", []) if r["variant"] == name and r["set"] == set_name
          and r["pair"] == "all" and r["pool"] == POOLS[set_name]]
  if not rows:
    return None
  r = rows[0]
  if "per_seed" in r:
    s = r["per_seed"]
    return {"pretrained_ft": list(s["pretrained_ft"].values()),
            "random_ft": list(s["random_ft"].values()), "gain": list(s["gain"]),
            "gain_paired": True, "from": "per seed"}
  n = r["pretrained_ft"].get("n", 0)
  if n in (1, 2):  # the summary's min and max are the seeds themselves (the gain's: paired)
    seeds = (lambda d: [d["mean"]]) if n == 1 else (lambda d: [d["min"], d["max"]])
    return {"pretrained_ft": seeds(r["pretrained_ft"]), "random_ft": seeds(r["random_ft"]),
            "gain": seeds(r["gain"]), "gain_paired": True,
            "from": f"the summary's {'mean' if n == 1 else 'min and max'} ({n} seeds)"}
  return {"pretrained_ft": [r["pretrained_ft"]["mean"]], "random_ft": [r["random_ft"]["mean"]],
          "gain": [r["gain"]["mean"]], "gain_paired": False, "from": "means only"}


def provenance_scores(doc: dict, name: str, metric: str) -> dict | None:
  # The curve's cells read one window per function (longer_functions.sh's CLS_WINDOWS=1).
  rows = {r["start"]: r for r in doc.get("provenance") or []
          if r["variant"] == name and r.get("windows", 1) == 1}
  pre, rand = rows.get(PRE), rows.get(RAND)
  if pre is None or rand is None:
    return None
  if "per_seed" in pre and "per_seed" in rand:
    a, b = pre["per_seed"], rand["per_seed"]
    return {"pretrained_ft": [v[metric] for v in a.values()],
            "random_ft": [v[metric] for v in b.values()],
            "gain": [a[s][metric] - b[s][metric] for s in sorted(a.keys() & b.keys())],
            "gain_paired": True, "from": "per seed"}
  # Older tables: each start's mean, min and max over its seeds, the seeds unnamed: the gain
  # is the difference of the means, one point (no seed pairing to be had).
  seeds = lambda r: [r[metric]["min"], r[metric]["max"]] if r["runs"] == 2 else [r[metric]["mean"]]
  return {"pretrained_ft": seeds(pre), "random_ft": seeds(rand),
          "gain": [pre[metric]["mean"] - rand[metric]["mean"]], "gain_paired": False,
          "from": "each start's summary; the gain: the difference of the means (seeds unpaired)"}


# --- the study: cells, what is missing, the fits -----------------------------------------------

def read_cells(paths: list[str], variants: set[str] | None, vocab: int) -> list[dict]:
  cells, seen = [], {}
  for path in paths:
    for c in cells_of(path, read_json(path), variants, vocab):
      key = (c["variant"], c["budget_s"])
      if key in seen:
        raise UserError(f"{path}: {c['variant']} at {c['budget_s']} s is also in {seen[key]}: "
                        "give each cell once")
      seen[key] = path
      cells.append(c)
  return sorted(cells, key=lambda c: (c["variant"], c["pretraining_flops"]))


def parse_expect(items: list[str]) -> list[tuple[str, int]]:
  out = []
  for item in items:
    name, at, budgets = item.partition("@")
    try:
      out += [(name, int(b)) for b in budgets.split(",")]
    except ValueError:
      raise UserError(f"--expect {item!r}: expected NAME@SECONDS[,SECONDS…], e.g. "
                      "seq256-instruction@900,1800") from None
    if not name or not at:
      raise UserError(f"--expect {item!r}: expected NAME@SECONDS[,SECONDS…]")
  return out


def missing(cells: list[dict], expect: list[tuple[str, int]]) -> list[dict]:
  have = {(c["variant"], c["budget_s"]): c for c in cells}
  out = [{"variant": v, "budget_s": b, "budget": budget_label(b), "what": "the whole cell"}
         for v, b in expect if (v, b) not in have]
  for c in cells:
    out += [{"variant": c["variant"], "budget_s": c["budget_s"], "budget":
             budget_label(c["budget_s"]), "what": TASKS[t]} for t in c["missing_tasks"]]
  return out


def fits(cells: list[dict], rate_tflops: float, gone: list[dict] = ()) -> list[dict]:
  out = []
  for variant in sorted({c["variant"] for c in cells}):
    mine = [c for c in cells if c["variant"] == variant]
    # The model's missing budgets, at its cells' FLOPs per budget second (one step time):
    # predictions a later cell of the study checks.
    per_s = mean([c["pretraining_flops"] / c["budget_s"] for c in mine])
    later = {f"{m['budget']} on this CPU (missing)": m["budget_s"] * per_s for m in gone
             if m["variant"] == variant and m["what"] == "the whole cell"}
    for task in TASKS:
      have = [c for c in mine if task in c["tasks"]]
      gain = quality_fit.fit(points(have, task, "gain"))
      score = quality_fit.fit(points(have, task, "pretrained_ft"))
      if gain is None:
        continue
      out.append({"variant": variant, "task": task, "label": TASKS[task],
                  "cells": len(have), "gain": gain, "pretrained_ft": score,
                  "random_ft_mean": mean([v for c in have for v in c["tasks"][task]["random_ft"]]),
                  "predictions": predictions(gain, score, rate_tflops, later)})
  return out


def points(cells: list[dict], task: str, what: str) -> list[tuple[float, float]]:
  return [(math.log10(c["pretraining_flops"]), v) for c in cells
          for v in c["tasks"][task][what]]


def predictions(gain: dict, score: dict | None, rate_tflops: float,
                later: dict[str, float]) -> dict:
  """At each of ``later`` (label -> FLOPs: the study's missing cells) and each GPU horizon,
  only where the trend has ≥ 3 budgets: the fitted gain and pretrained score, each with its
  95% interval."""
  if not gain["trend"]:
    return {}
  at = {**later, **{k: rate_tflops * 1e12 * s for k, s in HORIZONS.items()}}
  out = {}
  for label, flops in at.items():
    x = math.log10(flops)
    out[label] = {"flops": flops, "gain": quality_fit.predict(gain, x),
                  "pretrained_ft": score and quality_fit.predict(score, x)}
  return out


def mean(values: list[float]) -> float:
  return sum(values) / len(values)


# --- the outputs ---------------------------------------------------------------------------------

def budget_label(seconds: int) -> str:
  return f"{seconds / 3600:g} h" if seconds >= 3600 else f"{seconds / 60:g} min"


def span(values: list[float], sign: str = "") -> str:
  if len(values) == 1:
    return f"{values[0]:{sign}.3f}"
  return f"{mean(values):{sign}.3f} [{min(values):{sign}.3f}, {max(values):{sign}.3f}]"


def table_markdown(cells: list[dict]) -> str:
  lines = ["| model | budget (steps) | pretraining FLOPs | task | pretrained + FT | "
           "random init + FT | pretraining gain |", "|---|---|---|---|---|---|---|"]
  for c in cells:
    for task, s in c["tasks"].items():
      gain = span(s["gain"], "+") + ("" if s["gain_paired"] else " (means, unpaired)")
      lines.append(f"| {c['variant']} | {budget_label(c['budget_s'])} ({c['steps']:,}) | "
                   f"{c['pretraining_flops']:.3g} | {TASKS[task]} | {span(s['pretrained_ft'])} | "
                   f"{span(s['random_ft'])} | {gain} |")
  return "\n".join(lines)


def fits_markdown(rows: list[dict]) -> str:
  lines = ["| model | task | cells (points) | gain per decade of FLOPs ± SE [95%] | "
           "pretrained + FT per decade ± SE |", "|---|---|---|---|---|"]
  for r in rows:
    g, s = r["gain"], r["pretrained_ft"]
    note = "" if g["trend"] else " (2 budgets: a line through them, no trend)"
    lines.append(f"| {r['variant']} | {r['label']} | {r['cells']} ({g['n_points']}) | "
                 f"{slope_text(g)}{note} | {slope_text(s) if s else '—'} |")
  return "\n".join(lines)


def slope_text(f: dict) -> str:
  if f["slope_se"] is None:
    return f"{f['slope_per_decade']:+.3f} (no SE: no degree of freedom)"
  lo, hi = f["slope_interval"]
  return f"{f['slope_per_decade']:+.3f} ± {f['slope_se']:.3f} [{lo:+.3f}, {hi:+.3f}]"


def predictions_markdown(rows: list[dict]) -> str:
  lines = ["| model | task | at | FLOPs | decades past the data | gain [95%] | "
           "pretrained + FT [95%] |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    for label, p in r["predictions"].items():
      lines.append(f"| {r['variant']} | {r['label']} | {label} | {p['flops']:.3g} | "
                   f"{p['gain']['decades_beyond_data']:.1f} | "
                   f"{predicted(p['gain'], '+', 1 - r['random_ft_mean'])} | "
                   f"{predicted(p['pretrained_ft'], '', 1.0)} |")
  return "\n".join(lines)


def predicted(p: dict | None, sign: str, ceiling: float) -> str:
  """The fitted mean and interval; past ``ceiling`` (a score of 1; a gain of 1 minus the
  random start's score) it is said to be where the straight line cannot hold."""
  if p is None:
    return "—"
  text = f"{p['mean']:{sign}.3f}"
  if p["interval"]:
    text += f" [{p['interval'][0]:{sign}.3f}, {p['interval'][1]:{sign}.3f}]"
  if p["mean"] > ceiling:
    text += f" (past the ceiling {ceiling:.3f}: the line cannot hold there)"
  return text


def markdown(cells, gone, rows, rate_tflops) -> str:
  parts = ["## Cells", table_markdown(cells), "## Missing",
           "\n".join(f"- {m['variant']} at {m['budget']}: {m['what']}" for m in gone) or "none",
           "## Trend: least squares on the per-seed points against log10(pretraining FLOPs)",
           fits_markdown(rows),
           "## Predictions: the study's missing cells, then an H200 at "
           f"{rate_tflops:g} TFLOP/s (the anchor: {RATE_SOURCE}); extrapolations of the "
           "line, to be checked by those cells and on a GPU", predictions_markdown(rows) if any(
               r["predictions"] for r in rows) else "no fit has 3 budgets: none stated"]
  return "\n\n".join(parts) + "\n"


def write_markdown(path: str, text: str) -> None:
  file_io.atomic_write_bytes(path, f"<!-- {TOOL} -->\n{text}".encode())  # temp, then rename


def owns_text(path: str, tool: str) -> bool:
  """A markdown or PNG output is this tool's own when its first bytes name it (the comment
  line, the PNG's Software text chunk)."""
  try:
    with open(path, "rb") as f:
      return tool.encode() in f.read(4096)
  except OSError:
    return False


def main(argv=None) -> int:
  p = cli_args.Parser(prog=TOOL, description=__doc__.split("\n")[0])
  p.add_argument("tables", nargs="+", type=cli_args.input_file, metavar="TABLE.json",
                 help="longer_functions_table.py JSONs (OUT/longer_functions.json), one per cell")
  p.add_argument("--variant", action="append", default=None, metavar="NAME",
                 help="only these variants (default: all in the tables)")
  p.add_argument("--expect", action="append", default=[], metavar="NAME@S,S,…",
                 help="the grid: cells listed as missing where no table holds them")
  p.add_argument("--rate-tflops", type=cli_args.number(float, 1e-3, 1e6), default=RATE_TFLOPS,
                 help=f"the GPU's sustained model TFLOP/s (default {RATE_TFLOPS}: {RATE_SOURCE})")
  p.add_argument("--vocab", type=cli_args.number(int, 1, 1 << 24), default=VOCAB,
                 help=f"the vocabulary of a table that records no run config (default {VOCAB})")
  p.add_argument("--json", default=None, type=cli_args.output_file, metavar="OUT.json")
  p.add_argument("--markdown", default=None, metavar="OUT.md",
                 type=cli_args.OutputFile(owns=owns_text))
  p.add_argument("--plot", default=None, metavar="OUT.png", type=cli_args.OutputFile(owns=owns_text))
  a = p.parse_args(argv)
  return cli_args.guarded(lambda: run(a), "nothing was written")


def run(a: argparse.Namespace) -> int:
  expect = parse_expect(a.expect)
  cells = read_cells(a.tables, set(a.variant) if a.variant else None, a.vocab)
  gone = missing(cells, expect)
  rows = fits(cells, a.rate_tflops, gone)
  text = markdown(cells, gone, rows, a.rate_tflops)
  print(text, end="")
  if a.markdown:
    write_markdown(a.markdown, text)
  if a.plot:
    from benchmarks import quality_plot  # matplotlib only where a plot is asked for
    quality_plot.plot(cells, rows, list(TASKS.items()), a.plot, TOOL)
  if a.json:
    output_marks.write_json(a.json, TOOL, {
        "date": datetime.date.today().isoformat(), "device": cpu_name(),
        "what": "issue 59: downstream quality and the pretraining gain against pretraining FLOPs",
        "inputs": [os.path.relpath(t, ROOT) for t in a.tables], "expect": a.expect,
        "fit": "ordinary least squares on the per-seed points against log10(FLOPs); slope ± "
               "standard error, Student-t 95% intervals (benchmarks/quality_fit.py)",
        "rate": {"tflops": a.rate_tflops, "source": RATE_SOURCE, "horizons_s": HORIZONS},
        "cells": cells, "missing": gone, "fits": rows})
  return 0


if __name__ == "__main__":
  sys.exit(main())
