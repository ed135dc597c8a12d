"""Dynamic batching: the functions of concurrent requests embedded together, in shared
length-bucketed batches, by one model thread (the anchor: text-embeddings-inference's and
Triton's dynamic batchers).

A request hands in its functions' token ids (encoded on the event loop when it has at most
``app.INLINE_TEXTS``) and awaits their vectors. Once a batch is full or the oldest row has
waited ``wait_s`` (default 5 ms), the model thread takes the rows waiting (up to WINDOW
batches' worth) and cuts them as ``lmscale embed`` does (``inference/function_vectors``, its
one owner): sorted by length, into passes of 8 or 32 rows per device, each padded to its own
bucket (the next multiple of seq_len / BUCKETS), through the same jitted programs, the cut
points where the passes cost least. The one difference: the server prices a pass by what its
program measured at start-up (``warm``), ``lmscale embed`` by the positions it computes (its
vectors may not depend on a clock). While a forward pass runs, new requests queue, so under
load the batches fill by themselves; alone, a request waits only ``wait_s``. Each request is
answered as soon as its last row is done.

Other model calls (fill-mask) run on the same thread, between batches: one model, one thread,
no two forward passes sharing the cores."""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time

import numpy as np

from lmscale_jax.inference import function_vectors
from lmscale_jax.serve.guard import ApiError

log = logging.getLogger("lmscale.serve")

WAIT_S = 0.005  # how long the oldest waiting row waits for company before its batch runs
MAX_WAITING = 256  # requests waiting for the model before a 503 (50 clients: never reached)


class Pending:
  """One request's rows: their vectors as they come, and the future its handler awaits."""

  def __init__(self, rows: int, loop: asyncio.AbstractEventLoop):
    self.vectors, self.left = [None] * rows, rows
    self.loop, self.future = loop, loop.create_future()

  def done(self, slot: int, vector) -> None:
    self.vectors[slot] = vector
    self.left -= 1
    if self.left == 0:
      self.loop.call_soon_threadsafe(settle, self.future, self.vectors, None)

  def failed(self, error: BaseException) -> None:
    self.loop.call_soon_threadsafe(settle, self.future, None, error)


def settle(future: asyncio.Future, value, error: BaseException | None) -> None:
  if not future.done():  # a client that hung up cancelled it
    future.set_exception(error) if error is not None else future.set_result(value)


