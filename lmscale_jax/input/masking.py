"""BERT MLM masking: which tokens a batch predicts, and what it replaces them with.

Owns the number of predictions per sequence (:func:`num_predictions`: the loader's batches and
the model's abstract batch agree because both ask it) and the masking rule: of a sequence's
``m`` maskable (non-special) tokens, ``round(mask_prob * m)`` (at least 1 if ``m > 0``, at
most P) are chosen; 80% become [MASK], 10% a uniformly random non-special id, 10% stay.
Specials are never chosen and never drawn as replacements, so a masked row keeps its
records' [CLS]/[SEP]/[PAD] where they were: the model derives packed functions' segments from
the masked ids (``model.segment_ids``) and the batches need no segment key.

The loader masks with :meth:`Masker.keyed`: a counter-based hash (:mod:`lmscale_jax.input.hashing`)
of ``(seed, global stream position, token position)``, so a row's mask depends neither on how
many batches were drawn nor on the batch size or worker count, and a restored iterator
reproduces the same batches bit for bit. :func:`mask_tokens` is the same algorithm for one
sequence driven by a ``numpy.random.Generator``.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from lmscale_jax.errors import ConfigError
from lmscale_jax.input import hashing
from lmscale_jax.input.hashing import U64


def num_predictions(mask_prob: float, max_predictions: int, seq_len: int) -> int:
  """P, the prediction slots per sequence: ``data.max_predictions``, or when that is 0
  ``ceil(data.mask_prob * seq_len)``. The one owner of that number."""
  if not 0.0 < float(mask_prob) < 1.0:
    raise ConfigError(f"data.mask_prob={mask_prob}: expected a value in (0, 1)")
  predictions = int(max_predictions or 0) or math.ceil(float(mask_prob) * int(seq_len))
  if predictions <= 0:
    raise ConfigError(f"data.max_predictions={max_predictions}: expected a positive count, "
                      "or 0 for ceil(data.mask_prob * seq_len)")
  return predictions


class Masker:
  """BERT MLM masking for a batch ``[B, S]``; holds the lookup tables built from metadata."""

  def __init__(self, special_ids: Mapping[str, int], vocab_size: int, mask_prob: float,
               max_predictions: int | None, seq_len: int):
    if "[MASK]" not in special_ids:
      raise ValueError(f"special_ids has no '[MASK]' entry: {dict(special_ids)}")
    self.mask_id = int(special_ids["[MASK]"])
    self.mask_prob = float(mask_prob)
    self.num_predictions = num_predictions(mask_prob, max_predictions, seq_len)
    # Lookup over the whole uint16 range, so out-of-vocab ids (checked elsewhere) index safely.
    self.special = np.zeros(1 << 16, bool)
    self.special[[int(i) for i in special_ids.values()]] = True
    specials = sorted({int(i) for i in special_ids.values()})
    self._special_range = ((specials[0], specials[-1])
                           if specials[-1] - specials[0] + 1 == len(specials) else None)
    self.replacements = np.nonzero(~self.special[:vocab_size])[0].astype(np.int32)
    if self.replacements.size == 0:
      raise ValueError(f"vocab_size {vocab_size} leaves no non-special token to sample")
    # Per-token-position hash keys, XORed with a row key: one hash per (row, position).
    self._pos_keys = hashing.mix64(np.arange(seq_len, dtype=np.uint64) + U64(hashing.GOLDEN))
    self._pos_keys32 = hashing.fmix32(
        np.arange(seq_len, dtype=np.uint32) * np.uint32(0x9E3779B9))

  def is_special(self, ids: np.ndarray) -> np.ndarray:
    if self._special_range is not None:  # prepared datasets: [PAD].. [NEXT] = 0..5
      lo, hi = self._special_range
      return ids <= hi if lo == 0 else (ids >= lo) & (ids <= hi)
    return np.take(self.special, ids)

  def _select(self, maskable: np.ndarray, priority: np.ndarray):
    """The ``k`` maskable positions of lowest priority per row -> (positions, valid) [B, P].

    ``k = clip(round(mask_prob * n), 1, P)`` for a row of ``n > 0`` maskable tokens. Finds the
    k-th smallest priority per row with one full row sort (SIMD ``np.sort`` on 32-bit keys is
    ~4x cheaper than ``argpartition``), then takes the positions at or below it.
    """
    rows, seq = maskable.shape
    slots = self.num_predictions
    n_maskable = maskable.sum(axis=1)
    k = np.where(n_maskable > 0,
                 np.clip(np.floor(self.mask_prob * n_maskable + 0.5), 1, slots),
                 0).astype(np.int64)
    threshold = np.sort(priority, axis=1)[np.arange(rows), np.maximum(k - 1, 0)]
    chosen = (priority <= threshold[:, None]) & maskable
    chosen[k == 0] = False
    # A priority tie at the threshold (~never: needs equal 32-bit hashes) would choose more
    # than k; redo such rows exactly.
    for row in np.nonzero(chosen.sum(axis=1) != k)[0].tolist():
      candidates = np.nonzero(maskable[row])[0]
      chosen[row] = False
      order = np.argsort(priority[row, candidates], kind="stable")
      chosen[row, candidates[order[:k[row]]]] = True
    # Row-major flat indices: each row's k positions, ascending, fill its first k slots.
    flat = np.flatnonzero(chosen)
    valid = np.arange(slots)[None, :] < k[:, None]
    positions = np.zeros((rows, slots), np.int32)
    positions[valid] = flat - np.repeat(np.arange(rows) * seq, k)
    return positions, valid

  def _apply(self, ids, positions, valid, action, token_index) -> dict[str, np.ndarray]:
    """80% [MASK], 10% random non-special token, 10% unchanged (``action`` uniform [0,1))."""
    rows, seq = ids.shape
    flat = positions + (np.arange(rows, dtype=np.int64) * seq)[:, None]
    out = np.array(ids, np.int32, order="C")  # a copy: the caller's ids stay unmasked
    labels = np.where(valid, out.reshape(-1)[flat], 0).astype(np.int32)
    new = np.where(action < 0.8, self.mask_id,
                   np.where(action < 0.9, self.replacements[token_index], labels))
    out.reshape(-1)[flat[valid]] = new[valid]
    return {"input_ids": out, "mlm_positions": positions, "mlm_labels": labels,
            "mlm_weights": valid.astype(np.float32)}

  def with_generator(self, ids: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
    special = self.is_special(ids)
    positions, valid = self._select(~special, np.where(special, 2.0, rng.random(ids.shape)))
    action = rng.random(positions.shape)
    token_index = rng.integers(0, self.replacements.size, positions.shape)
    return self._apply(ids, positions, valid, action, token_index)

  def keyed(self, ids: np.ndarray, positions: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    """Masks row ``i`` with randomness keyed by ``(seed, positions[i])`` only."""
    special = self.is_special(ids)
    # 32-bit priorities (sorting/hashing 4x cheaper than 64-bit on [B, S]); fmix32 is a
    # bijection and the per-position keys are distinct, so a row's priorities are distinct.
    select_keys = hashing.row_keys(hashing.stream_key(seed, hashing.STREAM_SELECT), positions)
    priority = hashing.fmix32(select_keys.astype(np.uint32)[:, None] ^ self._pos_keys32[None, :])
    np.putmask(priority, special, np.uint32(0xFFFFFFFF))  # specials rank last
    slots, valid = self._select(~special, priority)
    action_keys = hashing.row_keys(hashing.stream_key(seed, hashing.STREAM_ACTION), positions)
    draws = hashing.mix64(action_keys[:, None] ^ self._pos_keys[slots])
    action = (draws >> U64(40)).astype(np.float64) * (1.0 / (1 << 24))
    token_index = ((draws & U64(0xFFFFFFFF)) * U64(self.replacements.size)) >> U64(32)
    return self._apply(ids, slots, valid, action, token_index.astype(np.int64))


def mask_tokens(ids: np.ndarray, rng: np.random.Generator, *, special_ids: Mapping[str, int],
                vocab_size: int, mask_prob: float = 0.15,
                max_predictions: int | None = None) -> dict[str, np.ndarray]:
  """BERT MLM masking of one sequence ``ids`` [S] (pure numpy, vectorised).

  Chooses ``round(mask_prob * m)`` of the ``m`` maskable tokens (at least 1 if ``m > 0``, at
  most ``max_predictions`` = P, default ``ceil(mask_prob * S)``); a token is maskable unless
  its id is one of ``special_ids`` (which include [PAD]). Of the chosen: 80% -> [MASK], 10% ->
  a uniformly random non-special id < ``vocab_size``, 10% unchanged.

  Returns ``input_ids`` int32 [S], ``mlm_positions`` int32 [P] (ascending, 0-padded),
  ``mlm_labels`` int32 [P] (original ids, 0 at padding), ``mlm_weights`` float32 [P].
  """
  ids = np.asarray(ids)
  if ids.ndim != 1:
    raise ValueError(f"mask_tokens takes one sequence [S]; got shape {ids.shape}")
  masker = Masker(special_ids, vocab_size, mask_prob, max_predictions, ids.shape[0])
  out = masker.with_generator(ids[None].astype(np.int32), rng)
  return {key: value[0] for key, value in out.items()}
