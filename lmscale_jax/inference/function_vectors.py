"""One vector per function from a trained model: what ``lmscale embed`` writes, ``lmscale
eval-similarity`` ranks with and ``lmscale index`` keeps (one implementation, so they agree by
construction).

Data-parallel on the devices present: each forward pass is BATCH rows per local device, the
batch's leading axis sharded over a 1-D mesh of ``jax.local_devices()`` (``jax.jit`` with a
``NamedSharding``, the parameters replicated once per model); on one device this is the
single-device program it always was. A row's vector does not depend on the device count beyond
float rounding (tests/test_search_array.py: 4 host devices against 1, within 1e-6).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from lmscale_jax.errors import UserError
from lmscale_jax.inference import trained_model

BATCH = 32  # sequences per device per forward pass, the last batch padded: one program per model
AXIS = "batch"

# The one model whose weights sit replicated on the mesh: (its host params, its head, devices,
# the model with placed weights). One entry: embedding per binary must not re-send the weights
# per call; the head is part of the key (a model and its fine-tune may share an encoder).
_placed: list = []


def mesh() -> jax.sharding.Mesh:
  return jax.sharding.Mesh(np.array(jax.local_devices()), (AXIS,))


def on_devices(model, where: jax.sharding.Mesh):
  """``model`` with its encoder (and projection head) replicated over ``where``, cached."""
  key = (model.params, model.head, tuple(where.devices.flat))
  if _placed and all(a is b for a, b in zip(_placed[0][:2], key)) and _placed[0][2] == key[2]:
    return _placed[0][3]
  everywhere = jax.sharding.NamedSharding(where, jax.sharding.PartitionSpec())
  head = model.head
  if head is not None:
    head = {**head, "projection": jax.device_put(head["projection"], everywhere)}
  placed = dataclasses.replace(model, params=jax.device_put(model.params, everywhere), head=head)
  _placed[:] = [(*key, placed)]
  return placed


def forward(model, ids: np.ndarray, where: jax.sharding.Mesh) -> np.ndarray:
  """ids [B, S] (B a multiple of the mesh's size) → a fine-tuned model's embeddings [B, D], else
  the last hidden layer [B, S, H]; the rows split over the mesh's devices."""
  placed = on_devices(model, where)
  rows = jax.device_put(ids, jax.sharding.NamedSharding(where, jax.sharding.PartitionSpec(AXIS)))
  if model.head is not None:
    return trained_model.embeddings(placed, rows)
  return trained_model.last_hidden(placed, rows)


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
  pad, where = model.special_ids["[PAD]"], mesh()
  size = BATCH * where.devices.size
  names, files, lengths, cuts, vectors = [], [], [], [], []
  batch: list = []

  def flush():
    # Always ``size`` rows (the last batch padded with empty ones): one program per model.
    rows = [b[2] for b in batch]
    ids = trained_model.pad_batch(rows + [rows[0][:0]] * (size - len(rows)), model.cfg.seq_len,
                                  pad)
    out = forward(model, ids, where)
    if model.head is not None:  # the fine-tuned embedding: pooled, projected, normalised
      vectors.extend(out[:len(rows)])
      batch.clear()
      return
    for row, (_, _, x, _) in zip(out, batch):
      # Mean over the function's own tokens: positions 1..len-2 (not [CLS], [SEP], padding).
      vectors.append(row[0] if pool == "cls" else row[1:len(x) - 1].mean(axis=0))
    batch.clear()

  for item in inputs:
    name, file, ids, cut = item
    names.append(name), files.append(file), lengths.append(len(ids) - 2), cuts.append(cut)
    batch.append(item)
    if len(batch) == size:
      flush()
  if batch:
    flush()
  if not vectors:
    raise UserError("no functions to embed in the given input")
  return {"embeddings": np.stack(vectors).astype(np.float32), "names": np.array(names),
          "files": np.array(files), "tokens": np.array(lengths, np.int32),
          "truncated": np.array(cuts, bool), "pool": np.array(pool),
          "projection": np.array(model.head is not None)}
