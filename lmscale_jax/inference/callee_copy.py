"""Name sub-tokens copied from what a function calls: the naming task's strongest clue in a
stripped binary (docs/naming.md, "What a function calls").

A function that calls ``gzopen`` and ``inflateInit2_`` is likely named with ``gz``, ``open`` or
``inflate``; one that calls ``free`` rarely holds ``free``. So each sub-token of the called
names (normalised and split as names are: :mod:`lmscale_jax.similarity.symbol_names`) gets a
copy rate learnt on training functions: of those calling a name that holds the token, the share
whose own name holds it, smoothed by one function at the overall rate (a token never seen in
training, e.g. a new library's own prefix, gets the overall rate). The suggestions: the tokens
whose rate reaches a threshold: the baseline's chosen on training F1
(benchmarks/naming_baselines.py).

A naming run joins them to its model's tokens with a :class:`Gate` (finetune/name_run.with_calls):
a logistic regression over each candidate token's model probability, copy rate, evidence and
its file's namespace (:data:`FEATURES`, :func:`file_shares`), fitted on the run's calibration
slice. On the four 2,000-step runs of docs/naming.md the larger of probability and copy rate
(:func:`merged`, still read for runs saved with it) scored held-out F1 0.267-0.277, the gate
over the calls 0.291-0.298, and with the file's namespace 0.305-0.333.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os

import numpy as np

from lmscale_jax.errors import UserError



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


def merged(names: list[list[str]], probs, rates: CopyRates, calls: list, top: int):
  """A naming model's best tokens (best first) and their probabilities, with each called
  name's sub-token scored by the larger of the model's probability and its copy rate → the
  ``top`` best of each function again (tokens, scores), best first (ties: the token)."""
  out_names, out_scores = [], []
  for ns, ps, made in zip(names, probs, calls):
    scored = dict(zip(ns, map(float, ps)))
    for t, r in rates.scores(made).items():
      scored[t] = max(scored.get(t, 0.0), r)
    best = sorted(scored.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    out_names.append([t for t, _ in best])
    out_scores.append([p for _, p in best])
  return out_names, out_scores


# A file's namespace shows in its functions' calls: a sub-token that the called names of many
# of its functions hold (xml in libxml2, gz in zlib) is a candidate for every function of the
# file, since the test names keep it. Measured on the four 2,000-step runs' saved predictions
# (scratch, session 32): held-out F1 0.294 → 0.335 (seed 0), 0.298 → 0.316 (seed 1).
NAMESPACE_SHARE = 0.1   # the share of a file's functions calling a token that makes it one
MIN_FILE_FUNCTIONS = 10  # fewer functions known (one pasted, a few sent): no file shares

FEATURES = ("probability", "log-odds", "copy rate", "called", "log(1 + training callers)",
            "log(1 + called tokens of the function)", "among the model's best",
            "file share", "log file share", "file namespace", "copy rate, not called",
            "log(1 + training callers), any")
# The gates fitted before file shares (their JSON lists only these) are still read.
CALLS_ONLY = FEATURES[:7]


def file_shares(calls: list[list[str] | None]) -> dict[str, float] | None:
  """Per sub-token, the share of a file's functions (``calls``: each one's called names) whose
  called names hold it; None for fewer than :data:`MIN_FILE_FUNCTIONS` functions."""
  if len(calls) < MIN_FILE_FUNCTIONS:
    return None
  counts = collections.Counter(t for made in calls for t in called_tokens(made or []))
  return {t: n / len(calls) for t, n in counts.items()}


def shares_by_file(calls: list, files: list[str]) -> list[dict[str, float] | None]:
  """Each function's :func:`file_shares`, over the functions of its file (``files``: each
  function's file)."""
  members = collections.defaultdict(list)
  for i, f in enumerate(files):
    members[f].append(i)
  shares = {f: file_shares([calls[i] for i in idx]) for f, idx in members.items()}
  return [shares[f] for f in files]


