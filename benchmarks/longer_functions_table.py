"""The table of benchmarks/longer_functions.sh: each variant's claims.json (similarity_seeds.py)
side by side, with the pretraining budget each had.

  python benchmarks/longer_functions_table.py --study OUT [--json OUT.json]

Per variant and held-out set: R@1 of "pretrained + fine-tune" and of "random init + fine-tune"
(mean over the fine-tuning seeds, [min, max]) at pool 100 and 1,000 over all pairs and at
gcc O0↔O3 (and at pool 10,000 where a set was scored there: eval3), and what pretraining adds (the seed-paired difference, and whether it is above zero
at every seed); then the compiler-provenance task's held-out accuracy and macro-F1 from each
variant's weights and from random ones, beside the TF-IDF baseline. The issue's goals are
printed beside: pool 1,000 all pairs R@1 ≥ 0.50, and pretraining worth ≥ +0.08 there. The
JSON also keeps each seed's scores (``per_seed``) and each variant's pretraining costs (model,
batch, steps, corpus tokens, FLOPs per step): what benchmarks/quality_curve.py plots against
pretraining FLOPs.
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import re
import sys

from lmscale_jax.cli import args as cli_args
from lmscale_jax.errors import UserError
from lmscale_jax.store import output_marks
from lmscale_jax.study.host import cpu_name

TOOL = "benchmarks/longer_functions_table.py"  # the parser's prog, and its --json's mark

PRE, RAND = "pretrained + fine-tune", "random init + fine-tune"
# Pool 10,000 where a set was scored there (eval3: benchmarks/similarity_claims.sh with EVAL3).
CELLS = (("all", 100), ("all", 1000), ("gcc-O0↔gcc-O3", 1000), ("all", 10000),
         ("gcc-O0↔gcc-O3", 10000))
GOAL_R1, GOAL_GAIN = 0.50, 0.08  # issue 38, pool 1,000 all pairs


def read_json(path: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise UserError(f"{path}: not readable JSON ({e}): run benchmarks/longer_functions.sh "
                    "to the end first") from None


def variant_rows(name: str, claims: dict, budget: dict) -> list[dict]:
  """One row per (set, cell) of a variant's claims.json."""
  cells = {(c["set"], c["label"], c["pair"], c["pool"]): c["recall_at_1_summary"]
           for c in claims["cells"]}
  runs = {(c["set"], c["label"], c["pair"], c["pool"]): c for c in claims["cells"]}
  gains = {(c["set"], c["pair"], c["pool"]): c for c in claims["comparisons"]
           if (c["a"], c["b"]) == (PRE, RAND)}
  rows = []
  for s in sorted({key[0] for key in cells}):
    for pair, pool in CELLS:
      pre, rand = cells.get((s, PRE, pair, pool)), cells.get((s, RAND, pair, pool))
      gain = gains.get((s, pair, pool))
      if pre is None or rand is None or gain is None:
        continue
      rows.append({"variant": name, **budget, "set": s, "pair": pair, "pool": pool,
                   "pretrained_ft": pre, "random_ft": rand,
                   "gain": {k: gain[k] for k in ("mean", "min", "max", "holds_every_run")},
                   "per_seed": per_seed(runs[(s, PRE, pair, pool)],
                                        runs[(s, RAND, pair, pool)], gain)})
  return rows


def per_seed(pre: dict, rand: dict, gain: dict) -> dict:
  """Each fine-tuning seed's R@1 from both starts and their difference, paired as the
  comparison paired them (what a trend over budgets is fitted to: benchmarks/quality_curve.py)."""
  return {"runs": gain["pairs_of_runs"], "gain": gain["recall_at_1_diff"],
          "pretrained_ft": dict(zip(pre["runs"], pre["recall_at_1"])),
          "random_ft": dict(zip(rand["runs"], rand["recall_at_1"]))}


CLS_RUN = re.compile(r"cls-(pre|rand)-s(\d+)(?:-w(\d+))?$")  # longer_functions.sh's names


def provenance_rows(study: str, budget: dict) -> list[dict]:
  """Per variant, start (pretrained / random) and windows read per function (CLS_WINDOWS): the
  classification runs' held-out accuracy and macro-F1
  (``cls-{pre,rand}-s{seed}[-w{windows}]/classification_eval.json``), over seeds."""
  rows = []
  for name in budget["variants"]:
    runs = {}
    for path in sorted(glob.glob(os.path.join(study, name, "cls-*", "classification_eval.json"))):
      m = CLS_RUN.match(os.path.basename(os.path.dirname(path)))
      if m:
        runs.setdefault((int(m[3] or 1), m[1]), {})[m[2]] = read_json(path)
    for (windows, start), by_seed in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][1])):
      scores = list(by_seed.values())
      rows.append({"variant": name, "start": PRE if start == "pre" else RAND,
                   "windows": windows, "runs": len(scores),
                   **{k: summary([s[k] for s in scores]) for k in ("accuracy", "macro_f1")},
                   "per_seed": {seed: {k: s[k] for k in ("accuracy", "macro_f1")}
                                for seed, s in by_seed.items()}})
  return rows


