"""The process pool of data preparation: an ordered, bounded map (output identical for any
number of workers)."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import importlib
import itertools
import multiprocessing
import os
import signal
import sys
import threading

from lmscale_jax import child_process
from lmscale_jax.errors import PrepareError

_claims = None  # a spawned worker's view of the pool's claim slots (_Claims)
# What only the parent reacts to (see _worker_init), blocked while a worker is spawned.
PARENT_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def _worker_init(claims, parent: int) -> None:
  global _claims
  _claims = claims
  # Ctrl-C reaches the whole process group, and so does the SIGTERM of `timeout`, systemd or a
  # batch system: only the parent reacts (one line, exit 130 or 143) and stops the workers. A
  # worker's KeyboardInterrupt would print a traceback per worker, and a worker that died of
  # SIGTERM first made the parent's line "a worker process died".
  for sig in PARENT_SIGNALS:
    signal.signal(sig, signal.SIG_IGN)
  # An orphan waits forever on its task queue, whose writing end it holds itself. The workers
  # spawn from the thread that calls submit (3.11's ``_adjust_process_count``), and ordered_map
  # submits their first tasks as it starts: that thread is the one inside the pool's ``with``,
  # which outlives the pool, as PDEATHSIG needs.
  child_process.die_with_parent(parent)


def usable_workers(requested: int) -> int:
  """The pool size for ``--workers requested`` (0: all): at most the CPUs this process may run
  on (``child_process.usable_cpus``); the output is the same for any number, so the cap
  changes nothing in it."""
  cpus = child_process.usable_cpus()
  if requested > cpus:
    many = "s" if cpus > 1 else ""
    print(f"--workers {requested}: this process may use {cpus} CPU{many}, so {cpus} worker{many} "
          "run (the output is the same for any number)", file=sys.stderr)
  return min(requested, cpus) if requested else cpus


class _Claims:
  """Who runs each queued task: a spawned worker, or the parent when it would otherwise wait.
  Tasks are numbered in submission order (``seq``); slot ``seq % len`` holds ``2·seq + who``
  (0: a worker, 1: the parent) of the latest claim. ``Future.cancel`` would do without this,
  but on 3.11 a worker dying while a cancelled task is still queued makes the executor's
  thread raise InvalidStateError, a traceback on top of the run's one line (seen)."""

  def __init__(self, ctx, size: int):
    self.slots = ctx.Array("q", [-2] * size)  # -2: claimed by nobody (as if seq -1)

  def claim(self, seq: int, who: int) -> bool:
    """True when ``who`` gets task ``seq``: nobody claimed it, nor a later one in its slot (a
    later one there means the parent took ``seq`` and its slot moved on)."""
    slots = self.slots
    with slots.get_lock():
      held = slots[seq % len(slots)]
      if held // 2 >= seq:
        return False
      slots[seq % len(slots)] = 2 * seq + who
      return True


def _preload(modules: tuple[str, ...]) -> None:
  """Each worker's first task: submitted when the pool starts, so it spawns the worker at once
  (ProcessPoolExecutor spawns on submit) and the worker imports what its tasks need meanwhile.
  Also this process's ``imports_here``."""
  for name in modules:
    try:
      importlib.import_module(name)
    except ImportError:  # optional (the compiled backend's capstone): a task that needs it says so
      pass


class _Task:
  """A queued task: a worker runs ``fn(item)`` unless the parent claimed it first."""

  def __init__(self, fn, item, seq: int):
    self.fn, self.item, self.seq = fn, item, seq

  def __call__(self):
    return self.fn(self.item) if _claims.claim(self.seq, 0) else None


class _Ran:
  """A task the parent ran: its result, or the exception it raised (raised in the task's
  turn, so a run reports the first error in input order whoever ran the task)."""

  def __init__(self, fn, item):
    self.error = None
    try:
      self.value = fn(item)
    except Exception as e:  # noqa: BLE001  (KeyboardInterrupt goes straight up)
      self.error = e

  def result(self):
    if self.error is not None:
      raise self.error
    return self.value


