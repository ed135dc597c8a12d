"""The Grain input pipeline: which records each process reads, in which order, as batches.

Owns the read plan (:func:`process_shards`: which shard files a process reads), the stream
order (shuffle, repeat, process slice) and the batches built from it (:func:`make_dataset`,
:func:`make_batch_loader`). Reading records is :mod:`lmscale_jax.store.records`, masking
:mod:`lmscale_jax.input.masking`, the shuffle's permutation
:func:`lmscale_jax.input.hashing.feistel_permute`, the transfer to devices
:mod:`lmscale_jax.input.prefetch`.

Semantics. The *global stream* is ``repeat(shuffle_e(records))``: epoch ``e`` visits every
record of the split once, in a permutation seeded by ``(data.seed, e)`` (train) or in file
order (eval). Global position ``p`` of the stream belongs to process ``p % process_count``;
a process's local batch ``b`` holds its local elements ``[b*lb, (b+1)*lb)`` with
``lb = train.batch_size // process_count``. That is the structure of
``source.seed(s).shuffle().repeat()[pi::pc].batch(lb, drop_remainder=True)``, with
:func:`~lmscale_jax.input.hashing.feistel_permute` as the per-epoch shuffle.

``data.shard_by_process=True`` (by-shard mode) instead gives process ``pi`` of ``pc`` only the
shard files ``pi, pi+pc, pi+2pc, …`` of each split and makes its stream local:
``repeat(shuffle_e(its records))`` (train; eval: its records in file order, wrapping); local
element ``l`` still has the globally unique masking key ``l*pc + pi``. Every split needs at
least ``pc`` shards. The trade-off: *interleaved* (the default) makes the global batch
sequence identical for any process count (the loss trajectory of 1 and 64 processes is the
same), but every process reads every shard, so every node needs the whole dataset on local
disk; *by-shard* lets a node stage only its processes' ``1/pc`` of the shards
(``lmscale stage --only-needed --plan by_shard``, ``staging.needed_shards``, which asks
:func:`process_shards`), but which records form a batch depends on the process count (and on
uneven shard sizes, epochs of different lengths per process), so runs with different process
counts see different batches, and a checkpoint resumes only with the same process count (as
in both modes).

Why the Grain graph is built over *batch indices* instead of per-record transformations
(measured on seq-512 records, 2-core Xeon): Grain's per-element chain (source -> shuffle ->
repeat -> slice -> map: every element a separate ``__getitem__`` through every stage) costs
~90-110 us per record before any masking, and ``ArrayRecordDataSource`` reads far slower than
a ``seek`` + ``read`` (see :mod:`lmscale_jax.store.records`). Here one Grain element is one batch:
``MapDataset.range(num_batches).map(BatchLoader)``. :class:`BatchLoader` computes the batch's
global positions with numpy, permutes them with a vectorised Feistel permutation (stateless,
O(batch) memory for any dataset size), reads each record with an O(1) ``seek`` + ``read``,
decodes the batch with one ``frombuffer`` and masks the whole batch at once: ~25 us of CPU per
sample in total. Grain still provides the worker processes (``mp_prefetch``), thread prefetch
(``ReadOptions``) and the checkpointable iterator state (the next batch index).

Consequently ``data.prefetch_buffer`` and ``data.read_threads`` count *batches* and *batch
builders* (per process: each ``mp_prefetch`` worker runs its own). Small values are right:
read_threads 1-2, prefetch_buffer 2-8; Grain's per-record defaults (16 threads, 500
elements) buffer 500 batches per worker and, on 2 cores with 2 workers, halved throughput.
"""

from __future__ import annotations

import functools
import os

import grain
import numpy as np
from absl import logging

from lmscale_jax import child_process
from lmscale_jax.config import checks as config_checks
from lmscale_jax.input import hashing, masking
from lmscale_jax.store import dataset, records

