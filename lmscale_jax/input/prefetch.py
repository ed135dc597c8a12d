"""Host batches -> global ``jax.Array``s one batch ahead, with a checkpointable position.

Owns the hand-over from the loader (:func:`lmscale_jax.input.grain_pipeline.make_dataset`) to
the devices: the transfer overlapped with the running step, the loader's checkpoint state, and
the measure of input stall (``wait_seconds``).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

import grain

from lmscale_jax.errors import IncompatibleCheckpoint

# ``_ahead`` before the first pull (None is a pull's result: the end of the stream).
_NOT_PULLED = object()


class DevicePrefetcher(grain.DatasetIterator):
  """Host batches -> global ``jax.Array``s, one batch ahead on device.

  ``next()`` returns batch ``c`` (already transferred) after pulling and starting the transfer
  of batch ``c + 1``; with JAX's asynchronous dispatch that pull overlaps the still-running
  previous step.

  Checkpointing. The host iterator has always produced one batch more than the model
  consumed, so its own state would skip a batch on restore. The state is therefore
  ``{"next_batch": k}``, the number of batches ``next()`` has returned, and ``set_state``
  builds a fresh host iterator with ``reopen(k)`` (``make_dataset(..., start_batch=k)``). The
  state does not depend on ``data.workers`` (Grain's own state has one format per worker
  count), so a run can resume with another number of loader workers, e.g. on other hardware.
  The first host iterator is built lazily, so a restore never spawns workers twice.

  Being a ``grain.DatasetIterator`` itself, it can be passed straight to
  ``grain.checkpoint.CheckpointSave`` / ``CheckpointRestore`` (Orbax); do not save
  ``.iterator`` (the raw host iterator) instead.

  ``wait_seconds``: cumulative time ``next()`` spent blocked on the host iterator (input
  stall); ``reset_wait()`` zeroes it, so training can report the input-wait fraction per
  logging window.
  """

  def __init__(self, sharding, reopen: Callable[[int], Iterator]):
    super().__init__(())
    self.sharding = sharding
    self.reopen = reopen
    self.iterator: Iterator | None = None  # the host iterator, built on the first pull
    self.wait_seconds = 0.0
    self._next_batch = 0  # batches next() has returned
    self._ahead = _NOT_PULLED  # the next device batch, already pulled; None at the end

  def reset_wait(self) -> float:
    """Zeroes ``wait_seconds`` and returns the value it had."""
    waited, self.wait_seconds = self.wait_seconds, 0.0
    return waited

  def _pull(self):
    """The next host batch as global arrays, its transfer started; None at the end."""
    import jax

    if self.iterator is None:
      self.iterator = self.reopen(self._next_batch)
    start = time.perf_counter()
    try:
      host = next(self.iterator)
    except StopIteration:
      return None
    finally:
      self.wait_seconds += time.perf_counter() - start
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(self.sharding, x), host)

  def __next__(self) -> dict[str, Any]:
    if self._ahead is _NOT_PULLED:
      self._ahead = self._pull()
    batch = self._ahead
    if batch is None:
      raise StopIteration
    self._ahead = self._pull()
    self._next_batch += 1
    return batch

  def get_state(self) -> dict[str, Any]:
    return {"next_batch": self._next_batch}

  def set_state(self, state: dict[str, Any]) -> None:
    if set(state) != {"next_batch"}:
      raise IncompatibleCheckpoint(
          f"loader state {state!r}: expected {{'next_batch': k}} (a checkpoint written by "
          "another version of lmscale_jax? resume it with that version, or start a new "
          "workdir)")
    self._next_batch = int(state["next_batch"])
    self._ahead = _NOT_PULLED
    self._close_host()
    self.iterator = None  # rebuilt from _next_batch on the next pull

  def _close_host(self) -> None:
    if self.iterator is not None and hasattr(self.iterator, "close"):
      self.iterator.close()  # stops its worker processes now, not whenever it is collected

  def close(self) -> None:
    self._close_host()
    super().close()

  def __iter__(self) -> Iterator[dict[str, Any]]:
    return self
