"""Random access to a split's records on disk, and what a record that cannot be read does.

Owns reading and decoding ArrayRecord shards for the loader: :class:`ShardRecords` maps record
indices (over a chosen subset of a split's shards) to ``int32 [B, S]`` token ids, and
``data.on_corrupt`` (:data:`ON_CORRUPT`): a record that cannot be read or decoded either raises
a :class:`~lmscale_jax.store.dataset.DatasetError` naming the shard file and record, or reads as an
all-[PAD] row reported to the caller.

Why one record at a time with ``seek(i); read()`` on a sequential-mode reader
(``max_parallelism:0``), measured on seq-512 records: ``ArrayRecordReader.read(indices)``
(what Grain's ``ArrayRecordDataSource`` calls) does O(records in the shard) bookkeeping per
call, ~350 us per call on a 64k-record, 64 MB shard of group_size 1, while seek+read is O(1),
~10 us.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
from absl import logging

from lmscale_jax.config.modes import ON_CORRUPT
from lmscale_jax.errors import ConfigError
from lmscale_jax.store import dataset, file_io


class _UnopenableShard:
  """Stands in for the reader of a shard that cannot be opened (``data.on_corrupt='skip'``)."""

  def seek(self, index: int):
    raise RuntimeError("the shard cannot be opened")


class ShardRecords:
  """Random access to a split's records, with errors that name the shard file.

  One record at a time with ``seek(i); read()`` (see the module docstring). A reader is
  stateful (seek position), so each shard's reader is guarded by a lock for the
  ``ReadOptions`` threads that call the loader concurrently. Picklable: readers are opened
  lazily in whichever process reads (Grain workers).

  ``shards`` (indices into the split's shard list, default all) selects the shard files this
  instance reads (by-shard mode); record indices then run over those shards' records only.
  """

  def __init__(self, meta: dataset.DatasetMeta, split: str, shards=None):
    paths = meta.shard_paths(split)  # raises DatasetError for a split with zero shards
    counts = np.array([s["records"] for s in meta.splits[split]["shards"]], np.int64)
    sizes = [s.get("bytes") for s in meta.splits[split]["shards"]]
    self.shards = list(range(len(paths))) if shards is None else [int(i) for i in shards]
    if not self.shards or not all(0 <= i < len(paths) for i in self.shards):
      raise ValueError(f"shards {self.shards}: expected a non-empty subset of the "
                       f"{len(paths)} shards of split {split!r}")
    self.paths = [paths[i] for i in self.shards]
    self.counts = counts[self.shards]
    self.sizes = [sizes[i] for i in self.shards]  # metadata.json's, to say why one fails
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
      raise ConfigError(f"data.on_corrupt {mode!r}: expected one of {ON_CORRUPT}")
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
      if kind := file_io.not_regular(path):  # a FIFO would block the open forever
        return self._unopenable(shard, f"{path} is {kind}, not an ArrayRecord shard file")
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
        return self._unopenable(
            shard, f"{path}: cannot open ArrayRecord shard: {self._why(shard, e)}", e)
      if n != self.counts[shard]:
        return self._unopenable(
            shard, f"{path}: {n} records, metadata.json says {self.counts[shard]}")
      self._readers[shard] = reader
      return reader

  def _why(self, shard: int, error: Exception) -> str:
    """The reason a shard cannot be opened: the reader's, and its size against metadata.json's
    when they differ (the reader says nothing at all for a file cut at a block boundary)."""
    reason = file_io.error_reason(error)
    try:
      size = os.path.getsize(self.paths[shard])
    except OSError:
      return reason
    want = self.sizes[shard]
    if want is not None and size != want:
      reason += f"; the file has {size} bytes, metadata.json says {want} (cut short or replaced)"
    return reason

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
    for row, shard in enumerate(shards.tolist()):
      if self._readers[shard] is None:
        self._open(shard)
      with self._locks[shard]:
        reader = self._readers[shard]  # under the lock: skip mode replaces a failed reader
        try:
          reader.seek(local[row])
          out.append(reader.read())
        except Exception as e:  # corrupt chunk (hash mismatch, bad compression, ...)
          out.append(self._unreadable(shard, reader, int(indices[row]), e))
          if bad is not None:
            bad.append(row)
    return out

  def _unreadable(self, shard: int, reader, index: int, error: Exception) -> bytes:
    """Reading split record ``index`` failed (the caller holds the shard's lock). Error mode:
    raises DatasetError naming it. Skip mode: warns once, returns the all-[PAD] record."""
    message = f"{self.where(index)}: unreadable (corrupt shard?): {file_io.error_reason(error)}"
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
      raise dataset.DatasetError(message) from error
    if not unopenable:
      self._skip(index, message)
    return self._pad_record

  def decode(self, records: list[bytes], indices: np.ndarray, vocab_size: int,
             bad: list[int] | None = None) -> np.ndarray:
    """Records -> int32 [B, S]; one ``frombuffer`` for the batch, errors name file/record.
    Skip mode: a malformed record or one with a token id >= vocab_size becomes an all-[PAD]
    row, appended to ``bad``."""
    prefix = dataset.record_prefix(self.seq_len)
    record_bytes = len(prefix) + 2 * self.seq_len
    buf = b"".join(records)
    malformed = self._malformed_rows(records, buf, prefix)
    if malformed:
      rejected = [(row, self._decode_error(records[row], int(indices[row])))
                  for row in malformed]
      return self._reject(records, indices, vocab_size, bad, rejected)
    ids = np.ndarray((len(records), self.seq_len), "<u2", buffer=buf, offset=len(prefix),
                     strides=(record_bytes, 2))
    if int(ids.max()) >= vocab_size:
      return self._reject(records, indices, vocab_size, bad,
                          self._out_of_vocab(ids, indices, vocab_size))
    return ids.astype(np.int32)

  def _malformed_rows(self, records: list[bytes], buf: bytes, prefix: bytes) -> list[int]:
    """Rows whose record is not ``prefix`` + ``seq_len`` uint16s: one vectorised check of
    the whole batch (``buf`` is the records joined) on the good path."""
    record_bytes = len(prefix) + 2 * self.seq_len
    if len(buf) != record_bytes * len(records):
      return [row for row, record in enumerate(records) if len(record) != record_bytes]
    raw = np.frombuffer(buf, np.uint8).reshape(len(records), record_bytes)
    ok = (raw[:, :len(prefix)] == np.frombuffer(prefix, np.uint8)).all(axis=1)
    return [] if ok.all() else np.flatnonzero(~ok).tolist()

  def _decode_error(self, record: bytes, index: int) -> dataset.DatasetError:
    """decode_record's DatasetError for a malformed record (it names what is wrong)."""
    try:
      dataset.decode_record(record, self.seq_len, where=self.where(index))
    except dataset.DatasetError as e:
      return e
    raise AssertionError(f"decode_record accepted {self.where(index)}, which the batch "
                         "check rejected")

  def _out_of_vocab(self, ids: np.ndarray, indices: np.ndarray, vocab_size: int):
    """[(row, DatasetError)] for the rows holding a token id >= vocab_size."""
    over = ids >= vocab_size
    rejected = []
    for row in np.flatnonzero(over.any(axis=1)).tolist():
      col = int(np.argmax(over[row]))
      rejected.append((row, dataset.DatasetError(
          f"{self.where(int(indices[row]))}: token id {int(ids[row, col])} at position {col} "
          f">= vocab_size {vocab_size} (dataset prepared with another tokenizer?)")))
    return rejected

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


# --------------------------------------------------------------------------- statistics
def unigram_entropy(meta: dataset.DatasetMeta, max_records: int = 20_000,
                    on_corrupt: str = "error") -> float:
  """Entropy (nats) of the training split's token frequencies, specials excluded, over its
  first ``max_records`` records.

  The loss of a model that ignores context and predicts the unigram distribution: an MLM must
  get well below it to have learned anything. Read through the loader's reader
  (:class:`ShardRecords`), so a truncated, renamed or corrupt shard is the loader's one
  DatasetError naming the shard, and ``on_corrupt="skip"`` (``data.on_corrupt``) skips what
  the loader would skip. NaN if no record could be read.
  """
  reader = ShardRecords(meta, "train")
  reader.set_on_corrupt(on_corrupt, meta.pad_id)
  counts = np.zeros(meta.vocab_size, np.int64)
  n = min(max_records, len(reader))
  for first in range(0, n, 1024):
    indices = np.arange(first, min(n, first + 1024), dtype=np.int64)
    bad: list[int] = []
    ids = reader.decode(reader.read(indices, bad), indices, meta.vocab_size, bad)
    ids = np.delete(ids, sorted(set(bad)), axis=0)
    counts += np.bincount(ids.ravel(), minlength=meta.vocab_size)
  counts[list(meta.special_ids.values())] = 0
  if not counts.sum():
    return float("nan")
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log(p)).sum())