class Batcher:
  """``vectors(ids_list)``: each function's vector (``function_vectors.embed``'s: pooled, not
  normalised); ``call(fn, *args)``: any other model call, on the model thread."""

  def __init__(self, model, pool: str, wait_s: float = WAIT_S, max_waiting: int = MAX_WAITING):
    self.model, self.pool, self.wait_s, self.max_waiting = model, pool, wait_s, max_waiting
    self.where = function_vectors.mesh()
    self.size = function_vectors.BATCH * self.where.devices.size
    self.cond = threading.Condition()
    self.rows: list = []  # (arrival time, (Pending, slot), ids)
    self.calls: collections.deque = collections.deque()
    self.waiting, self.stopping = 0, False
    # Counters for /api/info: how full the batches run, and the model thread's busy seconds.
    self.batches = self.rows_run = 0
    self.tokens = self.token_slots = 0  # the rows' own tokens, and the positions computed
    self.costs: dict | None = None  # the passes' measured seconds (warm); None: by positions
    self.busy_s, self.last_end = 0.0, 0.0
    self.thread = threading.Thread(target=self.loop, name="lmscale-model", daemon=True)
    self.thread.start()

  @property
  def alive(self) -> bool:
    return self.thread.is_alive() and not self.stopping

  async def vectors(self, ids_list: list) -> list:
    pending = self.admit(len(ids_list))
    now = time.monotonic()
    with self.cond:
      self.rows += [(now, (pending, i), ids) for i, ids in enumerate(ids_list)]
      self.cond.notify()
    return await self.awaited(pending)

  async def call(self, fn, *args):
    pending = self.admit(1)
    with self.cond:
      self.calls.append((pending, fn, args))
      self.cond.notify()
    return (await self.awaited(pending))[0]

  def admit(self, rows: int) -> Pending:
    if self.waiting >= self.max_waiting:
      raise ApiError(503, f"server busy: {self.waiting} requests wait for the model; retry later")
    if not self.alive:
      raise ApiError(503, "the model thread has stopped; the server's log says why")
    return Pending(rows, asyncio.get_running_loop())

  async def awaited(self, pending: Pending):
    self.waiting += 1
    try:
      return await pending.future
    finally:
      self.waiting -= 1

  def warm(self) -> int:
    """Compiles every program (each row size at each bucket's length) and times it, before the
    server listens: no user's request waits for a compile (one was 1.7 s on the demo model), and
    the batches are cut by what their passes cost here (``function_vectors.measured_passes``)
    → the number of programs."""
    self.costs = function_vectors.measured_passes(self.model, self.pool, self.where)
    return len(self.costs)

  def close(self) -> None:
    with self.cond:
      self.stopping = True
      self.cond.notify()
    self.thread.join(timeout=60)

  # ------------------------------------------------------------------------ the model thread
  def loop(self) -> None:
    while True:
      job = self.next_job()
      if job is None:
        return
      job()

  def next_job(self):
    """The next thing to run: a waiting call, else the rows waiting once a batch is full or the
    oldest has waited ``wait_s``; None when closing."""
    with self.cond:
      while not (self.rows or self.calls or self.stopping):
        self.cond.wait()
      while self.rows and not self.calls and not self.stopping and len(self.rows) < self.size:
        # From the later of the oldest row's arrival and the last batch's end: rows left over
        # from a batch have waited a whole batch already; the requests that batch answered are
        # on their way back (a closed loop of clients) and fill the next one.
        left = max(self.rows[0][0], self.last_end) + self.wait_s - time.monotonic()
        if left <= 0:
          break
        self.cond.wait(left)
      if self.stopping:
        return None
      if self.calls:
        return lambda c=self.calls.popleft(): self.run_call(*c)
      taken, self.rows = self.rows[:self.take()], self.rows[self.take():]
    return lambda: self.run_rows(taken)

  def take(self) -> int:
    """Rows to embed now: all that wait, at most WINDOW batches' worth (a partial batch runs
    as 8 rows per device where it fits, not 32: function_vectors.ROW_BUCKETS)."""
    return min(len(self.rows), self.size * function_vectors.WINDOW)

  def run_call(self, pending: Pending, fn, args) -> None:
    try:
      pending.done(0, fn(*args))
    except BaseException as e:  # noqa: BLE001 — the request's error, not the thread's end
      pending.failed(e)

  def run_rows(self, taken: list) -> None:
    start = time.perf_counter()
    self.embed_rows(taken)
    self.busy_s += time.perf_counter() - start
    self.last_end = time.monotonic()

  def embed_rows(self, taken: list) -> None:
    items = [(i, ids) for i, (_, _, ids) in enumerate(taken)]
    devices, seq_len = self.where.devices.size, int(self.model.cfg.seq_len)
    for batch in function_vectors._by_length(items, devices, seq_len, self.costs):
      try:
        vectors = function_vectors._pooled(self.model, self.pool, batch, self.where)
      except BaseException as e:  # noqa: BLE001 — every request of the batch gets the error
        log.exception("a batch of %d functions failed", len(batch))
        for i, _ in batch:
          taken[i][1][0].failed(e)
        continue
      self.batches, self.rows_run = self.batches + 1, self.rows_run + len(batch)
      lengths = [len(ids) for _, ids in batch]
      self.tokens += sum(lengths)
      self.token_slots += function_vectors.batch_slots(lengths, devices, seq_len)
      for (i, _), vector in zip(batch, vectors):
        pending, slot = taken[i][1]
        pending.done(slot, vector)


def normalised(vectors: list) -> np.ndarray:
  """Vectors as a search compares them (``search/index.embed_texts``'s): unit length."""
  v = np.asarray(np.stack(vectors), np.float32)
  return (v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)).astype(np.float32)
