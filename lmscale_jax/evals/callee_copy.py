"""Name sub-tokens copied from what a function calls: the naming task's strongest clue in a
stripped binary (docs/naming.md, "What a function calls").

A function that calls ``gzopen`` and ``inflateInit2_`` is likely named with ``gz``, ``open`` or
``inflate``; one that calls ``free`` rarely holds ``free``. So each sub-token of the called
names (normalised and split as names are: :mod:`lmscale_jax.similarity.symbol_names`) gets a
copy rate learnt on training functions: of those calling a name that holds the token, the share
whose own name holds it, smoothed by one function at the overall rate (a token never seen in
training, e.g. a new library's own prefix, gets the overall rate). The suggestions: the tokens
whose rate reaches a threshold, chosen on training data.
"""

from __future__ import annotations

import collections
import dataclasses

GRID = (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5)  # thresholds the training F1 chooses from


def called_tokens(calls: list[str]) -> set[str]:
  """The sub-tokens of the names a function calls, normalised as names are."""
  from lmscale_jax.similarity import symbol_names

  out: set[str] = set()
  for callee in calls:
    name, _ = symbol_names.normalise(callee)
    out.update(symbol_names.tokens(name) if name else ())
  return out


@dataclasses.dataclass
class CopyRates:
  """Per token: training functions whose called names hold it (``called``), and of those, whose
  own name holds it too (``held``)."""
  held: dict[str, int]
  called: dict[str, int]
  overall: float  # all held over all called: a token's rate before any evidence

  def rate(self, token: str) -> float:
    return (self.held.get(token, 0) + self.overall) / (self.called.get(token, 0) + 1)

  def scores(self, calls: list[str] | None) -> dict[str, float]:
    """Each sub-token of the called names → its copy rate (None: no calls known → {})."""
    return {t: self.rate(t) for t in called_tokens(calls or [])}


def fit(calls: list[list[str] | None], names: list[list[str]]) -> CopyRates:
  """The rates from training functions' called names and their own names' sub-tokens."""
  held, called = collections.Counter(), collections.Counter()
  for made, name in zip(calls, names):
    own = set(name)
    for t in called_tokens(made or []):
      called[t] += 1
      held[t] += t in own
  return CopyRates(dict(held), dict(called), sum(held.values()) / max(sum(called.values()), 1))


def suggested(rates: CopyRates, calls: list[list[str] | None], threshold: float) -> list[list[str]]:
  return [sorted(t for t, r in rates.scores(c).items() if r >= threshold) for c in calls]


def chosen_threshold(rates: CopyRates, calls: list, names: list[list[str]]) -> float:
  """The GRID threshold of the best micro F1 on (``calls``, ``names``)."""
  from lmscale_jax.evals import naming

  return max(GRID, key=lambda t: naming.score(suggested(rates, calls, t), names)["f1"])
