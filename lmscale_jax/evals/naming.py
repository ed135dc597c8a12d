"""Function naming's scores: how well suggested name sub-tokens match a function's real name.

The protocol of SymLM and XFL (and BLens's token F1): each name is a set of sub-tokens
(``inflate_fast`` → {inflate, fast}); per function, true positives are the suggested tokens in
the real name's set; precision, recall and F1 are micro-averaged over every function (summed
counts, then the ratios), so a function with a long name weighs more than one with a short one.
Exact-name accuracy: the share of functions whose suggested set equals the real one. Every
method (the fine-tuned head, the baselines of ``benchmarks/``) is scored by :func:`score`, so
their numbers compare.
"""

from __future__ import annotations

from typing import Sequence


def counts(predicted: Sequence[str], truth: Sequence[str]) -> tuple[int, int, int]:
  """(true positives, predicted, true) of one function: its sub-token sets compared."""
  p, t = set(predicted), set(truth)
  return len(p & t), len(p), len(t)


def _ratio(a: int, b: int) -> float:
  return a / b if b else 0.0


def score(predicted: Sequence[Sequence[str]], truth: Sequence[Sequence[str]]) -> dict:
  """Micro precision, recall, F1 and exact-name accuracy of ``predicted`` against ``truth``
  (one sub-token sequence per function, in the same order)."""
  if len(predicted) != len(truth):
    raise ValueError(f"{len(predicted)} predictions for {len(truth)} functions")
  hit = said = real = exact = 0
  for p, t in zip(predicted, truth):
    h, s, r = counts(p, t)
    hit, said, real = hit + h, said + s, real + r
    exact += set(p) == set(t)
  precision, recall = _ratio(hit, said), _ratio(hit, real)
  return {"functions": len(truth), "precision": precision, "recall": recall,
          "f1": _ratio(2 * precision * recall, precision + recall),
          "exact": _ratio(exact, len(truth))}