# Validation masks never depend on data.seed, so eval losses of runs with different training
# seeds are comparable.
EVAL_MASK_SEED = 20_240_601
# The train stream is effectively infinite; bounded so that global positions stay < 2**62
# (int64 / uint64 arithmetic never overflows).
_MAX_POSITION = 1 << 62


class BatchLoader:
  """Grain map: local batch index -> masked batch dict (see module docstring)."""

  def __init__(self, shard_records: records.ShardRecords, masker: masking.Masker, *,
               vocab_size: int, local_batch: int, process_index: int, process_count: int,
               shuffle_seed: int | None, mask_seed: int, local_stream: bool = False):
    self.records, self.masker, self.vocab_size = shard_records, masker, vocab_size
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
    epoch, in_epoch = np.divmod(positions, len(self.records))
    if self.shuffle_seed is None:
      return in_epoch
    return hashing.feistel_permute(in_epoch, len(self.records), self.shuffle_seed, epoch)

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


def process_shards(meta: dataset.DatasetMeta, split: str, process_index: int,
                   process_count: int, by_shard: bool) -> list[int] | None:
  """The read plan: indices of the shards of ``split`` that process ``process_index`` of
  ``process_count`` reads; None for all of them (interleaved mode). By-shard mode
  (``data.shard_by_process``): shards ``process_index::process_count``, which needs at least
  one shard per process. The one owner of that rule: ``staging.needed_shards`` (what
  ``lmscale stage --only-needed`` copies) asks it too."""
  if not by_shard:
    return None
  n_shards = len(meta.shard_paths(split))  # raises DatasetError for a split with zero shards
  if n_shards < process_count:
    raise dataset.DatasetError(
        f"{meta.path}: split {split!r} has {n_shards} shards for {process_count} processes: "
        "a by-shard split (data.shard_by_process=True) gives each process whole shards and "
        "needs at least one per process (re-prepare with a smaller --shard-size-mb, or set "
        "data.shard_by_process=False)")
  return list(range(process_index, n_shards, process_count))


def make_batch_loader(config, meta: dataset.DatasetMeta, split: str, *, train: bool,
                      process_index: int = 0, process_count: int = 1) -> BatchLoader:
  """The per-batch function behind :func:`make_dataset` (its ``positions``/``record_indices``
  expose the stream order, and ``records.paths`` the shard files it reads, e.g. for tests).
  ``meta``: ``DatasetMeta.load(config.data.path)``, loaded once by the caller."""
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index {process_index} not in [0, {process_count})")
  data = config.data
  local_batch = config_checks.check_batch(config.train.batch_size, processes=process_count)
  shards = process_shards(meta, split, process_index, process_count, data.shard_by_process)
  shard_records = records.ShardRecords(meta, split, shards)
  if len(shard_records) == 0:
    raise dataset.DatasetError(f"{meta.path}: split {split!r} has no records" + (
        f" in shards {shards} (process {process_index} of {process_count}, "
        "data.shard_by_process)" if shards is not None else ""))
  shard_records.set_on_corrupt(str(data.on_corrupt), meta.pad_id)
  masker = masking.Masker(meta.special_ids, meta.vocab_size, data.mask_prob,
                          data.max_predictions, meta.seq_len)
  return BatchLoader(
      shard_records, masker, vocab_size=meta.vocab_size, local_batch=local_batch,
      process_index=process_index, process_count=process_count,
      shuffle_seed=int(data.seed) if train else None,
      mask_seed=int(data.seed) if train else EVAL_MASK_SEED, local_stream=shards is not None)


def cap_workers(config, *, is_writer: bool = True) -> None:
  """``data.workers`` at most the CPUs this process may use (``child_process.usable_cpus``),
  with one warning: more Grain workers only take turns on them, and what a worker computes
  does not depend on how many there are (the loader's order and masks are keyed by position)."""
  cpus = child_process.usable_cpus()
  if int(config.data.workers) > cpus:
    if is_writer:
      logging.warning("data.workers=%d: this process may use %d CPU(s), so %d loader workers "
                      "run (the batches are the same for any number)",
                      int(config.data.workers), cpus, cpus)
    config.data.workers = cpus