def candidates(names: list[str], probs, rates: CopyRates, calls: list[str] | None,
               shares: dict[str, float] | None = None):
  """One function's candidate tokens (the model's best, the called names', its file's
  namespace) → (tokens, features [n, len(FEATURES)])."""
  model = dict(zip(names, map(float, probs)))
  copy = rates.scores(calls)
  shares = shares or {}
  space = {t for t, v in shares.items() if v >= NAMESPACE_SHARE}
  tokens = list(model) + sorted((set(copy) | space) - set(model))
  rows = []
  for t in tokens:
    p, called, share = model.get(t, 0.0), t in copy, shares.get(t, 0.0)
    q = min(max(p, 1e-6), 1 - 1e-6)  # finite log-odds for a token the model gives 0 or 1
    callers = math.log1p(rates.called.get(t, 0))
    rows.append([p, math.log(q / (1 - q)), copy.get(t, 0.0), float(called), callers * called,
                 math.log1p(len(copy)), float(t in model), share, math.log(share + 1e-3),
                 float(t in space), 0.0 if called else rates.rate(t), callers])
  return tokens, np.asarray(rows, np.float64).reshape(-1, len(FEATURES))


@dataclasses.dataclass
class Gate:
  """A candidate token's probability of being in the name: sigmoid(features · weights + bias),
  over the named ``features`` (of :data:`FEATURES`)."""
  weights: list[float]
  bias: float
  features: tuple[str, ...] = FEATURES

  @property
  def reads_files(self) -> bool:
    return "file share" in self.features

  def scores(self, features: np.ndarray) -> np.ndarray:
    x = features[:, [FEATURES.index(f) for f in self.features]]
    return 1.0 / (1.0 + np.exp(-(x @ np.asarray(self.weights) + self.bias)))

  def as_json(self) -> dict:
    return {"features": list(self.features), "weights": self.weights, "bias": self.bias}


def gate_from_json(doc: dict) -> Gate:
  features = tuple(doc.get("features", ()))
  if features not in (FEATURES, CALLS_ONLY) or len(doc["weights"]) != len(features):
    raise ValueError(f"gate features {doc.get('features')!r} with {len(doc['weights'])} "
                     f"weights, expected {list(FEATURES)!r}")
  return Gate([float(w) for w in doc["weights"]], float(doc["bias"]), features)


def fit_gate(names, probs, rates: CopyRates, calls: list, truth: list[list[str]],
             weights, shares: list | None = None) -> Gate:
  """The gate fitted on functions whose real names are known (a run's calibration slice):
  each candidate token a row, weighted as its function (``naming.library_weights``);
  ``shares``: each function's :func:`file_shares` (None: no file known)."""
  from sklearn.linear_model import LogisticRegression

  xs, ys, ws = [], [], []
  for ns, ps, made, real, w, sh in zip(names, probs, calls, truth, weights,
                                       shares or [None] * len(names)):
    tokens, x = candidates(ns, ps, rates, made, sh)
    xs.append(x)
    ys.extend(t in set(real) for t in tokens)
    ws.extend([w] * len(tokens))
  model = LogisticRegression(C=1.0, max_iter=3000).fit(np.concatenate(xs), ys, sample_weight=ws)
  return Gate([float(v) for v in model.coef_[0]], float(model.intercept_[0]))


def gated(names, probs, rates: CopyRates, calls: list, gate: Gate, top: int,
          shares: list | None = None):
  """Each function's candidate tokens scored by ``gate`` → the ``top`` best again (tokens,
  scores), best first (ties: the token), as :func:`merged` returns them. ``shares``: each
  function's file shares (a gate fitted before them reads none)."""
  shares = shares if shares is not None and gate.reads_files else [None] * len(names)
  out_names, out_scores = [], []
  for ns, ps, made, sh in zip(names, probs, calls, shares):
    tokens, x = candidates(ns, ps, rates, made, sh)
    best = sorted(zip(tokens, gate.scores(x).tolist()), key=lambda kv: (-kv[1], kv[0]))[:top]
    out_names.append([t for t, _ in best])
    out_scores.append([p for _, p in best])
  return out_names, out_scores


FILE = "callee_copy.json"  # a naming run's (and its export's) rates
FORMAT = "lmscale_jax.callee_copy/1"


def save(directory: str, rates: CopyRates) -> None:
  from lmscale_jax.store import file_io

  file_io.atomic_write_json(os.path.join(directory, FILE), {
      "format": FORMAT, "overall": rates.overall, "held": rates.held, "called": rates.called})


def load(directory: str) -> CopyRates | None:
  """A run's or an export's rates; None where it has none (trained on names without calls)."""
  path = os.path.join(directory, FILE)
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      doc = json.load(f)
    if doc.get("format") != FORMAT:
      raise ValueError(f"format {doc.get('format')!r}")
    return CopyRates(dict(doc["held"]), dict(doc["called"]), float(doc["overall"]))
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    raise UserError(f"{path}: unreadable ({e}); expected {FORMAT} as lmscale finetune --task "
                    "name writes it (restore the run's own file)") from None
