"""Suggested names for functions' texts, from a naming fine-tune (lmscale finetune --task name):
the one rule ``lmscale name`` and the server's ``/api/name`` share, so both give a function
the same suggestions.

A :class:`Namer` is the model and its prediction rule (a run's ``naming_eval.json``, an
export's config ``naming_rule``: model/name_head.py). Each text is encoded as training saw
functions (``[CLS] text [SEP]``, cut at seq_len, padded to it); batches of ``batch_size`` rows,
the last one's row count rounded up to a power of two (copies of its first row; dropped after):
a few compiled programs per model (:func:`warm` builds them) instead of one per number of
functions a request brings. Rows are independent, so a function's scores do not depend on the
others in its batch.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from lmscale_jax.errors import UserError
from lmscale_jax.inference import callee_copy, trained_model
from lmscale_jax.model import name_head

BATCH = 64  # functions per forward pass


@dataclasses.dataclass(frozen=True)
class Namer:
  model: trained_model.TrainedModel
  rule: dict     # which scored tokens make the name (name_head.RULES)
  given: str     # the model as the user gave it ("--workdir RUN"): its error lines name it
  # The called names' copy rates (inference/callee_copy), used where the rule says "calls" and
  # a function's calls are known (an ELF file's, not a pasted text's).
  copy: callee_copy.CopyRates | None = None
  gate: callee_copy.Gate | None = None  # how the rule joins the two (None: the larger score)


def load(workdir: str = "", hf: str = "", step: int | None = None,
         flags: tuple[str, str] = ("--workdir", "--hf")) -> Namer:
  """The naming fine-tune in ``workdir`` (its checkpoint ``step``, default the latest) or its
  export ``hf``; ``flags``: the options that gave them, for the one-line refusals."""
  model = (trained_model.from_hf(hf, naming=True) if hf else
           trained_model.from_workdir(workdir, step))
  given = f"{flags[0]} {workdir}" if workdir else f"{flags[1]} {hf}"
  if model.namer is None:
    raise UserError(f"{given} is not a naming fine-tune (lmscale finetune --task name "
                    "makes one; lmscale export-hf exports it)")
  name_head.check_fits(model.namer["tokens"], model.namer["bias"].shape[0], given)
  rule = model.namer["rule"] if hf else name_head.saved_rule(
      os.path.join(workdir, name_head.EVAL_REPORT))
  copy = callee_copy.load(hf or workdir)
  if rule.get("calls") and copy is None:
    raise UserError(f"{given}: its prediction rule reads the names functions call, but its "
                    f"{callee_copy.FILE} is missing (restore the run's own file)")
  return Namer(model, rule, given, copy, rule_gate(rule, given))


def rule_gate(rule: dict, given: str) -> callee_copy.Gate | None:
  """The gate a rule carries (None where it has none: a run saved before gates)."""
  if "gate" not in rule:
    return None
  try:
    return callee_copy.gate_from_json(rule["gate"])
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise UserError(f"{given}: its prediction rule's gate is unreadable ({e}); restore the "
                    "run's own naming_eval.json (or export it again)") from None


def padded_rows(n: int, batch_size: int) -> int:
  """The rows a batch of ``n`` functions runs as: the next power of two, at most batch_size."""
  return min(batch_size, 1 << max(n - 1, 0).bit_length())


def probabilities(model: trained_model.TrainedModel, texts: list[str],
                  batch_size: int = BATCH) -> np.ndarray:
  """Each text's probability of every name sub-token, float [N, V]."""
  ids = trained_model.pad_batch([trained_model.encode(model, t)[0] for t in texts],
                                model.cfg.seq_len, model.special_ids["[PAD]"])
  out = [np.zeros((0, len(model.namer["tokens"])))]
  for i in range(0, len(ids), batch_size):
    rows = ids[i:i + batch_size]
    extra = padded_rows(len(rows), batch_size) - len(rows)
    full = np.concatenate([rows, np.repeat(rows[:1], extra, axis=0)])
    out.append(trained_model.name_probs(model, full)[:len(rows)])
  return np.concatenate(out)


def ranked(model: trained_model.TrainedModel, texts: list[str], top: int,
           batch_size: int = BATCH) -> tuple[list[list[str]], np.ndarray]:
  """Each text's ``top`` best sub-tokens, best first, and their probabilities [N, top]."""
  probs = probabilities(model, texts, batch_size)
  order = np.argsort(-probs, axis=1, kind="stable")[:, :top]
  vocab = model.namer["tokens"]
  return [[vocab[j] for j in row] for row in order.tolist()], np.take_along_axis(probs, order, 1)


def joined(namer: Namer, best, best_p, calls: list | None, top: int, shares=None):
  """The model's best tokens joined with the called names' as the rule says: scored by its
  gate, always (its threshold is on the gate's scale; no calls known reads as none; ``shares``:
  their file's :func:`callee_copy.file_shares`, one for all), or, for a run saved before gates,
  by the larger of probability and copy rate where calls are known."""
  if namer.gate is not None:
    calls = calls if calls is not None else [None] * len(best)
    return callee_copy.gated(best, best_p, namer.copy, calls, namer.gate, top,
                             [shares] * len(best))
  if calls is None:
    return best, best_p
  return callee_copy.merged(best, best_p, namer.copy, calls, top)


def suggest(namer: Namer, texts: list[str], top: int, batch_size: int = BATCH,
            calls: list | None = None, shares: dict | None = None) -> list[dict]:
  """Per text: ``suggested`` (the rule's sub-tokens joined by "_", "" where it keeps none) and
  ``tokens``, the ``top`` best sub-tokens as [token, score rounded to 4 places]; ``calls``
  (each text's called names, or None per text or for all): where the rule reads them, the
  model's tokens and the called names' are scored together (:func:`joined`), with the
  namespace of their file (``shares``: :func:`callee_copy.file_shares` of the whole file's
  functions; by default the texts given are taken as the file)."""
  best, best_p = ranked(namer.model, texts, max(top, name_head.TOP), batch_size)
  if namer.rule.get("calls"):
    if shares is None and calls is not None:
      shares = callee_copy.file_shares(calls)
    best, best_p = joined(namer, best, best_p, calls, max(top, name_head.TOP), shares)
  named = name_head.apply_rule(namer.rule, best, best_p)
  return [{"suggested": "_".join(n),
           "tokens": [[t, round(float(p), 4)] for t, p in zip(b[:top], ps[:top])]}
          for n, b, ps in zip(named, best, best_p)]


def warm(namer: Namer, batch_size: int = BATCH) -> int:
  """Compiles the program of every padded row count (a server's, before it listens) → how
  many."""
  counts = sorted({padded_rows(n, batch_size) for n in range(1, batch_size + 1)})
  for n in counts:
    probabilities(namer.model, ["ret"] * n, batch_size)
  return len(counts)