def init_worker(parent: int, worker_index: int, worker_count: int) -> None:
  """Grain ``worker_init_fn`` (``parent``: the training process's pid, bound by
  :func:`make_dataset`): the signals (:func:`ignore_signals_in_worker`), and the worker ends
  with the training process however it ends (kill -9, the OOM killer: it lived on under ppid 1,
  with multiprocessing's resource tracker). By a watch of the parent's pid, not PDEATHSIG:
  Grain spawns its workers from a thread of its own that may end first
  (``child_process.watch_parent``)."""
  ignore_signals_in_worker(worker_index, worker_count)
  child_process.watch_parent(parent)


def ignore_signals_in_worker(worker_index: int, worker_count: int) -> None:
  """What a Grain worker ignores (:func:`init_worker`): the preemption signals
  (``preemption.ignore_in_worker``), and SIGINT: a terminal's Ctrl-C reaches the whole process
  group, and only the training process should report it (one line); it stops its workers when
  it leaves (``train``)."""
  import signal

  from lmscale_jax.cluster import preemption

  preemption.ignore_in_worker(worker_index, worker_count)
  signal.signal(signal.SIGINT, signal.SIG_IGN)


def eval_stream(config, meta: dataset.DatasetMeta, *, process_index: int = 0,
                process_count: int = 1) -> tuple[int, int]:
  """The evaluation stream's records ``n`` and rows per batch ``b`` (the global stream and
  global batch, or in by-shard mode this process's records and local batch): it fills
  ``n // b`` batches before its records repeat (it wraps around, see :func:`make_dataset`)."""
  loader = make_batch_loader(config, meta, "validation", train=False,
                             process_index=process_index, process_count=process_count)
  rows = loader.local_batch if loader.local_stream else loader.local_batch * process_count
  return len(loader.records), rows


def make_dataset(config, meta: dataset.DatasetMeta, split: str, *, train: bool,
                 process_index: int = 0, process_count: int = 1,
                 start_batch: int = 0) -> grain.IterDataset:
  """Per-process batches (dicts of numpy arrays, see docs/design.md "Loader").

  ``meta``: ``DatasetMeta.load(config.data.path)``, loaded once by the caller.
  ``train=True``: infinite, reshuffled each epoch, ``data.workers`` worker processes.
  ``train=False``: exactly ``train.eval_batches`` batches in file order (wrapping around a
  small split), fixed masking seed (``EVAL_MASK_SEED``), in-process; ``iter()`` it afresh for
  every evaluation so every evaluation sees identical batches.
  ``start_batch``: begin at this local batch index (a resume; see
  :class:`lmscale_jax.input.prefetch.DevicePrefetcher`).
  Iterators support ``get_state()``/``set_state()`` (Grain checkpointing; JSON-serialisable).
  """
  loader = make_batch_loader(config, meta, split, train=train, process_index=process_index,
                             process_count=process_count)
  global_batch = loader.local_batch * process_count
  num_batches = _MAX_POSITION // global_batch if train else int(config.train.eval_batches)
  if not 0 <= start_batch < num_batches:
    raise ValueError(f"start_batch {start_batch} not in [0, {num_batches})")
  data = config.data
  batches = grain.MapDataset.range(start_batch, num_batches).map(loader)
  iterable = batches.to_iter_dataset(grain.ReadOptions(
      num_threads=int(data.read_threads), prefetch_buffer_size=int(data.prefetch_buffer)))
  # Eval stays in-process: every evaluation iterates afresh, and worker processes would be
  # spawned (seconds each) for a few batches that threads build in well under a second.
  if train and data.workers > 0:
    iterable = iterable.mp_prefetch(grain.MultiprocessingOptions(num_workers=int(data.workers)),
                                    worker_init_fn=functools.partial(init_worker, os.getpid()))
  return iterable
