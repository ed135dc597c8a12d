"""Similarity claims over seeds and benchmark sets: eval_similarity.py --json files in, one table.

  python benchmarks/similarity_seeds.py \
      --set eval=EVAL.json --set eval2=EVAL2.json \
      --group 'pretrained + fine-tune=ft-pre-s*' --group 'random init + fine-tune=ft-rand-s*' \
      --group TF-IDF=tfidf --compare 'pretrained + fine-tune>random init + fine-tune' \
      [--cells gcc-O0↔gcc-O3@100,all@100,gcc-O0↔gcc-O3@1000,all@1000] [--json OUT.json]

Each --set names one benchmark and the eval JSON(s) measured on it (NAME=A.json[,B.json]);
the methods of the k-th file after the first are named METHOD/k (e.g. one more draw of the
pools, eval_similarity.py --seed: tfidf/1, run@3000/1), so runs pair up file by file.
Each --group is one method: a label and the glob patterns picking its runs (one per seed) out
of the rows. A cell is R@1 as mean ± half the range over the runs (the number of runs in
brackets). Each --compare 'A>B' pairs A's and B's runs seed by seed (in name order) and says,
per set and cell, the mean difference, its range, and whether it is above zero at every seed:
a claim is made where it is, on every set (lmscale_jax/evals/seeds.py).
"""

from __future__ import annotations

import argparse
import sys

from lmscale_jax import exits
from lmscale_jax.errors import UserError
from lmscale_jax.evals import seeds
from lmscale_jax.store import output_marks
from lmscale_jax.cli import args as cli_args  # one line and exit 1 for a bad argument

TOOL = "benchmarks/similarity_seeds.py"  # the parser's prog, and the mark its --json carries
CELLS = "gcc-O0↔gcc-O3@100,all@100,gcc-O0↔gcc-O3@1000,all@1000"


def parser() -> argparse.ArgumentParser:
  p = cli_args.Parser(prog=TOOL, description=__doc__.split("\n")[0])
  p.add_argument("--set", action="append", required=True, metavar="NAME=A.json[,B.json]")
  p.add_argument("--group", action="append", required=True, metavar="LABEL=GLOB[,GLOB]")
  p.add_argument("--compare", action="append", default=[], metavar="A>B")
  p.add_argument("--cells", default=CELLS, help=f"PAIR@POOL, comma-separated ({CELLS})")
  p.add_argument("--json", default=None, type=cli_args.output_file, metavar="OUT.json")
  return p


def read_sets(specs: list[str]) -> dict[str, list[dict]]:
  out = {}
  for spec in specs:
    name, sep, paths = spec.partition("=")
    if not sep or not paths:
      raise UserError(f"--set {spec!r}: expected NAME=A.json[,B.json]")
    out[name] = [{**row, "method": row["method"] + (f"/{k}" if k else "")}
                 for k, path in enumerate(paths.split(",")) for row in seeds.load(path)]
  return out


def wanted(cells_arg: str) -> list[tuple[str, int]]:
  out = []
  for c in cells_arg.split(","):
    pair, sep, pool = c.rpartition("@")
    if not sep or not pool.isdigit():
      raise UserError(f"--cells {c!r}: expected PAIR@POOL, e.g. all@100")
    out.append((pair, int(pool)))
  return out


def measure(sets: dict, groups: list[tuple[str, list[str]]]) -> dict:
  """(set, label) → {(pair, pool): Cell}."""
  return {(s, label): {(c.pair, c.pool): c for c in seeds.cells(rows, label, globs)}
          for s, rows in sets.items() for label, globs in groups}


def table(found: dict, sets: list[str], labels: list[str], cells: list[tuple[str, int]]) -> str:
  head = [f"{s}: {pair}, pool {pool}" for s in sets for pair, pool in cells]
  lines = ["| method | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
  for label in labels:
    row = [seeds.show(found[s, label][c]) if c in found[s, label] else "n/a"
           for s in sets for c in cells]
    lines.append(f"| {label} | " + " | ".join(row) + " |")
  return "\n".join(lines)


def parse_compare(spec: str, labels: list[str]) -> tuple[str, str]:
  """``A>B`` → the two --group labels."""
  a, sep, b = (x.strip() for x in spec.partition(">"))
  if not sep:
    raise UserError(f"--compare {spec!r}: expected 'A>B' (two --group labels)")
  for x in (a, b):
    if x not in labels:
      raise UserError(f"--compare: {x!r} is no --group label ({labels})")
  return a, b


def comparisons(found: dict, sets: list[str], pairs: list[tuple[str, str]],
                cells: list[tuple[str, int]]) -> list[dict]:
  out = []
  for a, b in pairs:
    for s in sets:
      for c in cells:
        ca, cb = found[s, a].get(c), found[s, b].get(c)
        if ca and cb:
          out.append({"set": s, **seeds.compare(ca, cb)})
  return out


def show_comparison(r: dict) -> str:
  diffs = ", ".join(f"{d:+.3f}" for d in r["recall_at_1_diff"])
  verdict = "holds at every seed" if r["holds_every_run"] else "does not hold at every seed"
  return (f"{r['set']}: {r['pair']}, pool {r['pool']}: {r['a']} − {r['b']} = "
          f"{r['mean']:+.3f} (per seed {diffs}): {verdict}")


def main(argv=None) -> int:
  a = parser().parse_args(argv)
  try:
    sets = read_sets(a.set)
    groups = [seeds.parse_group(g) for g in a.group]
    labels = [label for label, _ in groups]
    pairs = [parse_compare(spec, labels) for spec in a.compare]
    found, cells = measure(sets, groups), wanted(a.cells)
    compared = comparisons(found, list(sets), pairs, cells)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return exits.EXIT_USAGE
  print(table(found, list(sets), labels, cells))
  print("\n".join(["", *map(show_comparison, compared)]) if compared else "")
  if a.json:
    output_marks.write_json(a.json, TOOL, {
        "cells": [c.row() | {"set": s} for (s, _), cs in found.items() for c in cs.values()],
        "comparisons": compared})
  return 0


if __name__ == "__main__":
  sys.exit(main())
