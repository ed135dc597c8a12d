"""One vector per function from a trained model: what ``lmscale embed`` writes and ``lmscale
eval-similarity`` ranks with (one implementation, so the two agree by construction)."""

from __future__ import annotations

import numpy as np

from lmscale_jax.errors import UserError
from lmscale_jax.inference import trained_model

BATCH = 32  # sequences per forward pass, the last batch padded: one compiled program per model


def resolve_pool(model, pool: str | None) -> str:
  """``--pool`` (None: not given) for this model: a fine-tuned one has its head's."""
  if model.head is None:
    return pool or "mean"
  if pool and pool != model.head["pool"]:
    raise UserError(f"--pool {pool}: {model.source} is fine-tuned with {model.head['pool']} "
                    "pooling and a projection head, which give its embeddings; leave --pool out")
  return model.head["pool"]


def embed(model, inputs, pool: str | None = None) -> dict:
  """``inputs``: (name, file, ids, truncated) per function, ids as ``trained_model.encode``
  gives them → the arrays of an embeddings file (``embeddings`` float32 [N, H], ``names``,
  ``files``, ``tokens``, ``truncated``, ``pool``, ``projection``)."""
  pool = resolve_pool(model, pool)
  pad = model.special_ids["[PAD]"]
  names, files, lengths, cuts, vectors = [], [], [], [], []
  batch: list = []

  def flush():
    # Always BATCH rows (the last batch padded with empty ones): one compiled program per model.
    rows = [b[2] for b in batch]
    ids = trained_model.pad_batch(rows + [rows[0][:0]] * (BATCH - len(rows)), model.cfg.seq_len,
                                  pad)
    if model.head is not None:  # the fine-tuned embedding: pooled, projected, normalised
      vectors.extend(trained_model.embeddings(model, ids)[:len(rows)])
      batch.clear()
      return
    h = trained_model.last_hidden(model, ids)
    for row, (_, _, x, _) in zip(h, batch):
      # Mean over the function's own tokens: positions 1..len-2 (not [CLS], [SEP], padding).
      vectors.append(row[0] if pool == "cls" else row[1:len(x) - 1].mean(axis=0))
    batch.clear()

  for item in inputs:
    name, file, ids, cut = item
    names.append(name), files.append(file), lengths.append(len(ids) - 2), cuts.append(cut)
    batch.append(item)
    if len(batch) == BATCH:
      flush()
  if batch:
    flush()
  if not vectors:
    raise UserError("no functions to embed in the given input")
  return {"embeddings": np.stack(vectors).astype(np.float32), "names": np.array(names),
          "files": np.array(files), "tokens": np.array(lengths, np.int32),
          "truncated": np.array(cuts, bool), "pool": np.array(pool),
          "projection": np.array(model.head is not None)}
