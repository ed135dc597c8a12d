"""Grain input pipeline: shards -> shuffle -> repeat -> process slice -> MLM masking -> batch.

Semantics. The *global stream* is ``repeat(shuffle_e(records))``: epoch ``e`` visits every
record of the split once, in a permutation seeded by ``(data.seed, e)`` (train) or in file
order (eval). Global position ``p`` of the stream belongs to process ``p % process_count``;
a process's local batch ``b`` holds its local elements ``[b*lb, (b+1)*lb)`` with
``lb = train.batch_size // process_count``. That is the structure of
``source.seed(s).shuffle().repeat()[pi::pc].batch(lb, drop_remainder=True)``, with
:func:`feistel_permute` as the per-epoch shuffle.

``data.shard_by_process=True`` (by-shard mode) instead gives process ``pi`` of ``pc`` only the
shard files ``pi, pi+pc, pi+2pc, …`` of each split and makes its stream local:
``repeat(shuffle_e(its records))`` (train; eval: its records in file order, wrapping); local
element ``l`` still has the globally unique masking key ``l*pc + pi``. Every split needs at
least ``pc`` shards. The trade-off: *interleaved* (the default) makes the global batch
sequence identical for any process count (the loss trajectory of 1 and 64 processes is the
same), but every process reads every shard, so every node needs the whole dataset on local
disk; *by-shard* lets a node stage only its processes' ``1/pc`` of the shards
(``tools/stage.py --only-needed --plan by_shard``, ``staging.needed_shards``), but which
records form a batch depends on the process count (and on uneven shard sizes, epochs of
different lengths per process), so runs with different process counts see different batches,
and a checkpoint resumes only with the same process count (as in both modes).

Why the Grain graph is built over *batch indices* instead of per-record transformations
(measured on seq-512 records, 2-core Xeon): Grain's per-element chain (source -> shuffle ->
repeat -> slice -> map: every element a separate ``__getitem__`` through every stage) costs
~90-110 us per record before any masking, and ``ArrayRecordDataSource`` reads through
``ArrayRecordReader.read([i])``, which does O(records in the shard) work per call (~350 us on
a 64k-record, 64 MB shard of group_size 1). Here one Grain element is one batch:
``MapDataset.range(num_batches).map(_BatchLoader)``. ``_BatchLoader`` computes the batch's
global positions with numpy, permutes them with a vectorised Feistel permutation (stateless,
O(batch) memory for any dataset size), reads each record with an O(1) ``seek`` + ``read``,
decodes the batch with one ``frombuffer`` and masks the whole batch at once: ~25 us of CPU per
sample in total. Grain still provides the worker processes (``mp_prefetch``), thread prefetch
(``ReadOptions``) and the checkpointable iterator state (the next batch index).

Consequently ``data.prefetch_buffer`` and ``data.read_threads`` count *batches* and *batch
builders* (per process: each ``mp_prefetch`` worker runs its own). Small values are right:
read_threads 1-2, prefetch_buffer 2-8; Grain's per-record defaults (16 threads, 500
elements) buffer 500 batches per worker and, on 2 cores with 2 workers, halved throughput.

Masking randomness is a counter-based hash of ``(seed, global position p, token position)``:
it depends neither on how many batches were drawn nor on the batch size or worker count, so a
restored iterator reproduces the same batches bit for bit. ``mask_tokens`` is the same
algorithm for one sequence driven by a ``numpy.random.Generator``.
"""

from __future__ import annotations

import copy
import math
import threading
import time
from typing import Any, Callable, Iterator, Mapping

import grain
import numpy as np
from absl import logging

from lmscale_jax import dataset

# Validation masks never depend on data.seed, so eval losses of runs with different training
# seeds are comparable.
EVAL_MASK_SEED = 20_240_601
# The train stream is effectively infinite; bounded so that global positions stay < 2**62
# (int64 / uint64 arithmetic never overflows).
_MAX_POSITION = 1 << 62

_U64 = np.uint64
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
# Hash streams: independent keys for the shuffle and for the two masking draws.
_STREAM_SHUFFLE, _STREAM_SELECT, _STREAM_ACTION = 0x5348, 0x5345, 0x4143
_FEISTEL_ROUNDS = 4
# data.on_corrupt: what a record that cannot be read or decoded does (see _Records).
ON_CORRUPT = ("error", "skip")


