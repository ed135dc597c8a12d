"""Report the functions a training pairs file shares with an evaluation benchmark.

  lmscale similarity-leakage --train TRAIN.jsonl --bench BENCH.jsonl [--json OUT]
      [--check]

Both files as lmscale similarity-build writes them. Shared: a training group with a
function text (normalised-text hash, "digest") that is in the benchmark, or with the same
source file basename + function name (one library vendored in two packages). Prints one line
and the report as JSON; --check makes any shared group an error (exit 1, one line naming how
many and which). To write a training file without them: lmscale similarity-build
--disjoint-from BENCH. The keys: lmscale_jax/similarity/leakage.py.
"""

from __future__ import annotations

import json
import os
import sys

from lmscale_jax.cli import args
from lmscale_jax.similarity import function_groups
from lmscale_jax.similarity import leakage as similarity_leakage
from lmscale_jax.store import output_marks

TOOL = "lmscale similarity-leakage"  # the parser's prog, and the mark its --json carries


def parser():
  p = args.Parser(prog=TOOL, description=__doc__.splitlines()[0])
  p.add_argument("--train", required=True, type=args.input_file, metavar="TRAIN",
                 help="the training pairs file")
  p.add_argument("--bench", required=True, type=args.input_file, metavar="BENCH",
                 help="the evaluation benchmark")
  p.add_argument("--json", type=args.output_file, default=None, metavar="OUT",
                 help="also write the report here")
  p.add_argument("--check", action="store_true",
                 help="exit 1 (one error line) if anything is shared")
  return p


def main(argv=None) -> int:
  a = parser().parse_args(argv)

  def go() -> int:
    train = load("--train", a.train)
    bench = load("--bench", a.bench)
    rep = {"train": a.train, "bench": a.bench, **similarity_leakage.report(train, bench)}
    line = similarity_leakage.summary_line(rep)
    if a.json:
      output_marks.write_json(a.json, TOOL, rep)
    if a.check and rep["shared_either"]:
      raise function_groups.FunctionGroupsError(f"{a.train}: {line} (rebuild it with "
                                        f"lmscale similarity-build --disjoint-from "
                                        f"{a.bench})")
    print(line)
    print(json.dumps(rep, indent=2))
    return 0

  return args.guarded(go, "nothing was written")


def load(flag: str, path: str) -> list[dict]:
  if not os.path.isfile(path):
    raise function_groups.FunctionGroupsError(f"{flag} {path}: no such file (build it with "
                                      "lmscale similarity-build)")
  return function_groups.load(path)[1]


if __name__ == "__main__":
  sys.exit(main())
