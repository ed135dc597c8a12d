"""The model's top-k guesses for each [MASK] of a text: what ``lmscale fill-mask`` prints and
``lmscale serve``'s /api/fill-mask answers (one implementation, so the two agree)."""

from __future__ import annotations

import numpy as np

from lmscale_jax.errors import UserError
from lmscale_jax.inference import trained_model

BATCH = 32  # sequences per forward pass (fill-mask --elf: one per instruction)


def mask_positions(model, ids: np.ndarray) -> np.ndarray:
  """Where the [MASK] tokens of encoded ``ids`` are ([CLS] is position 0)."""
  return np.flatnonzero(ids == model.special_ids["[MASK]"])


def predict(model, texts: list[str], top_k: int) -> list[list[list[dict]]]:
  """Per text, per [MASK] in order: the top-k ``{"id", "token", "probability"}``."""
  out = []
  for start in range(0, len(texts), BATCH):
    rows = [trained_model.encode(model, t)[0] for t in texts[start:start + BATCH]]
    where = [mask_positions(model, r) for r in rows]
    p = max(1, max(len(w) for w in where))
    positions = np.zeros((len(rows), p), np.int32)
    for i, w in enumerate(where):
      positions[i, :len(w)] = w
    logits = trained_model.mlm_logits(
        model, trained_model.pad_batch(rows, model.cfg.seq_len, model.special_ids["[PAD]"]),
        positions)
    out += [[top(model, logits[i, j], top_k) for j in range(len(w))] for i, w in enumerate(where)]
  return out


def top(model, logits: np.ndarray, top_k: int) -> list[dict]:
  """The ``top_k`` most probable tokens of one position's logits (softmax in float64)."""
  z = logits.astype(np.float64)
  prob = np.exp(z - z.max())
  prob /= prob.sum()
  best = np.argsort(-prob, kind="stable")[:top_k]
  return [{"id": int(t), "token": model.tokenizer.id_to_token(int(t)),
           "probability": float(prob[t])} for t in best]


def fill_text(model, text: str, top_k: int, what: str = "--text") -> list[list[dict]]:
  """The predictions for each [MASK] of ``text`` the model reads (``what`` names the text in
  the one-line errors: no [MASK], or every [MASK] past the sequence length)."""
  if "[MASK]" not in text:
    raise UserError(f"{what} has no [MASK]: put [MASK] where a token should be predicted, "
                    "e.g. 'push rbp [NEXT] [MASK] rbp rsp'")
  ids, cut = trained_model.encode(model, text)
  if cut and not len(mask_positions(model, ids)):
    raise UserError(f"{what}: every [MASK] lies past the model's {model.cfg.seq_len} tokens")
  return predict(model, [text], top_k)[0]