# --------------------------------------------------------------------------- hashing
def _mix64_int(z: int) -> int:
  """splitmix64 finaliser on a Python int (for scalar keys: no numpy overflow warnings)."""
  z &= _MASK64
  z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
  z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
  return z ^ (z >> 31)


def _mix64(z: np.ndarray) -> np.ndarray:
  """splitmix64 finaliser, vectorised; modifies and returns ``z`` (uint64, wraps mod 2**64)."""
  z ^= z >> _U64(30)
  z *= _U64(0xBF58476D1CE4E5B9)
  z ^= z >> _U64(27)
  z *= _U64(0x94D049BB133111EB)
  z ^= z >> _U64(31)
  return z


def _identity(v):
  return v


def _wrap64(v: int) -> int:
  return v & _MASK64


def _key(seed: int, stream: int) -> int:
  return _mix64_int(_mix64_int(seed) ^ _mix64_int(stream + _GOLDEN))


def _row_keys(key: int, positions: np.ndarray) -> np.ndarray:
  """One 64-bit key per global stream position."""
  return _mix64(positions.astype(np.uint64) * _U64(_GOLDEN) + _U64(key))


def feistel_permute(k: np.ndarray, n: int, seed: int, epoch: np.ndarray) -> np.ndarray:
  """``perm_{seed,epoch}(k)``: a pseudo-random permutation of ``[0, n)``, vectorised.

  A Feistel network on ``t = bit_length(n - 1)`` bits (halves of alternating width) is a
  bijection of ``[0, 2**t)``; cycle-walking (re-applying it while the value is ``>= n``)
  restricts it to a bijection of ``[0, n)``. Since ``2**t < 2n`` a walk takes < 2 steps on
  average. ``epoch`` (same shape as ``k``) selects the round keys, so elements of two epochs
  can be permuted in one call. Stateless and O(len(k)): no per-epoch permutation table, so
  it costs the same for any dataset size.
  """
  k = np.asarray(k, np.int64)
  if n <= 1:
    return np.zeros_like(k)
  t = max(2, (n - 1).bit_length())
  base = _key(seed, _STREAM_SHUFFLE)
  ep = np.asarray(epoch, np.int64).astype(np.uint64)
  round_keys = [_mix64(ep * _U64(_GOLDEN) + _U64((base + r * 0x632BE59BD9B4E019) & _MASK64))
                for r in range(_FEISTEL_ROUNDS)]
  x = _feistel(k.astype(np.uint64), round_keys, t, _U64, _identity)
  out = np.nonzero(x >= _U64(n))[0]
  # Cycle-walk: vectorised while many elements remain; the last few (the geometric tail of
  # walk lengths) in Python ints, where a walk costs ~2 us instead of ~50 us of numpy calls.
  while out.size > 8:
    x[out] = _feistel(x[out], [rk[out] for rk in round_keys], t, _U64, _identity)
    out = out[x[out] >= _U64(n)]
  for i in out.tolist():
    keys, v = [int(rk[i]) for rk in round_keys], int(x[i])
    while v >= n:
      v = _feistel(v, keys, t, int, _wrap64)
    x[i] = v
  return x.astype(np.int64)


def _feistel(x, round_keys, t: int, u, wrap):
  """Feistel network on ``t``-bit values: uint64 arrays (``u=np.uint64``, no ``wrap``: numpy
  wraps) or Python ints (``u=int``, ``wrap`` masks to 64 bits); constants are converted with
  ``u`` because numpy ops with Python-int operands are 2-4x slower.

  State (hi, lo) -> (lo, hi ^ F(lo)) is invertible whatever F is; the halves' widths swap
  each round, so odd ``t`` works. F: multiplicative hash of ``lo ^ key``, top bits.
  """
  m1, m2, s32 = u(0xBF58476D1CE4E5B9), u(0x94D049BB133111EB), u(32)
  lo_bits = t // 2
  hi, lo = x >> u(lo_bits), x & u((1 << lo_bits) - 1)
  for rk in round_keys:
    hi_bits = t - lo_bits
    z = wrap((lo ^ rk) * m1)
    z ^= z >> s32
    z = wrap(z * m2)
    hi, lo = lo, hi ^ (z >> u(64 - hi_bits))
    lo_bits = hi_bits
  return (hi << u(lo_bits)) | lo


