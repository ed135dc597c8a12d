"""Function naming's scores: how well suggested name sub-tokens match a function's real name.

The protocol of SymLM and XFL (and BLens's token F1): each name is a set of sub-tokens
(``inflate_fast`` → {inflate, fast}); per function, true positives are the suggested tokens in
the real name's set; precision, recall and F1 are micro-averaged over every function (summed
counts, then the ratios), so a function with a long name weighs more than one with a short one.
Exact-name accuracy: the share of functions whose suggested set equals the real one. Every
method (the fine-tuned head, the baselines of ``benchmarks/``) is scored by :func:`score`, so
their numbers compare.

A prediction rule (a threshold, top-k) is chosen on held-out *training* libraries, and a few
large ones can own such a slice (two of 28 held 68% of one seed's, and chose a threshold that
scored 0.187 on the test libraries where the one the others chose scored 0.277): so a rule is
chosen on F1 with each library weighed at most as much as the slice's median library
(:func:`library_weights`); held-out scores stay unweighted.
"""

from __future__ import annotations

import collections
import statistics
from typing import Sequence


def counts(predicted: Sequence[str], truth: Sequence[str]) -> tuple[int, int, int]:
  """(true positives, predicted, true) of one function: its sub-token sets compared."""
  p, t = set(predicted), set(truth)
  return len(p & t), len(p), len(t)


def _ratio(a: int, b: int) -> float:
  return a / b if b else 0.0


def score(predicted: Sequence[Sequence[str]], truth: Sequence[Sequence[str]],
          weights: Sequence[float] | None = None) -> dict:
  """Micro precision, recall, F1 and exact-name accuracy of ``predicted`` against ``truth``
  (one sub-token sequence per function, in the same order); ``weights``: each function's
  counts scaled (:func:`library_weights`, for choosing a rule), else each counts once."""
  if len(predicted) != len(truth):
    raise ValueError(f"{len(predicted)} predictions for {len(truth)} functions")
  if weights is not None and len(weights) != len(truth):
    raise ValueError(f"{len(weights)} weights for {len(truth)} functions")
  hit = said = real = exact = 0
  for p, t, w in zip(predicted, truth, weights if weights is not None else [1] * len(truth)):
    h, s, r = counts(p, t)
    hit, said, real = hit + w * h, said + w * s, real + w * r
    exact += w * (set(p) == set(t))
  precision, recall = _ratio(hit, said), _ratio(hit, real)
  return {"functions": len(truth), "precision": precision, "recall": recall,
          "f1": _ratio(2 * precision * recall, precision + recall),
          "exact": _ratio(exact, sum(weights) if weights is not None else len(truth))}


def library_weights(libraries: Sequence[str]) -> list[float]:
  """Each function's weight for choosing a rule: 1, or for a library larger than the median
  library here, the median over its size (so it weighs as much as the median library)."""
  sizes = collections.Counter(libraries)
  cap = statistics.median(sizes.values()) if sizes else 0
  return [min(1.0, cap / sizes[lib]) for lib in libraries]
