"""The process pool of data preparation: an ordered, bounded map (output identical for any
number of workers)."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import multiprocessing

from lmscale_jax.errors import PrepareError


@contextlib.contextmanager
def ordered_map(workers: int, initializer=None, initargs=()):
  """An ordered, bounded map over tasks: a process pool, or in-process for one worker.

  At most ``2 × workers`` tasks are in flight, so results (token arrays of whole chunks) never
  pile up in the parent. A worker that dies (killed, out of memory) ends the run with an error
  instead of the endless wait of ``multiprocessing.Pool``.
  """
  if workers <= 1:
    if initializer:
      initializer(*initargs)
    yield map
    return
  # spawn, not fork: the parent may hold threads (tokenizers, tqdm) that fork would copy.
  ctx = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=initializer,
                                              initargs=initargs) as ex:

    def ordered(fn, items):
      pending = collections.deque()
      try:
        for item in items:
          pending.append(ex.submit(fn, item))
          if len(pending) >= 2 * workers:
            yield pending.popleft().result()
        while pending:
          yield pending.popleft().result()
      except concurrent.futures.process.BrokenProcessPool as e:
        raise PrepareError(f"a worker process died ({e}); rerun to resume") from None
      finally:
        for f in pending:
          f.cancel()

    yield ordered