def _fmix32(h: np.ndarray) -> np.ndarray:
  """murmur3 32-bit finaliser (a bijection of uint32), in place."""
  h ^= h >> np.uint32(16)
  h *= np.uint32(0x85EBCA6B)
  h ^= h >> np.uint32(13)
  h *= np.uint32(0xC2B2AE35)
  h ^= h >> np.uint32(16)
  return h


# --------------------------------------------------------------------------- masking
class _Masker:
  """BERT MLM masking for a batch ``[B, S]``; holds the lookup tables built from metadata."""

  def __init__(self, special_ids: Mapping[str, int], vocab_size: int, mask_prob: float,
               max_predictions: int | None, seq_len: int):
    if "[MASK]" not in special_ids:
      raise ValueError(f"special_ids has no '[MASK]' entry: {dict(special_ids)}")
    if not 0.0 < mask_prob < 1.0:
      raise ValueError(f"mask_prob must be in (0, 1); got {mask_prob}")
    self.mask_id = int(special_ids["[MASK]"])
    self.mask_prob = float(mask_prob)
    self.seq_len = int(seq_len)
    self.num_predictions = int(max_predictions or math.ceil(mask_prob * seq_len))
    if self.num_predictions <= 0:
      raise ValueError(f"max_predictions must be positive; got {max_predictions}")
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
    self._pos_keys = _mix64(np.arange(seq_len, dtype=np.uint64) + _U64(_GOLDEN))
    self._pos_keys32 = _fmix32(np.arange(seq_len, dtype=np.uint32) * np.uint32(0x9E3779B9))

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
    b, s = maskable.shape
    p = self.num_predictions
    n = maskable.sum(axis=1)
    k = np.where(n > 0, np.clip(np.floor(self.mask_prob * n + 0.5), 1, p), 0).astype(np.int64)
    threshold = np.sort(priority, axis=1)[np.arange(b), np.maximum(k - 1, 0)]
    chosen = (priority <= threshold[:, None]) & maskable
    chosen[k == 0] = False
    # A priority tie at the threshold (~never: needs equal 32-bit hashes) would choose more
    # than k; redo such rows exactly.
    for r in np.nonzero(chosen.sum(axis=1) != k)[0].tolist():
      cand = np.nonzero(maskable[r])[0]
      chosen[r] = False
      chosen[r, cand[np.argsort(priority[r, cand], kind="stable")[:k[r]]]] = True
    # Row-major flat indices: each row's k positions, ascending, fill its first k slots.
    flat = np.flatnonzero(chosen)
    valid = np.arange(p)[None, :] < k[:, None]
    pos = np.zeros((b, p), np.int32)
    pos[valid] = flat - np.repeat(np.arange(b) * s, k)
    return pos, valid

  def _apply(self, ids, pos, valid, action, token_index) -> dict[str, np.ndarray]:
    """80% [MASK], 10% random non-special token, 10% unchanged (``action`` uniform [0,1))."""
    b, s = ids.shape
    flat = pos + (np.arange(b, dtype=np.int64) * s)[:, None]
    out = np.array(ids, np.int32, order="C")  # a copy: the caller's ids stay unmasked
    labels = np.where(valid, out.reshape(-1)[flat], 0).astype(np.int32)
    new = np.where(action < 0.8, self.mask_id,
                   np.where(action < 0.9, self.replacements[token_index], labels))
    out.reshape(-1)[flat[valid]] = new[valid]
    return {"input_ids": out, "mlm_positions": pos, "mlm_labels": labels,
            "mlm_weights": valid.astype(np.float32)}

  def with_generator(self, ids: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
    special = self.is_special(ids)
    pos, valid = self._select(~special, np.where(special, 2.0, rng.random(ids.shape)))
    action = rng.random(pos.shape)
    token_index = rng.integers(0, self.replacements.size, pos.shape)
    return self._apply(ids, pos, valid, action, token_index)

  def keyed(self, ids: np.ndarray, positions: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    """Masks row ``i`` with randomness keyed by ``(seed, positions[i])`` only."""
    special = self.is_special(ids)
    # 32-bit priorities (sorting/hashing 4x cheaper than 64-bit on [B, S]); fmix32 is a
    # bijection and the per-position keys are distinct, so a row's priorities are distinct.
    rows = _row_keys(_key(seed, _STREAM_SELECT), positions).astype(np.uint32)
    priority = _fmix32(rows[:, None] ^ self._pos_keys32[None, :])
    np.putmask(priority, special, np.uint32(0xFFFFFFFF))  # specials rank last
    pos, valid = self._select(~special, priority)
    rows2 = _row_keys(_key(seed, _STREAM_ACTION), positions)
    h2 = _mix64(rows2[:, None] ^ self._pos_keys[pos])
    action = (h2 >> _U64(40)).astype(np.float64) * (1.0 / (1 << 24))
    token_index = ((h2 & _U64(0xFFFFFFFF)) * _U64(self.replacements.size)) >> _U64(32)
    return self._apply(ids, pos, valid, action, token_index.astype(np.int64))


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
  masker = _Masker(special_ids, vocab_size, mask_prob, max_predictions, ids.shape[0])
  out = masker.with_generator(ids[None].astype(np.int32), rng)
  return {k: v[0] for k, v in out.items()}


# --------------------------------------------------------------------------- reading
class _UnopenableShard:
  """Stands in for the reader of a shard that cannot be opened (``data.on_corrupt='skip'``)."""

  def seek(self, index: int):
    raise RuntimeError("the shard cannot be opened")


class _Records:
  """Random access to a split's records, with errors that name the shard file.

  Reads one record at a time with ``seek(i); read()`` on a sequential-mode reader
  (``max_parallelism:0``): ``ArrayRecordReader.read(indices)`` (what Grain's
  ``ArrayRecordDataSource`` calls) does O(records in the shard) bookkeeping per call, ~350 us
  per call on a 64k-record shard of group_size 1, while seek+read is O(1), ~10 us.
  A reader is stateful (seek position), so each shard's reader is guarded by a lock for the
  ``ReadOptions`` threads that call the loader concurrently. Picklable: readers are opened
  lazily in whichever process reads (Grain workers).

  ``shards`` (indices into the split's shard list, default all) selects the shard files this
  instance reads (by-shard mode); record indices then run over those shards' records only.
  """

  def __init__(self, meta: dataset.DatasetMeta, split: str, shards=None):
    paths = meta.shard_paths(split)  # raises DatasetError for a split with zero shards
    counts = np.array([s["records"] for s in meta.splits[split]["shards"]], np.int64)
    self.shards = list(range(len(paths))) if shards is None else [int(i) for i in shards]
    if not self.shards or not all(0 <= i < len(paths) for i in self.shards):
      raise ValueError(f"shards {self.shards}: expected a non-empty subset of the "
                       f"{len(paths)} shards of split {split!r}")
    self.paths = [paths[i] for i in self.shards]
    self.counts = counts[self.shards]
    self.split_starts = (np.cumsum(counts) - counts)[self.shards]  # for error messages
    self.ends = np.cumsum(self.counts)
    self.starts = self.ends - self.counts
    self.seq_len = meta.seq_len
    self._init_readers()

  on_corrupt = "error"  # see set_on_corrupt
  _pad_record: bytes | None = None

  def set_on_corrupt(self, mode: str, pad_id: int) -> None:
    """``data.on_corrupt``. ``"error"``: a record that cannot be read (corrupt chunk, shard
    that cannot be opened) or decoded (malformed, token id >= vocab_size) raises
    DatasetError naming the shard file and record. ``"skip"``: it reads as an all-``pad_id``
    row instead (``read``/``decode`` report its row in ``bad``), with one warning per bad
    record (per process) or per shard that cannot be opened. The good path costs the same."""
    if mode not in ON_CORRUPT:
      raise ValueError(f"data.on_corrupt {mode!r}: expected one of {ON_CORRUPT}")
    self.on_corrupt = mode
    self._pad_record = dataset.encode_record(np.full(self.seq_len, pad_id, np.uint16))

  def _skip(self, index: int, message: str) -> None:
    """Skip mode: warns about split record ``index`` the first time it is skipped."""
    with self._open_lock:
      if index in self._warned:
        return
      self._warned.add(index)
    logging.warning("%s; skipped: an all-[PAD] row (data.on_corrupt='skip')", message)

  def _init_readers(self):
    self._readers: list[Any] = [None] * len(self.paths)
    self._locks = [threading.Lock() for _ in self.paths]
    self._open_lock = threading.Lock()
    self._warned: set[int] = set()

  def __len__(self) -> int:
    return int(self.ends[-1])

  def __getstate__(self):
    return {k: v for k, v in self.__dict__.items()
            if k not in ("_readers", "_locks", "_open_lock", "_warned")}

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._init_readers()

  def _shard_of(self, index: int) -> int:
    return int(np.searchsorted(self.ends, index, side="right"))

  def locate(self, index: int) -> tuple[str, int]:
    """Record index (over this instance's shards) -> (shard file, record index inside it)."""
    shard = self._shard_of(index)
    return self.paths[shard], int(index - self.starts[shard])

  def where(self, index: int) -> str:
    shard = self._shard_of(index)
    local = int(index - self.starts[shard])
    return (f"{self.paths[shard]}: record {local} "
            f"(split record {int(self.split_starts[shard]) + local})")

  def _open(self, shard: int):
    with self._open_lock:
      if self._readers[shard] is not None:
        return self._readers[shard]
      from array_record.python import array_record_module

      path = self.paths[shard]
      try:
        # Records are ~1 KB and read at random: no readahead, no thread pool, small buffer.
        reader = array_record_module.ArrayRecordReader(
            path, options="readahead_buffer_size:0,max_parallelism:0",
            file_reader_buffer_size=8192)
        if not reader.ok():
          # The binding exposes no status(); a read raises the reason (truncated, bad footer).
          reader.read()
          raise RuntimeError("reader not ok")
        n = reader.num_records()
      except Exception as e:  # array_record raises RuntimeError/OSError on bad files
        return self._unopenable(shard, f"{path}: cannot open ArrayRecord shard: {e}", e)
      if n != self.counts[shard]:
        return self._unopenable(
            shard, f"{path}: {n} records, metadata.json says {self.counts[shard]}")
      self._readers[shard] = reader
      return reader

  def _unopenable(self, shard: int, message: str, cause: Exception | None = None):
    """Error mode: raises. Skip mode: one warning; the shard's reader becomes a stand-in
    whose reads fail, so all its records read as skipped rows."""
    if self.on_corrupt != "skip":
      raise dataset.DatasetError(message) from cause
    logging.warning("%s; skipping all its %d records (data.on_corrupt='skip')", message,
                    self.counts[shard])
    self._readers[shard] = _UnopenableShard()
    return self._readers[shard]

  def read(self, indices: np.ndarray, bad: list[int] | None = None) -> list[bytes]:
    """Records ``indices`` (split record indices). Skip mode (``set_on_corrupt``): an
    unreadable record is an all-[PAD] record and its row is appended to ``bad``."""
    shards = np.searchsorted(self.ends, indices, side="right")
    local = (indices - self.starts[shards]).tolist()
    out = []
    for i, shard in enumerate(shards.tolist()):
      if self._readers[shard] is None:
        self._open(shard)
      with self._locks[shard]:
        reader = self._readers[shard]  # under the lock: skip mode replaces a failed reader
        try:
          reader.seek(local[i])
          out.append(reader.read())
        except Exception as e:  # corrupt chunk (hash mismatch, bad compression, ...)
          message = f"{self.where(int(indices[i]))}: unreadable (corrupt shard?): {e}"
          unopenable = isinstance(reader, _UnopenableShard)  # reported when opened
          if not unopenable:
            # A Riegeli reader that failed stays failed: reopen it, else the shard's other
            # records (other threads' reads too) would fail in this record's name.
            self._readers[shard] = None
            try:
              self._open(shard)
            except dataset.DatasetError:
              pass  # the next read of the shard opens it again and reports why it cannot
          if self.on_corrupt != "skip":
            raise dataset.DatasetError(message) from e
          if not unopenable:
            self._skip(int(indices[i]), message)
          out.append(self._pad_record)
          if bad is not None:
            bad.append(i)
    return out

  def decode(self, records: list[bytes], indices: np.ndarray, vocab_size: int,
             bad: list[int] | None = None) -> np.ndarray:
    """Records -> int32 [B, S]; one ``frombuffer`` for the batch, errors name file/record.
    Skip mode: a malformed record or one with a token id >= vocab_size becomes an all-[PAD]
    row, appended to ``bad``."""
    prefix = dataset.record_prefix(self.seq_len)
    rec_len = len(prefix) + 2 * self.seq_len
    buf = b"".join(records)
    if len(buf) != rec_len * len(records):
      rows = [i for i, r in enumerate(records) if len(r) != rec_len]
    else:
      raw = np.frombuffer(buf, np.uint8).reshape(len(records), rec_len)
      ok = (raw[:, :len(prefix)] == np.frombuffer(prefix, np.uint8)).all(axis=1)
      rows = [] if ok.all() else np.flatnonzero(~ok).tolist()
    if rows:
      rejected = []
      for i in rows:
        try:  # decode_record raises its DatasetError, naming where
          dataset.decode_record(records[i], self.seq_len, where=self.where(int(indices[i])))
        except dataset.DatasetError as e:
          rejected.append((i, e))
          continue
        raise AssertionError(f"decode_record accepted {self.where(int(indices[i]))}, which "
                             "the batch check rejected")
      return self._reject(records, indices, vocab_size, bad, rejected)
    ids = np.ndarray((len(records), self.seq_len), "<u2", buffer=buf, offset=len(prefix),
                     strides=(rec_len, 2))
    if int(ids.max()) >= vocab_size:
      over = ids >= vocab_size
      rejected = []
      for row in np.flatnonzero(over.any(axis=1)).tolist():
        col = int(np.argmax(over[row]))
        rejected.append((row, dataset.DatasetError(
            f"{self.where(int(indices[row]))}: token id {int(ids[row, col])} at position {col} "
            f">= vocab_size {vocab_size} (dataset prepared with another tokenizer?)")))
      return self._reject(records, indices, vocab_size, bad, rejected)
    return ids.astype(np.int32)

  def _reject(self, records, indices, vocab_size, bad, rejected) -> np.ndarray:
    """``rejected``: [(row, DatasetError)]. Error mode: raises the first. Skip mode: warns,
    replaces those records by the all-[PAD] one and decodes the batch again."""
    if self.on_corrupt != "skip":
      raise rejected[0][1]
    records = list(records)
    for row, error in rejected:
      self._skip(int(indices[row]), str(error))
      records[row] = self._pad_record
      if bad is not None:
        bad.append(row)
    return self.decode(records, indices, vocab_size, bad)


class _BatchLoader:
  """Grain map: local batch index -> masked batch dict (see module docstring)."""

  def __init__(self, records: _Records, masker: _Masker, *, vocab_size: int, local_batch: int,
               process_index: int, process_count: int, shuffle_seed: int | None,
               mask_seed: int, local_stream: bool = False):
    self.records, self.masker, self.vocab_size = records, masker, vocab_size
    self.local_batch, self.process_index, self.process_count = (
        local_batch, process_index, process_count)
    self.shuffle_seed, self.mask_seed = shuffle_seed, mask_seed
    # By-shard mode: ``records`` are this process's shards only, read as its own stream.
    self.local_stream = local_stream

  def positions(self, batch_index: int) -> np.ndarray:
    """Global stream positions of this process's local batch ``batch_index`` (in by-shard
    mode: globally unique masking keys ``local * process_count + process_index``)."""
    local = batch_index * self.local_batch + np.arange(self.local_batch, dtype=np.int64)
    return local * self.process_count + self.process_index

  def record_indices(self, positions: np.ndarray) -> np.ndarray:
    """Indices into ``self.records`` of the stream elements at ``positions``: the global
    stream over all records, or (``local_stream``) this process's own stream over its shards'
    records, at local position ``positions // process_count``."""
    if self.local_stream:
      positions = positions // self.process_count
    n = len(self.records)
    epoch, k = np.divmod(positions, n)
    if self.shuffle_seed is None:
      return k
    return feistel_permute(k, n, self.shuffle_seed, epoch)

  def __call__(self, batch_index: int) -> dict[str, np.ndarray]:
    positions = self.positions(int(batch_index))
    indices = self.record_indices(positions)
    if self.records.on_corrupt != "skip":
      ids = self.records.decode(self.records.read(indices), indices, self.vocab_size)
      return self.masker.keyed(ids, positions, self.mask_seed)
    bad: list[int] = []  # skip mode: rows whose record was unreadable -> all-[PAD]
    ids = self.records.decode(self.records.read(indices, bad), indices, self.vocab_size, bad)
    batch = self.masker.keyed(ids, positions, self.mask_seed)
    batch["corrupt"] = np.zeros(len(indices), np.int32)
    batch["corrupt"][bad] = 1
    return batch


# --------------------------------------------------------------------------- datasets
def _check_model_compat(config, meta: dataset.DatasetMeta) -> None:
  model = config.get("model") if hasattr(config, "get") else None
  if model is None:
    return
  vocab, seq = model.get("vocab_size", 0), model.get("seq_len", 0)
  if vocab and vocab < meta.vocab_size:
    raise ValueError(f"model.vocab_size {vocab} < dataset vocab_size {meta.vocab_size} "
                     f"({meta.path}): token ids would overflow the embedding table")
  if seq and seq < meta.seq_len:
    raise ValueError(f"model.seq_len {seq} < dataset seq_len {meta.seq_len} ({meta.path})")


def local_batch_size(global_batch: int, process_count: int) -> int:
  if global_batch <= 0 or global_batch % process_count:
    raise ValueError(f"train.batch_size {global_batch} is not a positive multiple of the "
                     f"process count {process_count}: every process must load the same number "
                     "of rows")
  return global_batch // process_count


def make_batch_loader(config, split: str, *, train: bool, process_index: int = 0,
                      process_count: int = 1) -> _BatchLoader:
  """The per-batch function behind :func:`make_dataset` (its ``positions``/``record_indices``
  expose the stream order, and ``records.paths`` the shard files it reads, e.g. for tests)."""
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index {process_index} not in [0, {process_count})")
  data = config.data
  meta = dataset.DatasetMeta.load(data.path)
  _check_model_compat(config, meta)
  by_shard = bool(data.get("shard_by_process", False))
  shards = None
  if by_shard:
    # Must match lmscale_jax/staging.py needed_shards(plan="by_shard").
    n_shards = len(meta.shard_paths(split))
    if n_shards < process_count:
      raise dataset.DatasetError(
          f"{meta.path}: split {split!r} has {n_shards} shards for {process_count} processes: "
          "data.shard_by_process=True gives each process whole shards and needs at least one "
          "per process (re-prepare with a smaller --shard-size-mb, or set "
          "data.shard_by_process=False)")
    shards = range(process_index, n_shards, process_count)
  records = _Records(meta, split, shards)
  if len(records) == 0:
    raise dataset.DatasetError(f"{meta.path}: split {split!r} has no records"
                          + (f" in shards {list(shards)} (process {process_index} of "
                             f"{process_count}, data.shard_by_process)" if by_shard else ""))
  masker = _Masker(meta.special_ids, meta.vocab_size, data.mask_prob,
                   data.max_predictions or None, meta.seq_len)
  records.set_on_corrupt(str(data.get("on_corrupt", "error")), meta.pad_id)
  return _BatchLoader(
      records, masker, vocab_size=meta.vocab_size,
      local_batch=local_batch_size(config.train.batch_size, process_count),
      process_index=process_index, process_count=process_count,
      shuffle_seed=int(data.seed) if train else None,
      mask_seed=int(data.seed) if train else EVAL_MASK_SEED, local_stream=by_shard)


def make_dataset(config, split: str, *, train: bool, process_index: int = 0,
                 process_count: int = 1, start_batch: int = 0) -> grain.IterDataset:
  """Per-process batches (dicts of numpy arrays, see docs/design.md "Loader").

  ``train=True``: infinite, reshuffled each epoch, ``data.workers`` worker processes.
  ``train=False``: exactly ``train.eval_batches`` batches in file order (wrapping around a
  small split), fixed masking seed (``EVAL_MASK_SEED``), in-process; ``iter()`` it afresh for
  every evaluation so every evaluation sees identical batches.
  ``start_batch``: begin at this local batch index (a resume; see :class:`DevicePrefetcher`).
  Iterators support ``get_state()``/``set_state()`` (Grain checkpointing; JSON-serialisable).
  """
  loader = make_batch_loader(config, split, train=train, process_index=process_index,
                             process_count=process_count)
  global_batch = loader.local_batch * process_count
  num_batches = _MAX_POSITION // global_batch if train else int(config.train.eval_batches)
  if num_batches <= 0:
    raise ValueError(f"train.eval_batches must be positive; got {num_batches}")
  data = config.data
  if not 0 <= start_batch < num_batches:
    raise ValueError(f"start_batch {start_batch} not in [0, {num_batches})")
  batches = grain.MapDataset.range(start_batch, num_batches).map(loader)
  it = batches.to_iter_dataset(grain.ReadOptions(
      num_threads=int(data.read_threads), prefetch_buffer_size=int(data.prefetch_buffer)))
  # Eval stays in-process: every evaluation iterates afresh, and worker processes would be
  # spawned (seconds each) for a few batches that threads build in well under a second.
  if train and data.workers > 0:
    from lmscale_jax import preemption

    it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=int(data.workers)),
                        worker_init_fn=preemption.ignore_in_worker)
  return it


