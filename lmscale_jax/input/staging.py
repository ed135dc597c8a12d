"""Copy a dataset directory from shared storage to node-local disk, verified, resumable.

Hundreds of nodes reading random records from one shared file system contend for it; each node
reading its own local copy does not (the paper's second finding). :func:`stage`:

* plans the files: the shards ``metadata.json`` lists (all, or with ``only_needed`` those the
  given processes will read, see :func:`needed_shards`), the small side files
  (``tokenizer.json`` …), and ``metadata.json`` itself, copied last;
* keeps a destination file that is already there with the size and sha256 ``metadata.json``
  gives (a rerun copies nothing); anything else is recopied. A file this staging copied or
  hashed before and whose (size, mtime, inode) has not changed since is not hashed again
  (``verify_all`` / ``--verify-all`` re-hashes everything, e.g. against silent disk errors);
* checks free space for what it will copy, then copies in parallel threads (file reads,
  writes and hashing release the GIL), hashing the bytes as they pass, into a temporary name
  (``.{file}.staging``), fsyncs, and renames only when the hash matches ``metadata.json``;
  a mismatch is retried once from the source, then is a "checksum mismatch at the source",
  unless the source's ``metadata.json`` changed since staging began (re-prepared or replaced
  mid-copy): that is its own error, and ``metadata.json`` is only committed, from the bytes
  planned with, while the source still has them;
* records its state in ``staging.json`` in the destination: ``copying`` while it runs,
  ``complete`` or ``failed`` (with the error) at the end. While copying, ``metadata.json`` is
  absent from the destination, so a crashed staging is never taken for a complete dataset;
* writes only into a destination of its own (``store/destination.py``'s rule, which
  ``lmscale prepare`` follows too): apart from the source (not it, not in it, not around it),
  and missing, empty, or its own earlier destination for this dataset (``staging.json`` names
  the source's content digest, or it holds that very dataset, or an unfinished staging:
  ``destination.staged_copy_of``). Another dataset, a file no lmscale tool wrote or a
  preparation's unfinished work there is one error line, before anything is written;
* holds an exclusive lock on the destination (``.stage.lock``, ``store/dir_lock``) from planning
  to the last state write: stagers started together on one node (an array job, a sweep) wait
  for the first (``lock_timeout``, ``data.stage_timeout``), then find everything verified and
  copy nothing. The kernel drops the lock when its holder exits, however it ends.

The copy itself (hashing the bytes as they pass, temp name, rename) is
``lmscale_jax/input/file_copy.py``; what training checks on a (staged) dataset directory before
reading it is ``lmscale_jax/input/dataset_checks.py``.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import os
import shutil
import socket
import sys
import threading
import time
from typing import Callable, Sequence

from lmscale_jax.config import defaults as config_defaults
from lmscale_jax.errors import UserError
from lmscale_jax.input import file_copy
from lmscale_jax.store import dataset, destination, file_io

STAGE_FILE = destination.STAGE_STATE
LOCK_FILE = destination.STAGE_LOCK
TMP_SUFFIX = file_copy.TMP_SUFFIX
# Space kept free beyond the bytes to copy: file system metadata, and the temp copy of a file
# that is being replaced coexists with the old one until the rename.
SPACE_MARGIN = 64 << 20
# Read plans: which shards a process reads (see needed_shards).
PLANS = ("interleaved", "by_shard")


class StagingError(UserError, RuntimeError):
  """Staging cannot proceed, or a dataset directory's staging is not usable."""


@dataclasses.dataclass(frozen=True)
class FileSpec:
  """A file to stage and the sha256 it must have: ``metadata.json``'s for a shard, the source
  file's own for a side file (``metadata.json`` lists no checksum for those)."""

  name: str
  bytes: int
  sha256: str


