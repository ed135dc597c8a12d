"""Tables and plots of lmscale sweep results (and of the storage model's output).

  lmscale report benchmarks/results/2026-12-01-cpu-sweep.jsonl --output docs/scaling

Prints markdown tables (also written to OUTPUT/report.md) and writes small PNGs (600×400):
  scaling.png  samples/s against the number of processes, with the ideal line (the fewest
               processes' rate × devices / its devices: per-device batch fixed, weak scaling)
               and the efficiency (measured / ideal) at each point;
  workers.png  input-wait fraction and step time against data.workers;
  models.png   samples/s against the per-device batch for each model (out-of-memory points
               marked), and the largest batch that ran against the parameter count;
  storage.png  staged node-local reads against shared-storage reads by node count, from the
               storage model (lmscale storage-model --json saved to a file, or
               benchmarks/results/*-cpu-storage*.jsonl; given with --storage, else read when
               present): the step time reading from shared storage (shared_step_s) against
               the step from a staged copy, and the one-off costs (staging vs opening every
               shard). Also read: rows with "nodes" and a mode field (staged|local vs
               shared), or paired "staged_…"/"shared_…" numbers.
A plot without the rows it needs is skipped with one line saying what is missing. Only the
latest row of each sweep point counts.
"""

from __future__ import annotations

import argparse
import sys

from lmscale_jax.cli import args
from lmscale_jax.study import report as rp


def main(argv=None) -> int:
  p = args.Parser(prog="lmscale report", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("results", nargs="+", type=args.input_file, metavar="RESULTS",
                 help="lmscale sweep JSONL files")
  p.add_argument("--output", required=True, type=args.output_dir, metavar="DIR",
                 help="where the PNGs go")
  p.add_argument("--storage", nargs="*", type=args.input_file, metavar="JSONL",
                 help=f"storage-model rows (default: {rp.STORAGE_GLOB} if any)")
  a = p.parse_args(argv)
  return args.guarded(lambda: show(*rp.write_report(a.results, a.output, a.storage)),
                      "rerun it")


def show(text: str, made: list[str]) -> int:
  print(text)
  print()
  for m in made:  # a plot's path, or the line saying why it was skipped
    print(m if m.endswith(")") and "skipped" in m else f"wrote {m}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
