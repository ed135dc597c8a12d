"""Report the functions a training pairs file shares with an evaluation benchmark.

  python tools/similarity_leakage.py --train TRAIN.jsonl --bench BENCH.jsonl [--json OUT]
      [--check]

Both files as tools/build_similarity_bench.py writes them. Shared: a training group with a
function text (normalised-text hash, "digest") that is in the benchmark, or with the same
source file basename + function name (one library vendored in two packages). Prints one line
and the report as JSON; --check makes any shared group an error (exit 2, one line naming how
many and which). To write a training file without them: build_similarity_bench.py
--disjoint-from BENCH. The keys: lmscale_jax/similarity/leakage.py.
"""

from __future__ import annotations

import json
import os
import sys

import _cli
from lmscale_jax.similarity import bench as similarity_bench
from lmscale_jax.similarity import leakage as similarity_leakage
from lmscale_jax.store import dataset


def parser():
  p = _cli.Parser(description=__doc__.splitlines()[0])
  p.add_argument("--train", required=True, type=_cli.input_file, metavar="TRAIN",
                 help="the training pairs file")
  p.add_argument("--bench", required=True, type=_cli.input_file, metavar="BENCH",
                 help="the evaluation benchmark")
  p.add_argument("--json", type=_cli.output_file, default=None, metavar="OUT",
                 help="also write the report here")
  p.add_argument("--check", action="store_true", help="exit 2 if anything is shared")
  return p


def main(argv=None) -> int:
  a = parser().parse_args(argv)

  def go() -> int:
    train = load("--train", a.train)
    bench = load("--bench", a.bench)
    rep = {"train": a.train, "bench": a.bench, **similarity_leakage.report(train, bench)}
    line = similarity_leakage.summary_line(rep)
    if a.json:
      dataset.atomic_write_bytes(a.json, (json.dumps(rep, indent=2) + "\n").encode())
    if a.check and rep["shared_either"]:
      raise similarity_bench.BenchError(f"{a.train}: {line} (rebuild it with "
                                        f"tools/build_similarity_bench.py --disjoint-from "
                                        f"{a.bench})")
    print(line)
    print(json.dumps(rep, indent=2))
    return 0

  return _cli.guarded(go, "nothing was written")


def load(flag: str, path: str) -> list[dict]:
  if not os.path.isfile(path):
    raise similarity_bench.BenchError(f"{flag} {path}: no such file (build it with "
                                      "tools/build_similarity_bench.py)")
  return similarity_bench.load(path)[1]


if __name__ == "__main__":
  sys.exit(main())
