"""Preemption signals: SIGTERM or SIGUSR1 -> finish the step, checkpoint, exit 0.

Schedulers signal before they kill: Slurm sends ``--signal=USR1@T`` T seconds before the time
limit and SIGTERM on preemption or ``scancel`` (then SIGKILL after ``KillWait``). The signal
reaches the processes of a job at different times, or only some of them, but a checkpoint
save is collective: every process must save at the same step. This module installs the
signal handlers; ``checkpoint.Checkpointer.reached_preemption(step)`` gives the training loop
the step to stop at, the same in every process:

* Several processes: JAX's preemption sync manager (started by ``jax.distributed.initialize``)
  catches SIGTERM, tells the other processes through the coordination service, and they agree
  on the step after the highest any of them has reached (Orbax's ``reached_preemption``).
  SIGUSR1 is forwarded to it as SIGTERM.
* One process: a Python handler sets a flag, :func:`requested`.

A second SIGTERM to a single process kills it at once (for an impatient ``kill``). Grain's
worker processes ignore both signals (:func:`ignore_in_worker`): they are in the job's process
group, and if they died the pending step could not get its batch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

from absl import logging

_requested = threading.Event()
_ctrl_c = threading.Event()


def install() -> None:
  """Call after ``distributed.initialize`` (whose runtime installs its own SIGTERM handler)."""
  import jax

  multi = jax.process_count() > 1
  if multi:
    from jax._src import distributed as jax_distributed  # holds the runtime's sync manager

    if jax_distributed.global_state.preemption_sync_manager is None:
      raise RuntimeError("jax.distributed started without its preemption service "
                         "(jax_enable_preemption_service=False?): processes could not agree "
                         "on a step to checkpoint at when preempted")
  if threading.current_thread() is not threading.main_thread():
    return  # signal handlers can only be set from the main thread (e.g. tests calling train)
  if multi:
    signal.signal(signal.SIGUSR1, _forward_to_runtime)
  else:
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGUSR1, _on_signal)


def _on_signal(signum, frame) -> None:
  if signum == signal.SIGTERM and _requested.is_set():
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
    return
  _requested.set()
  logging.warning("%s received: stopping after the current step, with a checkpoint",
                  signal.Signals(signum).name)


def _forward_to_runtime(signum, frame) -> None:
  if not _requested.is_set():
    _requested.set()
    logging.warning("SIGUSR1 received (time limit near): asking every process to checkpoint "
                    "and stop")
    os.kill(os.getpid(), signal.SIGTERM)


def requested() -> bool:
  """Whether this process received a signal itself: the answer for a single process (several
  agree through JAX's sync manager instead, see ``Checkpointer.reached_preemption``)."""
  return _requested.is_set()


@contextlib.contextmanager
def ctrl_c_at_step_boundaries():
  """Inside: a Ctrl-C (SIGINT) only sets a flag, :func:`ctrl_c_requested`, which the loop turns
  into KeyboardInterrupt between steps; a second one raises at once. Why: the default handler
  raises wherever the main thread is, also inside Orbax's save/wait or JAX's fetches, which can
  leave their locks held or swallow it (a CI run hung 240 s after one Ctrl-C, another trained
  to the end through it)."""
  if threading.current_thread() is not threading.main_thread():
    yield  # signal handlers can only be set from the main thread (e.g. tests calling train)
    return

  def on_sigint(signum, frame) -> None:
    if _ctrl_c.is_set():
      raise KeyboardInterrupt
    _ctrl_c.set()

  old = signal.signal(signal.SIGINT, on_sigint)
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, old)
    _ctrl_c.clear()


def ctrl_c_requested() -> bool:
  return _ctrl_c.is_set()


def ignore_in_worker(worker_index: int, worker_count: int) -> None:
  """Grain ``worker_init_fn``: input workers outlive the signal until the checkpoint is saved."""
  del worker_index, worker_count
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  signal.signal(signal.SIGUSR1, signal.SIG_IGN)
