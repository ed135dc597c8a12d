"""The Orbax checkpoints of a workdir: the manager (train state + Grain iterator per step),
what a step directory holds and which are complete, the process count a checkpoint was
written with, and when to save before a preemption.

``workdir/checkpoints/<step>/`` holds ``state`` (Orbax PyTree) and ``data`` (Grain's per-process
iterator JSON, ``process_<i>-of-<n>.json``); Orbax writes each step under a temporary name and
renames it when complete, so an interrupted save is never taken for a checkpoint (Orbax's step
name format, :data:`STEP_NAMES`, is the one place that knows which names are complete steps).
The rest of the workdir (its lock, ``config.json`` and the resume rules, ``run_state.json``) is
``lmscale_jax/workdir.py``.
"""

from __future__ import annotations

import os
import re

import grain
import jax
import orbax.checkpoint as ocp

from lmscale_jax import preemption
from lmscale_jax.errors import UserError

# Orbax's default step names (``<step>``, complete steps only), shared by the manager that
# writes them and check_process_count, which reads them before any manager exists.
STEP_NAMES = ocp.path.step.standard_name_format()
# How Grain names each process's iterator state in a step's ``data`` item (its checkpoint
# handler, grain/_src/python/checkpoint/handler.py, builds the name inline).
_GRAIN_STATE_FILE = re.compile(r"process_\d+-of-(\d+)\.json")


class IncompatibleCheckpoint(UserError, ValueError):
  """The workdir's checkpoint cannot be resumed by this run (model shape, process count)."""


def checkpoints_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), "checkpoints")


def step_dir(workdir: str, step: int) -> str:
  return os.path.join(checkpoints_dir(workdir), STEP_NAMES.build_name(step))


def latest_complete_step(workdir: str) -> int | None:
  """The newest complete checkpoint's step, or None; only reads (no manager, no directory
  created, no tmp directory cleaned), so a run can be refused before it touches anything."""
  latest = ocp.path.step.latest_step_metadata(checkpoints_dir(workdir), STEP_NAMES)
  return None if latest is None else int(latest.step)


def check_process_count(workdir: str, num_processes: int) -> None:
  """Refuses to resume the latest checkpoint if another number of processes wrote it: the
  data iterator state is per process (Grain writes one file per process).

  Only reads (creates no directory, talks to no other process), so every process can call it
  before training; no checkpoint, or none complete yet, passes.
  """
  latest = ocp.path.step.latest_step_metadata(checkpoints_dir(workdir), STEP_NAMES)
  if latest is None:
    return
  data_dir = os.path.join(latest.path, "data")
  written = os.listdir(data_dir) if os.path.isdir(data_dir) else []
  counts = {m.group(1) for name in written if (m := _GRAIN_STATE_FILE.fullmatch(name))}
  if counts and counts != {str(num_processes)}:
    raise IncompatibleCheckpoint(
        f"{workdir}/checkpoints/{latest.step} was written by {'/'.join(sorted(counts))} "
        f"process(es); this job has {num_processes}. The data iterator state is per process: "
        "resume with the same number of processes (or start a new workdir)")


class Checkpointer:
  """The Orbax manager of ``workdir/checkpoints``: the train state and the Grain iterator of
  each saved step. Every process builds one and calls each method at the same steps."""

  def __init__(self, workdir: str, *, keep: int, use_async: bool = True):
    self.manager = ocp.CheckpointManager(
        checkpoints_dir(workdir),
        item_names=("state", "data"),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=use_async,
            cleanup_tmp_directories=True, step_name_format=STEP_NAMES))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def reached_preemption(self, step: int) -> bool:
    """Whether to checkpoint and stop after ``step``: the same answer in every process for
    the same step. Call it once per step, in every process, from the same first step.

    Several processes: Orbax's ``CheckpointManager.reached_preemption``, which is JAX's
    preemption sync point (``multihost_utils.reached_preemption_sync_point``, see
    orbax/checkpoint/_src/multihost/multihost.py): the runtime's SIGTERM handler tells the
    coordination service, the processes exchange the steps they have reached, and the one
    after the highest is the sync point. Orbax answers False where that service is off, which
    ``preemption.install`` refuses at start-up. One process: the flag set by preemption.py's
    signal handler (without ``jax.distributed`` there is no sync manager).
    """
    if jax.process_count() > 1:
      return self.manager.reached_preemption(step)
    return preemption.requested()

  def save(self, step: int, state, data_iterator: grain.DatasetIterator) -> None:
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=grain.checkpoint.CheckpointSave(data_iterator)), force=True)

  def restore(self, step: int, abstract_state, data_iterator: grain.DatasetIterator):
    """Returns the restored state (sharded like ``abstract_state``); restores the iterator."""
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=grain.checkpoint.CheckpointRestore(data_iterator)))
    return out["state"]

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
