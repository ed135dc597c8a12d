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
import time

import jax
import numpy as np

from lmscale_jax.errors import UserError
from lmscale_jax.inference import trained_model

# Rows per device a forward pass computes: the fewest of these that hold its functions, the
# rest empty rows. One size (32) made a lone served function cost 32 rows, and lmscale serve's
# batches at 8 clients of one function each were 13% the functions' own tokens against 82%
# offline (benchmarks/bench_serve.py's token_fill, 2026-12-07). Each size is one more compiled
# program per length bucket (lmscale serve compiles them all before it listens).
ROW_BUCKETS = (8, 32)
BATCH = ROW_BUCKETS[-1]  # the most sequences per device per forward pass
# A forward pass's own cost in token positions, what one more cut must save: a pass of 8 x 16
# positions took 2.2 ms, of 32 x 16 3.6 ms (the demo model, 2 busy CPU cores, 2026-12-07).
# The cost of a pass where none is measured (:func:`positions_cost`); lmscale serve measures its
# programs (:func:`measured_passes`): a row is not the same price in every program.
PASS_SLOTS = 256
# Functions sorted by length together (WINDOW batches), each batch padded to the next multiple
# of seq_len / BUCKETS rather than to seq_len: at seq 512, 34% of the similarity benchmark's
# tokens were padding, 12% now, 1.44× the functions/s (docs/performance.md, "Embedding"). The
# vectors are seq_len padding's to float rounding (the padding is masked; tested in
# tests/test_search_array.py).
WINDOW = 8
BUCKETS = 8
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