# --------------------------------------------------------------------------- planning
def needed_shards(meta: dataset.DatasetMeta, num_processes: int, process_ids: Sequence[int],
                  plan: str = "interleaved") -> dict[str, list[dict]]:
  """Per split, the shard entries of ``metadata.json`` that ``process_ids`` will read.

  The plans are the two modes of the loader in ``lmscale_jax/input/grain_pipeline.py``:

  ``interleaved`` (``data.shard_by_process=False``, the default): global stream position ``p``
  goes to process ``p % num_processes``, and the stream is a fresh permutation of *all* records
  of the split each epoch, so every process reads from every shard: all shards are needed, and
  node-local staging cannot copy less than the whole dataset.

  ``by_shard`` (``data.shard_by_process=True``): process ``i`` reads only the shards
  ``i, i + P, i + 2P, …`` of *every* split (train and validation), so a node needs only its
  processes' shards: the loader's own read plan, ``input.grain_pipeline.process_shards``, decides
  which.
  """
  # Imported here: the loader pulls in Grain, which staging's other paths do not need.
  from lmscale_jax.input import grain_pipeline as data

  if plan not in PLANS:
    raise StagingError(f"read plan {plan!r}: expected one of {PLANS}")
  if num_processes < 1:
    raise StagingError(f"--num-processes {num_processes}: expected >= 1")
  bad = [i for i in process_ids if not 0 <= i < num_processes]
  if bad or not process_ids:
    raise StagingError(f"--process-ids {list(process_ids)}: expected ids in "
                       f"[0, {num_processes})")
  out = {}
  for split, info in meta.splits.items():
    shards = list(info["shards"])
    if plan == "by_shard":
      try:
        read = {i for pid in process_ids
                for i in data.process_shards(meta, split, pid, num_processes, by_shard=True)}
      except dataset.DatasetError as e:
        raise StagingError(str(e)) from e
      shards = [s for i, s in enumerate(shards) if i in read]
    out[split] = shards
  return out


def side_files(src: str) -> list[str]:
  """Regular files of the dataset directory that are not shards, staging state or temps."""
  out = []
  for name in sorted(os.listdir(src)):
    if name in (dataset.METADATA, STAGE_FILE) or name.startswith(".") or ".array_record-" in name:
      continue
    if os.path.isfile(os.path.join(src, name)):
      out.append(name)
  return out


# --------------------------------------------------------------------------- state file
def read_state(directory: str) -> dict | None:
  """``directory/staging.json`` (None if it was never staged); an unreadable one counts as a
  failed staging."""
  path = os.path.join(directory, STAGE_FILE)
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    return {"status": "failed", "error": f"{path}: unreadable ({e})"}


def _write_state(directory: str, **state) -> None:
  file_io.atomic_write_json(os.path.join(directory, STAGE_FILE),
                            {"host": socket.gethostname(), "time": time.time(), **state})


# --------------------------------------------------------------------------- copying
def _check_writable(dest: str) -> None:
  try:
    os.makedirs(dest, exist_ok=True)
    probe = os.path.join(dest, f".write-test-{os.getpid()}{TMP_SUFFIX}")
    with open(probe, "wb") as f:
      f.write(b"x")
    os.unlink(probe)
  except OSError as e:
    raise StagingError(f"destination {dest} is not writable: {e.strerror or e} "
                       "(choose a node-local directory you can write, e.g. under /tmp or "
                       "$SLURM_TMPDIR)") from e


def human_bytes(size: float) -> str:
  """``1.0 MB``: decimal units, one decimal (whole bytes below 1 KB)."""
  for unit in ("B", "KB", "MB", "GB"):
    if size < 1000:
      return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
    size /= 1000
  return f"{size:.1f} TB"


