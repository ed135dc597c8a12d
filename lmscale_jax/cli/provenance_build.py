"""Build the compiler-provenance task: function-groups files → a labelled train/test split.

  lmscale provenance-build --bench FILE [FILE …] --output DIR [--test-fraction 0.25]
      [--seed 0] [--variants gcc-O0,gcc-O2,…] [--max-per-label N]

One example per (function group, variant), labelled with the variant (compiler-level, e.g.
gcc-O2), split by source library (a group's source path's first directory) so that no library
is in both splits, and no function text of the test split is in training (dropped from
training and counted). DIR gets train.jsonl and test.jsonl ({"text", "label", "library", "function",
"binary"} per line) and task.json (the files and their sha256, the labels, the split, counts);
the same files and seed write byte-identical files. The rule:
lmscale_jax/similarity/provenance.py; the baseline: benchmarks/provenance_baseline.py.
"""

from __future__ import annotations

import sys

from lmscale_jax.cli import args
from lmscale_jax.similarity import provenance


def parser():
  p = args.Parser(prog="lmscale provenance-build", description=__doc__.splitlines()[0])
  p.add_argument("--bench", nargs="+", required=True, type=args.input_file, metavar="FILE",
                 help="function-groups files (lmscale similarity-build): benchmarks or pairs")
  p.add_argument("--output", required=True, type=args.output_dir, metavar="DIR",
                 help="the task's directory: new or empty")
  p.add_argument("--test-fraction", type=args.number(float, 0.01, 0.99),
                 default=provenance.TEST_FRACTION,
                 help="the test split's target share of the examples (default 0.25)")
  p.add_argument("--seed", type=args.number(int, 0, 2**31 - 1), default=0,
                 help="which libraries go to the test split (default 0)")
  p.add_argument("--variants", default="", metavar="V,V,…",
                 help="the labels to keep (default: the variants every file holds)")
  p.add_argument("--max-per-label", type=args.number(int, 1, 2**31 - 1), default=None,
                 metavar="N", help="at most N examples of a label in each split")
  return p


def main(argv=None) -> int:
  a = parser().parse_args(argv)

  def go() -> int:
    provenance.check_output(a.output)  # before reading the files
    variants = [v for v in a.variants.split(",") if v] or None
    splits, task = provenance.build(a.bench, test_fraction=a.test_fraction, seed=a.seed,
                                    variants=variants, max_per_label=a.max_per_label)
    provenance.write(a.output, splits, task)
    print(f"{a.output}: {provenance.summary_line(task)}")
    return 0

  return args.guarded(go, "a task directory without task.json did not finish")


if __name__ == "__main__":
  sys.exit(main())
