"""The budget.json of one cell of the quality-against-compute study (benchmarks/quality_study.sh),
written before the cell runs, so benchmarks/longer_functions.sh uses it as it is:

  python benchmarks/quality_budget.py --variant NAME:SEQ:POSITIONS:NORM[:MODEL] --budget-s S
      --step-time T [--match VARIANT --match-step-time T0 --data DATASET] [--output budget.json]

Without --match: S / T steps (T the study's one calibrated step time, so every budget of the
default encoder shares it, whatever the machine's load when each ran). With --match (the
model-size axis): the steps that spend the pretraining FLOPs of --match at S / T0 steps
(model/flops.py's train_flops_per_step of both models, the vocabulary from DATASET's
metadata.json), T being this model's own calibrated step time, recorded to say the cell's CPU
time. Without --output the JSON goes to standard output (the study's dry run)."""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import quality_curve  # noqa: E402
from lmscale_jax.cli import args as cli_args  # noqa: E402
from lmscale_jax.errors import UserError  # noqa: E402
from lmscale_jax.store import output_marks  # noqa: E402

TOOL = "benchmarks/quality_budget.py"


def variant(text: str) -> tuple[str, dict]:
  """NAME:SEQ:POSITIONS:NORM[:MODEL] (benchmarks/longer_functions.sh's VARIANTS word)."""
  parts = text.split(":")
  if len(parts) not in (4, 5) or not parts[1].isdigit():
    raise argparse.ArgumentTypeError(f"{text!r}: expected NAME:SEQ:POSITIONS:NORM[:MODEL], e.g. "
                                     "seq256-instruction:256:instruction:post")
  info = {"seq_len": int(parts[1]), "positions": parts[2], "norm": parts[3]}
  if len(parts) == 5 and parts[4]:
    info["model"] = parts[4]
  return parts[0], info


def budget(a: argparse.Namespace) -> dict:
  name, info = a.variant
  steps = max(1, round(a.budget_s / a.step_time))
  entry = {**info, "step_time": a.step_time, "steps": steps}
  if a.match:
    vocab = dataset_vocab(a.data)
    ref_name, ref = a.match
    ref_steps = max(1, round(a.budget_s / a.match_step_time))
    ref_fps = quality_curve.assumed_costs(ref, vocab)["flops_per_step"]
    fps = quality_curve.assumed_costs(info, vocab)["flops_per_step"]
    entry.update(steps=max(1, round(ref_steps * ref_fps / fps)), flops_per_step=fps,
                 flops_matched_to={"variant": ref_name, "steps": ref_steps,
                                   "flops_per_step": ref_fps, "step_time": a.match_step_time})
  return {"budget_s": a.budget_s, "variants": {name: entry}}


def dataset_vocab(path: str) -> int:
  meta = os.path.join(path, "metadata.json")
  try:
    with open(meta) as f:
      return int(json.load(f)["vocab_size"])
  except (OSError, ValueError, KeyError) as e:
    raise UserError(f"{meta}: no vocab_size ({e}): prepare the study's data first "
                    "(benchmarks/longer_functions.sh does)") from None


def main(argv=None) -> int:
  p = cli_args.Parser(prog=TOOL, description=__doc__.split("\n")[0])
  p.add_argument("--variant", required=True, type=variant)
  p.add_argument("--budget-s", required=True, type=cli_args.number(int, 1, 10**8))
  p.add_argument("--step-time", required=True, type=cli_args.number(float, 1e-6, 1e6),
                 help="this variant's seconds per step (the calibrated one)")
  p.add_argument("--match", type=variant, default=None,
                 help="spend this variant's pretraining FLOPs at --budget-s instead")
  p.add_argument("--match-step-time", type=cli_args.number(float, 1e-6, 1e6), default=None)
  p.add_argument("--data", default=None, help="(--match) the prepared pretraining data")
  p.add_argument("--output", default=None, type=cli_args.output_file, metavar="budget.json")
  a = p.parse_args(argv)
  if a.match and (a.match_step_time is None or a.data is None):
    p.error("--match needs --match-step-time and --data")
  return cli_args.guarded(lambda: write(a), "nothing was written")


def write(a: argparse.Namespace) -> int:
  if a.output is None:
    sys.stdout.write(output_marks.json_bytes(TOOL, budget(a)).decode())
  else:
    output_marks.write_json(a.output, TOOL, budget(a))
  return 0


if __name__ == "__main__":
  sys.exit(main())