def pretraining(study: str, budget: dict) -> dict:
  """Per variant: the pretraining run's resolved model, batch, steps and corpus size (its
  config.json and the dataset's metadata.json), and its FLOPs per step
  (model/flops.py's train_flops_per_step, the MFU numerator), where the run is there."""
  out = {}
  for name in budget["variants"]:
    path = os.path.join(study, name, "pretrain", "run", "config.json")
    if os.path.exists(path):
      out[name] = run_costs(read_json(path))
  return out


def run_costs(record: dict) -> dict:
  from lmscale_jax.input import masking  # only where a run is there (and ml_collections)
  from lmscale_jax.model import flops
  import ml_collections

  config, model = record["config"], record["model"]
  predictions = masking.num_predictions(config["data"]["mask_prob"],
                                        config["data"]["max_predictions"], model["seq_len"])
  batch = config["train"]["batch_size"]
  meta = os.path.join(config["data"]["path"], "metadata.json")
  tokens = read_json(meta)["tokens"] if os.path.exists(meta) else None
  return {"model": model, "batch_size": batch, "predictions": predictions,
          "steps": config["train"]["steps"], "corpus_tokens": tokens,
          "flops_per_step": flops.train_flops_per_step(
              ml_collections.ConfigDict(model), batch, model["seq_len"], predictions)}


def summary(values: list[float]) -> dict:
  return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


def provenance_markdown(rows: list[dict], baseline: dict | None) -> str:
  lines = ["| variant | start | accuracy | macro-F1 |", "|---|---|---|---|"]
  for r in rows:
    seeds = f"{r['runs']} seed{'s' if r['runs'] > 1 else ''}"
    windows = f", {r['windows']} windows" if r.get("windows", 1) > 1 else ""
    lines.append(f"| {r['variant']} | {r['start']} ({seeds}{windows}) | {fmt(r['accuracy'])} | "
                 f"{fmt(r['macro_f1'])} |")
  if baseline:
    lines.append(f"| TF-IDF + logistic regression | — | {baseline['accuracy']:.3f} | "
                 f"{baseline['macro_f1']:.3f} |")
  return "\n".join(lines)


def fmt(summary: dict) -> str:
  return f"{summary['mean']:.3f} [{summary['min']:.3f}, {summary['max']:.3f}]"


def markdown(rows: list[dict]) -> str:
  lines = ["| variant | set | cell | pretrained + ft | random init + ft | pretraining adds |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    gain = r["gain"]
    holds = "every seed" if gain["holds_every_run"] else "not every seed"
    lines.append(f"| {r['variant']} | {r['set']} | {r['pair']} @{r['pool']} | "
                 f"{fmt(r['pretrained_ft'])} | {fmt(r['random_ft'])} | "
                 f"{gain['mean']:+.3f} [{gain['min']:+.3f}, {gain['max']:+.3f}], {holds} |")
  return "\n".join(lines)


def goals(rows: list[dict]) -> list[str]:
  out = []
  for r in rows:
    if (r["pair"], r["pool"]) != ("all", 1000):
      continue
    r1, gain = r["pretrained_ft"]["mean"], r["gain"]["mean"]
    out.append(f"{r['variant']} on {r['set']}: pool 1,000 R@1 {r1:.3f} (goal ≥ {GOAL_R1}: "
               f"{'met' if r1 >= GOAL_R1 else 'not met'}), pretraining adds {gain:+.3f} "
               f"(goal ≥ +{GOAL_GAIN}: {'met' if gain >= GOAL_GAIN else 'not met'})")
  return out


def main(argv=None) -> int:
  p = cli_args.Parser(prog=TOOL, description=__doc__.split("\n")[0])
  p.add_argument("--study", required=True, help="the OUT of benchmarks/longer_functions.sh")
  p.add_argument("--json", default=None, type=cli_args.output_file, metavar="OUT.json")
  a = p.parse_args(argv)
  try:
    budget = read_json(os.path.join(a.study, "budget.json"))
    rows = []
    for name, info in budget["variants"].items():
      claims = read_json(os.path.join(a.study, name, "claims.json"))
      rows += variant_rows(name, claims, {**info, "budget_s": budget["budget_s"]})
    baseline_path = os.path.join(a.study, "provenance-baseline.json")
    baseline = read_json(baseline_path) if os.path.exists(baseline_path) else None
    provenance = provenance_rows(a.study, budget)
    costs = pretraining(a.study, budget)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(markdown(rows))
  print("\n".join(goals(rows)))
  print("\nCompiler provenance (held-out libraries):")
  print(provenance_markdown(provenance, baseline and baseline.get("scores")))
  if a.json:
    output_marks.write_json(a.json, TOOL, {
        "date": datetime.date.today().isoformat(), "device": cpu_name(),
        "what": "issue 38: longer functions, instruction positions, pre-LN (same CPU budget)",
        "budget": budget, "rows": rows, "goals": goals(rows), "provenance": provenance,
        "pretraining": costs,
        "provenance_baseline": baseline})
  return 0


if __name__ == "__main__":
  sys.exit(main())