@contextlib.contextmanager
def _signals_blocked():
  """A submit may spawn a worker (fork + exec), which keeps the blocked signal mask until
  ``_worker_init`` ignores PARENT_SIGNALS: a Ctrl-C while it imports would otherwise give
  tracebacks, a SIGTERM a dead worker. Blocked, not ignored: the parent's Ctrl-C meanwhile is
  never lost (another thread takes it at once, or it stays pending until the submit returns);
  ignoring it lost it: a run Ctrl-C'd as pass 2's first tasks were submitted went on to the
  end, exit 0."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  old = signal.pthread_sigmask(signal.SIG_BLOCK, PARENT_SIGNALS)
  try:
    yield
  finally:
    signal.pthread_sigmask(signal.SIG_SETMASK, old)


# What the spawned workers' environment adds to this one's (where it does not set them): their
# tasks never call BLAS, and numpy's OpenBLAS starts a thread per core as it is imported: 0.18
# CPU-s of a worker's ~0.3 s start-up against 0.10 with one (``import numpy``, measured).
WORKER_ENVIRONMENT = {"OPENBLAS_NUM_THREADS": "1"}


@contextlib.contextmanager
def _spawn_environment():
  """Holds WORKER_ENVIRONMENT in os.environ while workers are spawned (spawn takes no
  environment of its own; a spawned process copies this one's)."""
  added = {k: v for k, v in WORKER_ENVIRONMENT.items() if k not in os.environ}
  os.environ.update(added)
  try:
    yield
  finally:
    for k in added:
      os.environ.pop(k, None)


def _stop_workers(ex: concurrent.futures.ProcessPoolExecutor) -> None:
  # ProcessPoolExecutor has no public way to do this before 3.14. SIGKILL: they ignore SIGTERM.
  for p in list((getattr(ex, "_processes", None) or {}).values()):
    p.kill()


# Tasks queued per worker (the parent counted). Results are consumed in order, so a long task
# (an 8 MB part of a big library) holds back the submission of the ones after it and the others
# wait. Measured, pass 1 of 21 MB of code at two workers: 1.94–2.21 s with 2, 1.69–1.72 s with
# 8; and with the parent working (a task it runs submits nothing meanwhile) 8 per spawned
# worker left it idle: 2 workers, 6 runs each, 3.48 s mean with 8 queued, 3.24 s with 16.
IN_FLIGHT = 8


@contextlib.contextmanager
def ordered_map(workers: int, preload: tuple[str, ...] = (), imports_here: tuple[str, ...] = ()):
  """An ordered, bounded map over tasks in ``workers`` processes: this one and ``workers - 1``
  spawned ones (in-process alone for one worker). A task that needs a worker set up does it on
  first use (``tokenize_pack.ensure_worker``): one pool serves every pass of a preparation.
  The spawned processes start at once and import the modules named in ``preload``; this one
  imports ``imports_here`` (what its own later steps need) once the first map has queued its
  first tasks, so the spawned ones find work as they finish starting (importing before the
  first map left a spawned worker idle ~0.15 s, measured).

  This process runs a queued task itself whenever it would otherwise wait for the oldest one
  (while the spawned ones start: ~0.3 s of imports; between its own serial steps: duplicate
  checks, the tokenizer), so N workers are N busy processes on N cores, not N and a parent that
  mostly waits (2 workers, 6 runs each: 3.13 s mean, 3.37 s before). At most ``IN_FLIGHT ×
  workers`` tasks are queued, so results never pile up here (they are small: workers write
  their output to files). A worker that dies (killed, out of memory) ends the run with an error
  instead of the endless wait of ``multiprocessing.Pool``, and the workers end with this
  process however it ends (``child_process.die_with_parent``).
  """
  if workers <= 1:
    _preload(imports_here)
    yield map
    return
  # spawn, not fork: the parent may hold threads (tokenizers, tqdm) that fork would copy.
  ctx = multiprocessing.get_context("spawn")
  window = IN_FLIGHT * workers
  claims = _Claims(ctx, 4 * window)  # > the tasks ever queued at once (one window)
  ex = concurrent.futures.ProcessPoolExecutor(workers - 1, mp_context=ctx,
                                              initializer=_worker_init,
                                              initargs=(claims, os.getpid()))
  numbers = itertools.count()  # task numbers, across every map of the pool
  later = [imports_here]  # imported by the first map, once it has queued tasks
  with _signals_blocked(), _spawn_environment():  # spawns every worker
    for _ in range(workers - 1):
      ex.submit(_preload, preload)

  def ordered(fn, items):
    items, end = iter(items), object()
    pending = collections.deque()  # [future or _Ran, item, seq], in input order
    queued = 0  # the futures among them

    def run_one_here() -> bool:
      # The earliest queued task no worker has started yet.
      for entry in pending:
        if isinstance(entry[0], concurrent.futures.Future) and not entry[0].done() and \
            claims.claim(entry[2], 1):
          entry[0], entry[1] = _Ran(fn, entry[1]), None
          return True
      return False

    try:
      while True:
        while queued < window and (item := next(items, end)) is not end:
          seq = next(numbers)
          with _signals_blocked():  # any submit may spawn a worker
            pending.append([ex.submit(_Task(fn, item, seq)), item, seq])
          queued += 1
        if later:
          _preload(later.pop())
        if not pending:
          return
        head = pending[0][0]
        waits = isinstance(head, concurrent.futures.Future)
        if waits and not head.done() and run_one_here():  # instead of waiting
          queued -= 1  # one future less: the task it stood for ran here
          continue
        pending.popleft()
        queued -= waits
        yield head.result()
    except concurrent.futures.process.BrokenProcessPool as e:
      raise PrepareError(f"a worker process died ({e}); rerun to resume") from None
    finally:  # a map left early (an error, Ctrl-C): its queued tasks are skipped, not run
      for f, _, seq in pending:
        if isinstance(f, concurrent.futures.Future):
          claims.claim(seq, 1)

  try:
    yield ordered
  finally:
    # Stopped, not waited for: every result the run used has arrived (its files written), and
    # on an error or Ctrl-C the tasks still running may take seconds each. Their normal exit,
    # the teardown of what they imported, was 0.06 s serial at the end of every run.
    _stop_workers(ex)
    ex.shutdown(wait=True, cancel_futures=True)
