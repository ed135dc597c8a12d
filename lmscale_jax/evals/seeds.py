"""A claim over seeds: the rows of several runs of one method (each run an ``eval_similarity``
row, e.g. ``ft-pre-s0@600``, ``ft-pre-s1@600``, …) as one, mean and spread, and two methods
compared seed by seed.

A similarity claim ("pretraining adds R@1") is a difference between two methods that each
vary with their seed by about as much as the claimed margin (2026-12-02: ±0.006 on one set,
±0.012 on another): one seed's number says nothing. Here a method is a label and the glob
patterns that pick its runs out of the results; a comparison pairs its two methods' runs in
name order (seed 0 with seed 0), so the difference per seed is shown, not only the means, and
the claim is said to hold only where every seed's difference has the claimed sign.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json

import numpy as np

from lmscale_jax.errors import UserError


@dataclasses.dataclass
class Cell:
  """One method × pair × pool over its runs."""
  label: str
  pair: str
  pool: int
  runs: list[str]
  recall_at_1: list[float]
  mrr: list[float]
  queries: int

  def summary(self, key: str = "recall_at_1") -> dict:
    v = np.asarray(getattr(self, key))
    return {"mean": float(v.mean()), "min": float(v.min()), "max": float(v.max()),
            "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0, "n": int(len(v))}

  def row(self) -> dict:
    return {"label": self.label, "pair": self.pair, "pool": self.pool, "runs": self.runs,
            "queries": self.queries, "recall_at_1": self.recall_at_1, "mrr": self.mrr,
            "recall_at_1_summary": self.summary(), "mrr_summary": self.summary("mrr")}


def load(path: str) -> list[dict]:
  """The result rows of an ``eval_similarity.py --json`` file."""
  try:
    with open(path) as f:
      rows = json.load(f)["results"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise UserError(f"{path}: not an eval_similarity.py --json file ({e})") from None
  return rows


def parse_group(spec: str) -> tuple[str, list[str]]:
  """``LABEL=GLOB[,GLOB…]`` → the label and its patterns."""
  label, sep, globs = spec.partition("=")
  if not sep or not label.strip() or not globs.strip():
    raise UserError(f"--group {spec!r}: expected LABEL=GLOB[,GLOB…], e.g. "
                    "'pretrained + fine-tune=ft-pre-s*'")
  return label.strip(), [g.strip() for g in globs.split(",") if g.strip()]


def cells(rows: list[dict], label: str, globs: list[str]) -> list[Cell]:
  """The method's runs (rows whose method matches a pattern, in name order), per pair and
  pool; a pattern matching no run is an error naming the methods there are."""
  methods = sorted({r["method"] for r in rows
                    if any(fnmatch.fnmatchcase(r["method"], g) for g in globs)})
  if not methods:
    there = ", ".join(sorted({r["method"] for r in rows}))
    raise UserError(f"--group {label}: {', '.join(globs)} matches no method (there are: {there})")
  out = {}
  mine = [r for r in rows if r["method"] in methods and r["recall_at_1"] is not None]
  for r in sorted(mine, key=lambda r: methods.index(r["method"])):
    c = out.setdefault((r["pair"], r["pool"]),
                       Cell(label, r["pair"], r["pool"], [], [], [], r["queries"]))
    c.runs.append(r["method"])
    c.recall_at_1.append(r["recall_at_1"])
    c.mrr.append(r["mrr"])
  return list(out.values())


def compare(a: Cell, b: Cell) -> dict:
  """``a`` − ``b`` run by run (the i-th run of each: the same seed where both are named by
  it; a method of one run, e.g. TF-IDF, against each run of the other): the differences,
  their mean, and whether every one is above zero."""
  runs_a, runs_b, ra, rb = a.runs, b.runs, a.recall_at_1, b.recall_at_1
  if len(runs_b) == 1 and len(runs_a) > 1:
    runs_b, rb = runs_b * len(runs_a), rb * len(runs_a)
  if len(runs_a) == 1 and len(runs_b) > 1:
    runs_a, ra = runs_a * len(runs_b), ra * len(runs_b)
  if len(runs_a) != len(runs_b):
    raise UserError(f"{a.label} has {len(a.runs)} runs at {a.pair}, pool {a.pool}, and "
                    f"{b.label} {len(b.runs)}: a comparison pairs them seed by seed")
  d = [x - y for x, y in zip(ra, rb)]
  return {"a": a.label, "b": b.label, "pair": a.pair, "pool": a.pool,
          "pairs_of_runs": list(zip(runs_a, runs_b)), "recall_at_1_diff": d,
          "mean": float(np.mean(d)), "min": float(min(d)), "max": float(max(d)),
          "holds_every_run": bool(min(d) > 0)}


def show(c: Cell) -> str:
  """``mean ± half the range (n)`` of R@1, or the one value."""
  s = c.summary()
  if s["n"] == 1:
    return f"{s['mean']:.3f}"
  return f"{s['mean']:.3f} ± {(s['max'] - s['min']) / 2:.3f} ({s['n']})"
