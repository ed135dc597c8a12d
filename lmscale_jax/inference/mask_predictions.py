"""The model's top-k guesses for each [MASK] of a text: what ``lmscale fill-mask`` prints and
``lmscale serve``'s /api/fill-mask answers (one implementation, so the two agree); and an ELF
function's mnemonics masked in turn (``lmscale fill-mask --elf``)."""

from __future__ import annotations

from typing import Iterator

import numpy as np

from lmscale_jax.errors import UserError
from lmscale_jax.inference import trained_model
from lmscale_jax.store.dataset import NEXT

BATCH = 32  # sequences per forward pass (fill-mask --elf: one per instruction)
COUNT_CHUNK = 4096  # instructions tokenized per call when counting a function's tokens


def mask_positions(model, ids: np.ndarray) -> np.ndarray:
  """Where the [MASK] tokens of encoded ``ids`` are ([CLS] is position 0)."""
  return np.flatnonzero(ids == model.special_ids["[MASK]"])


def predict(model, texts: list[str], top_k: int) -> list[list[list[dict]]]:
  """Per text, per [MASK] in order: the top-k ``{"id", "token", "probability"}``."""
  out = []
  for start in range(0, len(texts), BATCH):
    out += predict_rows(model, [trained_model.encode(model, t)[0]
                                for t in texts[start:start + BATCH]], top_k)
  return out


def predict_rows(model, rows: list[np.ndarray], top_k: int) -> list[list[list[dict]]]:
  """:func:`predict` of encoded rows (``trained_model.encode``'s ids), one forward pass."""
  where = [mask_positions(model, r) for r in rows]
  positions = np.zeros((len(rows), max(1, max(len(w) for w in where))), np.int32)
  for i, w in enumerate(where):
    positions[i, :len(w)] = w
  logits = trained_model.mlm_logits(
      model, trained_model.pad_batch(rows, model.cfg.seq_len, model.special_ids["[PAD]"]),
      positions)
  return [[top(model, logits[i, j], top_k) for j in range(len(w))] for i, w in enumerate(where)]


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


# --------------------------------------------------------------------------- a function's mnemonics
def fill_mnemonics(model, insns: list[str]) -> Iterator[tuple[list[int], list[list[dict]]]]:
  """Per instruction of a function, in order: its mnemonic's token ids and the model's top-1
  for each of their [MASK]s (fewer: an instruction longer than seq_len on its own). Each
  instruction is masked in :func:`window`'s stretch of the function around it, at most the
  model's seq_len tokens (it cannot see more); built a batch at a time, so memory does not grow
  with the function and time grows linearly (the whole function per instruction was quadratic:
  benchmarks/bench_fill_mask.py). A function that fits in seq_len is read whole, as before."""
  ends = token_ends(model, insns)
  for start in range(0, len(insns), BATCH):
    masked = [mask_mnemonic(model, insns[i]) for i in range(start, min(start + BATCH,
                                                                          len(insns)))]
    rows = [window_ids(model, insns, ends, start + j, text) for j, (text, _) in
            enumerate(masked)]
    yield from zip((pieces for _, pieces in masked), predict_rows(model, rows, 1))


def mask_mnemonic(model, insn: str) -> tuple[str, list[int]]:
  """``insn`` with its mnemonic masked (one [MASK] per token piece), and those pieces' ids."""
  mnemonic, _, rest = insn.partition(" ")
  pieces = model.tokenizer.encode(mnemonic, add_special_tokens=False).ids
  return " ".join(["[MASK]"] * len(pieces) + ([rest] if rest else [])), pieces


def token_ends(model, insns: list[str]) -> np.ndarray:
  """``ends[j]``: the tokens of instructions 0 .. j-1, each with the [NEXT] after it (so
  instructions a .. b-1 joined take ``ends[b] - ends[a] - 1``)."""
  counts = np.ones(len(insns) + 1, np.int64)  # + 1: each instruction's [NEXT]
  counts[0] = 0
  for s in range(0, len(insns), COUNT_CHUNK):
    done = model.tokenizer.encode_batch(insns[s:s + COUNT_CHUNK], add_special_tokens=False)
    counts[s + 1:s + 1 + len(done)] += [len(e.ids) for e in done]
  return np.cumsum(counts)


def window(ends: np.ndarray, i: int, room: int) -> tuple[int, int]:
  """The instructions [a, b) around ``i`` whose tokens fit in ``room``: as many on each side
  as fit (the widest centred stretch), then what room is left to the side that has more. The
  whole function where it fits."""
  n = len(ends) - 1

  def fits(h: int) -> bool:
    return ends[min(n, i + h + 1)] - ends[max(0, i - h)] - 1 <= room

  lo, hi = 0, n
  while lo < hi:  # the largest half-width that fits (fits is monotone in h)
    h = (lo + hi + 1) // 2
    lo, hi = (h, hi) if fits(h) else (lo, h - 1)
  a = max(0, i - lo)
  b = max(i + 1, min(n, int(np.searchsorted(ends, ends[a] + room + 1, "right")) - 1))
  a = min(i, int(np.searchsorted(ends, ends[b] - room - 1, "left")))
  return a, b


def window_ids(model, insns: list[str], ends: np.ndarray, i: int, masked: str) -> np.ndarray:
  """The ids of instruction ``i`` masked (``masked``) in its :func:`window`: the counts are
  per instruction; a tokenizer whose pieces depend on what precedes them (byte-level BPE) may
  need one fewer, so the window shrinks from its longer side until the text is not cut."""
  a, b = window(ends, i, model.cfg.seq_len - 2)  # [CLS] and [SEP]
  while True:
    ids, cut = trained_model.encode(model, f" {NEXT} ".join(insns[a:i] + [masked] +
                                                             insns[i + 1:b]))
    if not cut or b - a == 1:
      return ids
    a, b = (a + 1, b) if i - a > b - 1 - i else (a, b - 1)
