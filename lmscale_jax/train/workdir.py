"""The run directory (``--workdir``) outside its checkpoints and its record: one run at a time
(``.lock``: :func:`lock_workdir`, :func:`holding`), what may sit under a run's names
(:func:`check_entries`), ``run_state.json``. The record, ``config.json``, and the resume rules:
``train/run_record.py``.
"""

from __future__ import annotations

import contextlib
import os

from lmscale_jax.cluster import run_state
from lmscale_jax.errors import UserError
from lmscale_jax.store import dir_lock, file_io
from lmscale_jax.train.checkpoint import step_dir

RUN_CONFIG = "config.json"  # the run's record (train/run_record.py)
LOCK_FILE = ".lock"
# What a run keeps in its workdir, by kind: anything else under one of these names (a directory
# where a file goes, a file where a directory goes, a FIFO) is refused before the run starts,
# instead of a traceback wherever the run first touches it.
_ENTRIES = {RUN_CONFIG: "file", "metrics.jsonl": "file", run_state.FILE: "file",
            "checkpoints": "directory", "tensorboard": "directory"}


def check_entries(workdir: str) -> None:
  """One line naming the first entry of ``workdir`` that is not of its kind (``_ENTRIES``)."""
  for name, kind in _ENTRIES.items():
    path = os.path.join(workdir, name)
    if not os.path.lexists(path):
      continue
    if (os.path.isdir(path) if kind == "directory" else os.path.isfile(path)):
      continue
    raise WorkdirError(f"{path} is {file_io.entry_kind(path)}, but a run keeps a {kind} "
                       "there: move it away, or give another --workdir")


class WorkdirError(UserError, ValueError):
  """``--workdir`` cannot be used: it is a file, below one, or not writable."""


class WorkdirBusy(UserError, RuntimeError):
  """Another run holds ``workdir/.lock``."""


# The workdirs this process holds: real path -> the open lock file (the lock lives as long as
# that file description, i.e. until release or process exit, even a kill -9).
_held: dict[str, int] = {}
_made: set[str] = set()  # the workdirs lock_workdir created (a run that wrote nothing removes them)


def make_workdir(workdir: str) -> None:
  """Creates ``workdir`` (and parents), or one line saying why it cannot be one."""
  try:
    os.makedirs(workdir, exist_ok=True)
  except FileExistsError:
    raise WorkdirError(f"--workdir {workdir} is a file; expected a directory (give a new "
                       "or existing directory)") from None
  except NotADirectoryError:
    parent = os.path.abspath(workdir)
    while parent != os.path.dirname(parent) and not os.path.exists(parent):
      parent = os.path.dirname(parent)
    raise WorkdirError(f"--workdir {workdir} is below {parent}, which is a file, not a "
                       "directory; give a directory path") from None
  except PermissionError as e:
    raise WorkdirError(f"--workdir {workdir}: cannot create it ({e.strerror}: "
                       f"{e.filename}); give a writable directory") from None


def lock_workdir(workdir: str) -> bool:
  """Takes ``workdir/.lock`` (``store/dir_lock``: ``fcntl.flock``, exclusive) for this process,
  before anything in the workdir is touched: two runs on one workdir would delete each other's
  in-flight checkpoints (Orbax cleans tmp directories at start-up) and mix their metrics.
  Returns True if this call took it, False if this process already holds it. Raises
  :class:`WorkdirBusy` naming the holder's pid and host (written into the lock file), touching
  nothing else.

  A multi-process job: process 0 takes it for everyone (``main`` tells the others through
  ``distributed.agree``). ``flock`` is released by the kernel when the holder exits, however
  it ends, so a crashed run never leaves a stale lock; it works on local disks and on NFSv4
  (where Linux emulates it with a POSIX lock on the server).
  """
  key = os.path.realpath(workdir)
  if key in _held:
    return False
  if not os.path.lexists(workdir):
    _made.add(key)
  make_workdir(workdir)
  path = os.path.join(workdir, LOCK_FILE)
  try:
    _held[key] = dir_lock.acquire(path)
  except dir_lock.Busy as e:
    raise WorkdirBusy(
        f"--workdir {workdir} is in use by another run ({e.holder}; lock "
        f"{path}): wait for it to end or stop it, or give this run another --workdir") from None
  except dir_lock.Unusable as e:
    if e.step == "open":
      raise WorkdirError(f"--workdir {workdir}: cannot open {path} ({e.strerror}); give a "
                         "writable directory") from None
    raise WorkdirError(f"--workdir {workdir}: cannot lock {path} ({e.strerror}); the file "
                       "system may not support flock: use a local or NFSv4 directory") from None
  return True


@contextlib.contextmanager
def holding(workdir: str):
  """The workdir's lock (:func:`lock_workdir`) held for the block by a single process (a
  library caller: tests, tools), released after it (a process's exit releases it anyway);
  yields whether this call took it. A process of a multi-process job holds nothing here: its
  start-up took the lock for the job (:func:`holding_for_job`)."""
  import jax  # here: this module is read by tools that never start a runtime

  took = jax.process_count() == 1 and lock_workdir(workdir)
  try:
    yield took
  finally:
    if took:
      unlock_workdir(workdir)


@contextlib.contextmanager
def holding_for_job(workdir: str):
  """The lock for every process of a run's job (``train/startup``): process 0 takes it, the
  others learn its outcome (``distributed.agree``); released after the block, as
  :func:`holding`'s."""
  import jax

  from lmscale_jax.cluster import distributed

  took = bool(distributed.agree("workdir lock", lambda: lock_workdir(workdir)
                                if jax.process_index() == 0 else None))
  try:
    yield took
  finally:
    if took:
      unlock_workdir(workdir)


def unlock_workdir(workdir: str) -> None:
  """Releases a lock :func:`lock_workdir` took. The file stays, as a record of the last run's
  holder, unless the run left nothing else: a run refused before it wrote anything (no
  dataset, a bad one) leaves the workdir as it found it, and removes it if it made it (it left
  a lone ``.lock``)."""
  key = os.path.realpath(workdir)
  fd = _held.pop(key, None)
  made = key in _made
  _made.discard(key)
  if fd is None:
    return
  try:
    untouched = os.listdir(workdir) == [LOCK_FILE]
  except OSError:
    untouched = False
  dir_lock.release(fd, remove=os.path.join(workdir, LOCK_FILE) if untouched else "")
  if untouched and made:
    try:
      os.rmdir(workdir)
    except OSError:  # something appeared meanwhile: it stays
      pass


RUN_STATE = run_state.FILE


def write_run_state(workdir: str, state: str, step: int, total_steps: int) -> None:
  """``workdir/run_state.json``: "running", or how the last run ended ("finished" or
  "preempted"), with the step reached and the Slurm job id and restart count of the
  allocation (``lmscale_jax/cluster/run_state.py``), so a job script can decide to requeue itself
  (launch/slurm.sbatch) without parsing logs; a crash leaves "running"."""
  file_io.atomic_write_json(os.path.join(workdir, RUN_STATE), run_state.record(
      state, step, total_steps, step_dir(workdir, step)))
