"""The process pool of data preparation: an ordered, bounded map (output identical for any
number of workers)."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import multiprocessing
import signal
import threading

from lmscale_jax.errors import PrepareError


def _worker_init() -> None:
  # Ctrl-C reaches the whole process group: only the parent reacts (one line, exit 130); a
  # worker's KeyboardInterrupt would print a traceback per worker.
  signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def _sigint_blocked():
  """A submit may spawn a worker (fork + exec), which keeps the blocked signal mask until
  ``_worker_init`` ignores SIGINT: a Ctrl-C while it imports would otherwise give tracebacks.
  Blocked, not ignored: the parent's Ctrl-C meanwhile is never lost (another thread takes it at
  once, or it stays pending until the submit returns); ignoring it lost it: a run Ctrl-C'd as
  pass 2's first tasks were submitted went on to the end, exit 0."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
  try:
    yield
  finally:
    signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _stop_workers(ex: concurrent.futures.ProcessPoolExecutor) -> None:
  # The run is ending (Ctrl-C, a bad input): don't wait for the tasks still running, which may
  # take many seconds each. ProcessPoolExecutor has no public way to do this before 3.14.
  for p in list((getattr(ex, "_processes", None) or {}).values()):
    p.terminate()


# Tasks in flight per worker. Results are consumed in order, so a long task (an 8 MB part of a
# big library) holds back the submission of the ones after it and the other workers wait.
# Measured, pass 1 of 21 MB of code at two workers: 1.94–2.21 s with 2, 1.69–1.72 s with 8.
IN_FLIGHT = 8


@contextlib.contextmanager
def ordered_map(workers: int):
  """An ordered, bounded map over tasks: a process pool, or in-process for one worker. A task
  that needs a worker set up does it on first use (``tokenize_pack.ensure_worker``): one pool
  serves every pass of a preparation.

  At most ``IN_FLIGHT × workers`` tasks are in flight, so results never pile up in the parent
  (they are small: workers write their output to files). A worker that dies (killed, out of
  memory) ends the run with an error instead of the endless wait of ``multiprocessing.Pool``.
  """
  if workers <= 1:
    yield map
    return
  # spawn, not fork: the parent may hold threads (tokenizers, tqdm) that fork would copy.
  ctx = multiprocessing.get_context("spawn")
  ex = concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init)

  def ordered(fn, items):
    pending = collections.deque()
    try:
      for item in items:
        with _sigint_blocked():  # any submit may spawn a worker
          pending.append(ex.submit(fn, item))
        if len(pending) >= IN_FLIGHT * workers:
          yield pending.popleft().result()
      while pending:
        yield pending.popleft().result()
    except concurrent.futures.process.BrokenProcessPool as e:
      raise PrepareError(f"a worker process died ({e}); rerun to resume") from None
    finally:
      for f in pending:
        f.cancel()

  try:
    yield ordered
  except BaseException:
    _stop_workers(ex)
    raise
  finally:
    ex.shutdown(wait=True, cancel_futures=True)
