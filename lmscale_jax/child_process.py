"""Processes we start end with the process that started them, however it ends (kill -9, the OOM
killer, a crash): an orphan is adopted by init and lives on, blocked on a pipe it holds itself,
and keeps multiprocessing's resource tracker waiting on its pipe too. Seen: the preparation
pool's workers after a kill -9 of prepare_binary.py, Grain's two ``mp_prefetch`` workers after
one of a training run with ``data.workers=2``, a sweep's running point after one of the sweep;
all under ppid 1, for good.

Two mechanisms, for two kinds of child (the parent passes its pid; a child that finds another
parent, init or a subreaper, when it arms itself is an orphan already and exits 1 at once):

* :func:`die_with_parent`: the kernel signals the child (``PR_SET_PDEATHSIG``) the moment its
  parent ends. The signal comes when the parent's *thread* that started the child ends, not
  its process: only for children started from a thread that outlives them (the preparation
  pool: its workers spawn from the thread inside the pool's ``with``; a sweep's point: started
  and waited for in one call). Where prctl is missing (not Linux) a thread watches instead.
* :func:`watch_parent`: a thread in the child polls its parent's pid, for children started
  from a thread that is not ours. Grain spawns each ``mp_prefetch`` worker from a prefetch
  thread of its own, which ends while the worker is still wanted: on a ``set_state`` (what
  ``grain.checkpoint`` restores do), measured with PDEATHSIG armed in ``worker_init_fn``: both
  workers SIGKILLed as the thread ended, and the next batch never came (nothing for 20 s).
  The poll is one ``getppid`` a second: nothing to the worker, and it ends within a second.
"""

from __future__ import annotations

import os
import signal
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
WATCH_EVERY_S = 1.0


def _find_prctl():
  try:
    import ctypes  # numpy imports it anyway: nothing to a worker's start

    return ctypes.CDLL(None, use_errno=True).prctl
  except (OSError, AttributeError):  # not Linux
    return None


# Found here, in the parent, not after a fork: a ``preexec_fn`` runs between fork and exec,
# where loading a library may wait forever on a lock another thread held at the fork.
_PRCTL = _find_prctl()


def die_with_parent(parent: int, sig: int = signal.SIGKILL, *, watch: bool = True,
                    orphan_status: int = 1) -> None:
  """``sig`` to this process when ``parent`` ends (see the module docstring: the thread that
  started this process must outlive it). Without prctl a thread watches the parent, unless
  ``watch`` is False (a ``preexec_fn``, whose threads would not survive the exec; a forked
  child that runs on without one). Already orphaned: exits ``orphan_status`` at once."""
  armed = _PRCTL is not None and _PRCTL(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
  if os.getppid() != parent:  # it ended before prctl: no signal will come
    os._exit(orphan_status)
  if not armed and watch:
    watch_parent(parent)


def watch_parent(parent: int, every_s: float = WATCH_EVERY_S) -> None:
  """Exits this process (status 1) within ``every_s`` of ``parent``'s end, from a daemon
  thread: for a child whose starting thread may end before it (Grain's workers)."""
  if os.getppid() != parent:
    os._exit(1)
  threading.Thread(target=_watch, args=(parent, every_s), daemon=True,
                   name="watch-parent").start()


def _watch(parent: int, every_s: float) -> None:
  while os.getppid() == parent:
    time.sleep(every_s)
  os._exit(1)


def usable_cpus() -> int:
  """The CPUs this process may run on (``os.sched_getaffinity``: a container's, taskset's or
  Slurm's share, not the machine's): more worker processes than these only take turns on them
  (``prepare_binary.py --workers 1000`` on 2 cores spawned 999 interpreters: 54 s for a 2 s
  job)."""
  cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return cpus or 1


def stop_group(proc, grace_s: float = 30.0) -> int:
  """Ends a child started with ``start_new_session=True`` and what it started (a server and its
  workers share its process group): SIGTERM to the group, so each may leave cleanly, SIGKILL
  after ``grace_s``. Returns the child's exit status."""
  import subprocess

  for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
    if proc.poll() is not None:
      break
    try:
      os.killpg(proc.pid, sig)
      return proc.wait(timeout=wait)
    except subprocess.TimeoutExpired:
      continue
    except ProcessLookupError:  # the group ended between the poll and the signal
      break
  return proc.wait()