def padded_length(longest: int, seq_len: int) -> int:
  """The length a batch whose longest row has ``longest`` tokens is padded to: the next
  multiple of ``seq_len / BUCKETS`` (at most BUCKETS programs per model)."""
  step = max(seq_len // BUCKETS, 1)
  return min(seq_len, -(-longest // step) * step)


def rows_for(n: int, devices: int) -> int:
  """The rows a forward pass of ``n`` functions computes: the smallest ROW_BUCKETS size (per
  device) that holds them."""
  return next(r * devices for r in ROW_BUCKETS if r * devices >= n)


def batch_slots(lengths: list[int], devices: int, seq_len: int) -> int:
  """The token positions one forward pass computes for rows of ``lengths`` (ids, with [CLS]
  and [SEP]): :func:`rows_for` rows, each padded to the batch's bucket. Over the rows' own
  ``sum(lengths)``: how much of the model's work went to real tokens (lmscale serve's
  /api/info, benchmarks/bench_serve.py)."""
  return rows_for(len(lengths), devices) * padded_length(max(lengths), seq_len)


def window_slots(lengths: list[int], devices: int, seq_len: int,
                 costs: dict | None = None) -> int:
  """:func:`batch_slots` over the batches :func:`embed` makes of these rows, in this order
  (WINDOW batches at a time, cut by :func:`_by_length`): the offline embedder's work."""
  span, total = BATCH * devices * WINDOW, 0
  for i in range(0, len(lengths), span):
    window = [(j, [0] * n) for j, n in enumerate(lengths[i:i + span])]
    total += sum(batch_slots([len(ids) for _, ids in b], devices, seq_len)
                 for b in _by_length(window, devices, seq_len, costs))
  return total


def positions_cost(rows: int, length: int) -> int:
  """A forward pass's cost, unmeasured: the token positions it computes, plus PASS_SLOTS. The
  offline tools cut by it: their vectors do not depend on a clock (the same cuts every run)."""
  return rows * length + PASS_SLOTS


def measured_passes(model, pool: str, where, repeats: int = 3) -> dict:
  """{(rows, length): seconds} of a forward pass of every program (ROW_BUCKETS rows per device
  at each length bucket), compiled, then the fastest of ``repeats``. On a CPU a row is not the
  same price everywhere: at the demo model's length 128 a pass of 8 rows took 6.6 ms, of 32
  rows 47 ms, 1.8x a row's cost (one core, 2026-12-07); on a GPU the larger pass should win."""
  seq_len, devices = int(model.cfg.seq_len), where.devices.size
  word = model.special_ids["[UNK]"]  # not padding: every position computed as in use
  out = {}
  for rows in ROW_BUCKETS:
    for n in sorted({padded_length(k, seq_len) for k in range(1, seq_len + 1)}):
      batch = [(i, np.full(n, word, np.int32)) for i in range(rows * devices)]
      _pooled(model, pool, batch, where)  # its compile, not timed
      out[rows * devices, n] = min(timed(_pooled, model, pool, batch, where)
                                   for _ in range(repeats))
  return out


def timed(fn, *args) -> float:
  start = time.perf_counter()
  fn(*args)
  return time.perf_counter() - start


def _by_length(window: list, devices: int, seq_len: int, costs: dict | None = None) -> list[list]:
  """``window``'s (index, ids) items, shortest first, cut into batches of at most BATCH rows
  per device where the passes cost least (``costs``: :func:`measured_passes`; None:
  :func:`positions_cost`): the cut points by dynamic programming, over at most WINDOW batches'
  rows: 0.5 ms of Python for 50 rows, 3.2 ms for 256 (measured on 2 busy cores, 2026-12-07;
  a 256-function window takes about 0.5 s to embed on them)."""
  ordered = sorted(window, key=lambda item: len(item[1]))
  most, n = BATCH * devices, len(ordered)
  price = positions_cost if costs is None else lambda rows, length: costs[rows, length]
  cost, cut = [0] + [float("inf")] * n, [0] * (n + 1)
  for i in range(1, n + 1):
    longest = padded_length(len(ordered[i - 1][1]), seq_len)
    for j in range(max(0, i - most), i):
      c = cost[j] + price(rows_for(i - j, devices), longest)
      if c < cost[i]:
        cost[i], cut[i] = c, j
  batches, i = [], n
  while i:
    batches.append(ordered[cut[i]:i])
    i = cut[i]
  return batches[::-1]


def _pooled(model, pool: str, batch: list, where) -> list:
  """One vector per (index, ids) of ``batch``: :func:`rows_for` rows in (the rest empty),
  padded to the batch's bucket."""
  size = rows_for(len(batch), where.devices.size)
  rows = [ids for _, ids in batch]
  ids = trained_model.pad_batch(rows + [rows[0][:0]] * (size - len(rows)),
                                padded_length(max(map(len, rows)), model.cfg.seq_len),
                                model.special_ids["[PAD]"])
  out = forward(model, ids, where)
  if model.head is not None:  # the fine-tuned embedding: pooled, projected, normalised
    return list(out[:len(rows)])
  # Mean over the function's own tokens: positions 1..len-2 (not [CLS], [SEP], padding).
  return [row[0] if pool == "cls" else token_mean(row[1:len(x) - 1])
          for row, x in zip(out, rows)]


def token_mean(h: np.ndarray) -> np.ndarray:
  """The mean of a text's token vectors [n, H]; a text of no token (an empty query) is the zero
  vector, not numpy's NaN mean: normalised it stays zero (score 0), where NaN was the score of
  every row and a JSON answer that could not be sent (HTTP 500)."""
  return h.mean(axis=0) if len(h) else np.zeros(h.shape[1:], h.dtype)


def embed(model, inputs, pool: str | None = None, costs: dict | None = None) -> dict:
  """``inputs``: (name, file, ids, truncated) per function, ids as ``trained_model.encode``
  gives them → the arrays of an embeddings file (``embeddings`` float32 [N, H], ``names``,
  ``files``, ``tokens``, ``truncated``, ``pool``, ``projection``). The functions are embedded
  WINDOW batches at a time, sorted by length inside each window so that a batch is padded to
  its own bucket (:func:`padded_length`), not to ``seq_len``; the vectors come back in the
  input's order. ``costs``: cut by measured passes (:func:`_by_length`), as lmscale serve does."""
  pool = resolve_pool(model, pool)
  where = mesh()
  size = BATCH * where.devices.size
  names, files, lengths, cuts, vectors = [], [], [], [], []
  window: list = []

  def flush():
    for batch in _by_length(window, where.devices.size, int(model.cfg.seq_len), costs):
      for (i, _), v in zip(batch, _pooled(model, pool, batch, where)):
        vectors[i] = v
    window.clear()

  for name, file, ids, cut in inputs:
    names.append(name), files.append(file), lengths.append(len(ids) - 2), cuts.append(cut)
    window.append((len(vectors), ids))
    vectors.append(None)
    if len(window) == size * WINDOW:
      flush()
  if window:
    flush()
  if not vectors:
    raise UserError("no functions to embed in the given input")
  return {"embeddings": np.stack(vectors).astype(np.float32), "names": np.array(names),
          "files": np.array(files), "tokens": np.array(lengths, np.int32),
          "truncated": np.array(cuts, bool), "pool": np.array(pool),
          "projection": np.array(model.head is not None)}