def log_to_stderr(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def _metadata_bytes(src: str, meta: dataset.DatasetMeta) -> bytes:
  """The bytes of ``src/metadata.json`` that ``meta`` was parsed from (what staging plans with
  and commits)."""
  with open(os.path.join(src, dataset.METADATA), "rb") as f:
    data = f.read()
  if json.loads(data) != meta.raw:
    raise StagingError(f"the source dataset {src} changed while staging read its "
                       f"{dataset.METADATA}; rerun lmscale stage")
  return data


def _check_source_and_dest(src: str, dest: str, workers: int
                           ) -> tuple[dataset.DatasetMeta, str]:
  """The source's metadata and content digest (``destination.identity``), once source,
  destination and workers are known to be usable."""
  if not os.path.isdir(src):
    raise StagingError(f"staging source {src} is not a directory")
  if not os.path.exists(os.path.join(src, dataset.METADATA)):
    raise StagingError(f"staging source {src} has no {dataset.METADATA}: not a complete "
                       "lmscale_jax dataset (prepare it with lmscale prepare, or wait for "
                       "its preparation to finish)")
  try:
    meta = dataset.DatasetMeta.load(src)
  except dataset.DatasetError as e:
    raise StagingError(f"staging source: {e}") from e
  digest = destination.identity(src)
  if refused := destination.copy_refusal(src, dest, digest):
    raise StagingError(refused)  # before anything is written there
  _check_writable(dest)
  if workers < 1:
    raise StagingError(f"--workers {workers}: expected >= 1")
  return meta, digest


def _plan_files(meta: dataset.DatasetMeta, src: str, *, only_needed: bool, num_processes: int,
                process_ids: Sequence[int], plan: str, log: Callable[[str], None]
                ) -> list[FileSpec]:
  """The shards to stage (all, or those ``process_ids`` read) and the side files."""
  splits = (needed_shards(meta, num_processes, list(process_ids), plan) if only_needed
            else {split: list(info["shards"]) for split, info in meta.splits.items()})
  specs = [FileSpec(s["file"], int(s["bytes"]), s["sha256"])
           for shards in splits.values() for s in shards]
  if only_needed:
    total = sum(len(info["shards"]) for info in meta.splits.values())
    log(f"--only-needed ({plan}): {len(specs)} of {total} shards for processes "
        f"{list(process_ids)} of {num_processes}"
        + (" (the loader interleaves every shard over all processes: all are needed; "
           "data.shard_by_process=True with --plan by_shard needs 1/P)"
           if plan == "interleaved" else ""))
  for name in side_files(src):
    path = os.path.join(src, name)
    specs.append(FileSpec(name, os.path.getsize(path), file_copy.hash_file(path)))
  return specs


def _remove_temp_copies(dest: str) -> None:
  """Leftovers of an interrupted run: temp copies are never trusted."""
  for name in os.listdir(dest):
    if name.endswith(TMP_SUFFIX):
      os.unlink(os.path.join(dest, name))


def _find_good(dest: str, specs: list[FileSpec], recorded: dict, workers: int
               ) -> tuple[list[FileSpec], dict[str, list]]:
  """(the files still to copy, the record of those already good in ``dest``: name -> [size,
  mtime_ns, inode, sha256]). A file whose signature and hash equal ``recorded`` (an earlier
  staging's record) is not hashed again."""
  verified: dict[str, list] = {}
  lock = threading.Lock()

  def is_good(spec: FileSpec) -> bool:
    path = os.path.join(dest, spec.name)
    signature = file_copy.signature(path)
    if signature is None or signature[0] != spec.bytes:
      return False
    record = signature + [spec.sha256]
    if recorded.get(spec.name) != record and file_copy.hash_file(path) != spec.sha256:
      return False
    with lock:
      verified[spec.name] = record
    return True

  with cf.ThreadPoolExecutor(max(1, workers)) as pool:
    good = list(pool.map(is_good, specs))
  return [spec for spec, ok in zip(specs, good) if not ok], verified


def _check_space(dest: str, todo: list[FileSpec], only_needed: bool) -> None:
  todo_bytes = sum(spec.bytes for spec in todo)
  free = shutil.disk_usage(dest).free
  if todo_bytes + SPACE_MARGIN > free:
    raise StagingError(
        f"not enough space in {dest}: staging needs {human_bytes(todo_bytes)} for {len(todo)} "
        f"files (+{human_bytes(SPACE_MARGIN)} margin) but only {human_bytes(free)} is free; "
        "free space, choose another directory"
        + ("" if only_needed else ", or stage only this node's shards with --only-needed"))


def _check_source_unchanged(src: str, source_metadata: bytes) -> None:
  """Refuses to go on when ``src/metadata.json`` is no longer the one staging planned with:
  the dataset was re-prepared or replaced while it was being copied."""
  try:
    with open(os.path.join(src, dataset.METADATA), "rb") as f:
      now = f.read()
  except OSError as e:
    now = f"unreadable: {e}".encode()
  if now != source_metadata:
    raise StagingError(
        f"the source dataset {src} changed while it was being staged ({dataset.METADATA} "
        "differs from the one staging started with: re-prepared or replaced?); nothing "
        "half-copied is kept as complete: rerun lmscale stage to stage the new version")


def _copy_verified(src: str, dest: str, spec: FileSpec, progress: file_copy.Progress,
                   source_metadata: bytes) -> list:
  """Copies one file, once more if the bytes read do not hash right; returns its record."""
  source, target = os.path.join(src, spec.name), os.path.join(dest, spec.name)
  for _attempt in range(2):  # a second read tells a flaky read from a corrupt source
    digest = file_copy.copy_hashed(source, target, spec.sha256, spec.bytes, progress)
    if digest == spec.sha256:
      return file_copy.signature(target) + [digest]
  _check_source_unchanged(src, source_metadata)  # a replaced dataset is not a corrupt one
  raise StagingError(
      f"checksum mismatch at the source: {source} reads as sha256 {digest[:16]}… (twice), "
      f"metadata.json says {spec.sha256[:16]}…; the shared copy is corrupt (re-prepare the "
      "dataset or restore the file)")


def _copy_all(src: str, dest: str, todo: list[FileSpec], workers: int, progress: file_copy.Progress,
              verified: dict[str, list], source_metadata: bytes) -> None:
  """Copies ``todo`` in parallel, largest first, adding each copied file to ``verified``; the
  first failure cancels what has not started."""
  lock = threading.Lock()

  def copy(spec: FileSpec) -> None:
    record = _copy_verified(src, dest, spec, progress, source_metadata)
    with lock:
      verified[spec.name] = record

  with cf.ThreadPoolExecutor(max(1, workers)) as pool:
    futures = [pool.submit(copy, spec) for spec in sorted(todo, key=lambda s: -s.bytes)]
    try:
      for done in cf.as_completed(futures):
        done.result()
    except BaseException:
      for future in futures:
        future.cancel()
      raise


def _commit_metadata(src: str, dest: str, source_metadata: bytes) -> None:
  """``metadata.json`` last, atomically: its presence says every file is in place. The bytes
  are the ones staging planned with, and only while the source still has them: a source
  replaced mid-copy would otherwise pair new metadata with old shards."""
  _check_source_unchanged(src, source_metadata)
  file_io.atomic_write_bytes(os.path.join(dest, dataset.METADATA), source_metadata)


def _same_metadata(src: str, dest: str) -> bool:
  dst_meta = os.path.join(dest, dataset.METADATA)
  src_meta = os.path.join(src, dataset.METADATA)
  return os.path.exists(dst_meta) and file_copy.hash_file(dst_meta) == file_copy.hash_file(src_meta)


def stage(src: str, dest: str, *, workers: int = 8, only_needed: bool = False,
          num_processes: int = 1, process_ids: Sequence[int] = (0,), plan: str = "interleaved",
          verify_all: bool = False, progress: bool = True, lock_timeout: float | None = None,
          log: Callable[[str], None] | None = None) -> dict:
  """Stages ``src`` into ``dest`` (see the module docstring); returns a summary dict.

  Raises :class:`StagingError` (bad source, no space, unwritable destination, checksum
  mismatch at the source) after recording it in ``dest/staging.json``, or when another
  stager holds ``dest`` for longer than ``lock_timeout`` seconds (default
  ``data.stage_timeout``).
  """
  log = log or log_to_stderr
  if lock_timeout is None:
    lock_timeout = float(config_defaults.get_base_config().data.stage_timeout)
  src, dest = os.path.abspath(src), os.path.abspath(dest)
  meta, digest = _check_source_and_dest(src, dest, workers)
  try:
    with file_copy.dir_lock(dest, LOCK_FILE, lock_timeout, log, "staging into",
                            "--wait / data.stage_timeout"):
      return _stage_locked(src, dest, meta, digest, workers=workers, only_needed=only_needed,
                           num_processes=num_processes, process_ids=process_ids, plan=plan,
                           verify_all=verify_all, progress=progress, log=log)
  except (file_copy.LockTimeout, file_copy.LockUnusable) as e:
    raise StagingError(str(e)) from None


def _stage_locked(src: str, dest: str, meta: dataset.DatasetMeta, digest: str, *, workers: int,
                  only_needed: bool, num_processes: int, process_ids: Sequence[int], plan: str,
                  verify_all: bool, progress: bool, log: Callable[[str], None]) -> dict:
  """:func:`stage` once ``dest`` is locked."""
  started = time.perf_counter()
  source_metadata = _metadata_bytes(src, meta)
  specs = _plan_files(meta, src, only_needed=only_needed, num_processes=num_processes,
                      process_ids=process_ids, plan=plan, log=log)
  _remove_temp_copies(dest)
  state = read_state(dest) or {}
  # Files this stager copied or hashed earlier, by signature and hash: unchanged ones need no
  # re-hash (sha256 runs at ~200 MB/s per core without SHA instructions, so re-hashing a
  # large dataset at every job start would cost minutes). verify_all re-hashes everything.
  recorded = {} if verify_all else dict(state.get("verified") or {})
  todo, verified = _find_good(dest, specs, recorded, workers)
  kept = len(specs) - len(todo)
  todo_bytes = sum(spec.bytes for spec in todo)
  plan_desc = ({"plan": plan, "num_processes": num_processes, "process_ids": list(process_ids)}
               if only_needed else None)
  if (not todo and _same_metadata(src, dest) and state.get("status") == "complete"
      and state.get("only_needed") == plan_desc):
    if verified != state.get("verified") or state.get("source_digest") != digest:
      _write_state(dest, **{**state, "verified": verified, "source_digest": digest})
    secs = time.perf_counter() - started
    log(f"staged {dest}: all {len(specs)} files present and verified, nothing to copy "
        f"({secs:.1f} s)")
    return {"copied": 0, "kept": kept, "bytes_copied": 0, "seconds": secs, "mb_per_s": 0.0,
            "dest": dest}

  _check_space(dest, todo, only_needed)
  _write_state(dest, status="copying", source=src, source_digest=digest, only_needed=plan_desc,
               pid=os.getpid(), verified=verified)
  dst_meta = os.path.join(dest, dataset.METADATA)
  if os.path.exists(dst_meta):
    os.unlink(dst_meta)  # absent until every file is verified: never a half-staged dataset
  file_io.fsync_dir(dest)
  log(f"staging {src} -> {dest}: {len(todo)} files, {human_bytes(todo_bytes)} to copy, {kept} "
      f"already verified; {workers} workers")
  bar = file_copy.Progress(todo_bytes, progress, "staging")
  copy_started = time.perf_counter()
  try:
    _copy_all(src, dest, todo, workers, bar, verified, source_metadata)
    bar.close()
    copy_secs = time.perf_counter() - copy_started
    _commit_metadata(src, dest, source_metadata)
    _write_state(dest, status="complete", source=src, source_digest=digest,
                 only_needed=plan_desc, files=len(specs), bytes=sum(spec.bytes for spec in specs),
                 verified=verified)
  except BaseException as e:
    bar.close()
    try:
      _write_state(dest, status="failed", source=src, source_digest=digest,
                   only_needed=plan_desc, error=f"{type(e).__name__}: {e}", verified=verified)
    except OSError:
      pass  # the destination itself failed: the error below says so
    if isinstance(e, OSError):
      raise StagingError(f"staging {src} -> {dest} failed: {e}") from e
    raise
  secs = time.perf_counter() - started
  rate = todo_bytes / max(copy_secs, 1e-9) / 1e6
  log(f"staged {dest}: copied {len(todo)} files, {human_bytes(todo_bytes)} in {copy_secs:.1f} s "
      f"({rate:.0f} MB/s, sha256 verified); {kept} kept; total {secs:.1f} s")
  return {"copied": len(todo), "kept": kept, "bytes_copied": todo_bytes, "seconds": secs,
          "mb_per_s": rate, "dest": dest}


# --------------------------------------------------------------------------- per node
def stage_per_node(src: str, dest: str, *, workers: int, timeout_s: float,
                   log: Callable[[str], None] | None = None) -> None:
  """Inside a running job: the lowest-numbered process on each host stages ``src`` to
  ``dest``; the other processes of that host wait for it. Every process then learns every
  host's result, so a staging failure anywhere stops the whole job with the same message
  (instead of leaving the other nodes blocked in their first collective).
  """
  import jax

  from lmscale_jax.cluster import distributed

  host = socket.gethostname()
  hosts = distributed.allgather("stage/host", host)
  stager = min(p for p, h in enumerate(hosts) if h == host)
  me = jax.process_index()

  def run():
    if me == stager:
      stage(src, dest, workers=workers, progress=False, lock_timeout=timeout_s, log=log)

  # Waiting for the stagers is the completion marker: a key per stager in the coordinator's
  # key-value store (staging.json alone could be a stale "complete" from an earlier run).
  distributed.agree("staging", run, timeout_s=timeout_s)
