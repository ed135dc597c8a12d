"""Build the function-naming task: ELF files and function-groups files → names split by library.

  lmscale naming-build [--elf FILE …] [--bench FILE …] --output DIR [--test-fraction 0.25]
      [--seed 0] [--variants one|all] [--min-instructions 8]

One example per named function of each ELF file (its symbol table: this machine's libraries'
exported functions, binaries you compile) and per function group of each function-groups file
(lmscale similarity-build: one variant per group, or all), labelled with its normalised name
and sub-tokens (symbol versions, compiler suffixes and leading underscores removed; generated,
unnamed and C++ names dropped and counted), split by library so that no library is on both
sides and no function text of the test split is in training. DIR gets train.jsonl and
test.jsonl ({"text", "name", "tokens", "library", "function", "binary"} per line, and "calls"
for ELF examples: the names each calls that a stripped copy still shows) and
task.json (the files and their sha256, the rules, the split, counts, the training token counts,
the share of test tokens never seen in training); the same files and seed write byte-identical
files. The rules: lmscale_jax/similarity/naming_task.py and symbol_names.py; the baselines:
benchmarks/naming_baselines.py.
"""

from __future__ import annotations

import sys

from lmscale_jax.cli import args
from lmscale_jax.similarity import naming_task


def parser():
  p = args.Parser(prog="lmscale naming-build", description=__doc__.splitlines()[0])
  p.add_argument("--elf", nargs="+", default=[], type=args.input_file, metavar="FILE",
                 help="ELF files with symbol tables (x86-64): each its own library (soname)")
  p.add_argument("--bench", nargs="+", default=[], type=args.input_file, metavar="FILE",
                 help="function-groups files (lmscale similarity-build)")
  p.add_argument("--output", required=True, type=args.output_dir, metavar="DIR",
                 help="the task's directory: new or empty")
  p.add_argument("--test-fraction", type=args.number(float, 0.01, 0.99),
                 default=naming_task.TEST_FRACTION,
                 help="the test split's target share of the functions (default 0.25)")
  p.add_argument("--seed", type=args.number(int, 0, 2**31 - 1), default=0,
                 help="which libraries go to the test split, which variant is kept (default 0)")
  p.add_argument("--variants", choices=naming_task.VARIANTS, default="one",
                 help="of a function group: one (seeded) variant or all (default one)")
  p.add_argument("--min-instructions", type=args.number(int, 1, 2**31 - 1),
                 default=naming_task.MIN_INSTRUCTIONS, metavar="N",
                 help="drop functions under N instructions (default 8, the corpora's)")
  return p


def main(argv=None) -> int:
  a = parser().parse_args(argv)
  if not a.elf and not a.bench:
    parser().error("give --elf FILE … and/or --bench FILE …")

  def go() -> int:
    naming_task.check_output(a.output)  # before reading the files
    splits, task = naming_task.build(a.elf, a.bench, test_fraction=a.test_fraction,
                                     seed=a.seed, variants=a.variants,
                                     min_instructions=a.min_instructions)
    naming_task.write(a.output, splits, task)
    print(f"{a.output}: {naming_task.summary_line(task)}")
    return 0

  return args.guarded(go, "a task directory without task.json did not finish")


if __name__ == "__main__":
  sys.exit(main())