# --------------------------------------------------------------------------- device
def batch_sharding(mesh, axis: str = "data"):
  """``NamedSharding(mesh, P(axis))``: batch rows split over ``axis``, replicated elsewhere."""
  from jax.sharding import NamedSharding, PartitionSpec

  return NamedSharding(mesh, PartitionSpec(axis))


class DevicePrefetcher(grain.DatasetIterator):
  """Host batches -> global ``jax.Array``s, one batch ahead on device.

  ``next()`` returns batch ``c`` (already transferred) after pulling and starting the transfer
  of batch ``c + 1``; with JAX's asynchronous dispatch that pull overlaps the still-running
  previous step.

  Checkpointing. The wrapped iterator has always produced one batch more than the model
  consumed, so its own state would skip a batch on restore. Two modes:

  * ``reopen`` given (training): the state is ``{"next_batch": k}``, the number of batches
    ``next()`` has returned, and ``set_state`` builds a fresh host iterator with
    ``reopen(k)`` (``make_dataset(..., start_batch=k)``). The state does not depend on
    ``data.workers`` (Grain's own state has one format per worker count), so a run can resume
    with another number of loader workers, e.g. on other hardware. The first host iterator is
    also built lazily, so a restore never spawns workers twice.
  * an ``iterator`` only: the host iterator's own Grain state from before the prefetched (not
    yet consumed) batch was pulled; ``set_state`` restores it and drops the prefetched batch.

  Being a ``grain.DatasetIterator`` itself, it can be passed straight to
  ``grain.checkpoint.CheckpointSave`` / ``CheckpointRestore`` (Orbax); do not save
  ``.iterator`` (the raw host iterator) instead.

  ``wait_seconds``: cumulative time ``next()`` spent blocked on the host iterator (input
  stall); ``reset_wait()`` zeroes it, so training can report the input-wait fraction per
  logging window.
  """

  def __init__(self, iterator: grain.DatasetIterator | None, sharding, *,
               reopen: Callable[[int], Iterator] | None = None):
    if iterator is None and reopen is None:
      raise ValueError("DevicePrefetcher needs an iterator or reopen")
    super().__init__(() if iterator is None else iterator)
    self.iterator = iterator
    self.sharding = sharding
    self.reopen = reopen
    self.wait_seconds = 0.0
    self._next_batch = 0  # batches next() has returned (reopen mode)
    self._ahead = None  # (host state before the pull, device batch) or (state, None) at end

  def reset_wait(self) -> float:
    """Zeroes ``wait_seconds`` and returns the value it had."""
    waited, self.wait_seconds = self.wait_seconds, 0.0
    return waited

  def _pull(self):
    import jax

    if self.iterator is None:
      self.iterator = self.reopen(self._next_batch)
    # A copy: Grain iterators may update their state dict in place.
    state = None if self.reopen else copy.deepcopy(self.iterator.get_state())
    t0 = time.perf_counter()
    try:
      host = next(self.iterator)
    except StopIteration:
      return state, None
    finally:
      self.wait_seconds += time.perf_counter() - t0
    return state, jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(self.sharding, x), host)

  def __next__(self) -> dict[str, Any]:
    if self._ahead is None:
      self._ahead = self._pull()
    _, batch = self._ahead
    if batch is None:
      raise StopIteration
    self._ahead = self._pull()
    self._next_batch += 1
    return batch

  def get_state(self) -> dict[str, Any]:
    if self.reopen is not None:
      return {"next_batch": self._next_batch}
    if self._ahead is None:
      return self.iterator.get_state()
    return self._ahead[0]

  def set_state(self, state: dict[str, Any]) -> None:
    self._ahead = None
    if self.reopen is None:
      self.iterator.set_state(state)
      return
    if set(state) != {"next_batch"}:
      raise ValueError(f"loader state {state!r}: expected {{'next_batch': k}} (a checkpoint "
                       "written by another version of lmscale_jax?)")
    self._next_batch = int(state["next_batch"])
    self._close_host()
    self.iterator = None  # rebuilt from _next_batch on the next pull

  def _close_host(self) -> None:
    if self.iterator is not None and hasattr(self.iterator, "close"):
      self.iterator.close()  # stops its worker processes now, not whenever it is collected

  def close(self) -> None:
    if self.reopen is not None:
      self._close_host()
    super().close()

  def __iter__(self) -> Iterator[dict[str, Any]]:
    return self
