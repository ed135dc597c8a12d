"""The Orbax checkpoints of a workdir: the manager (train state + Grain iterator per step),
what a step directory holds and which are complete, the process count a checkpoint was
written with, and when to save before a preemption.

``workdir/checkpoints/<step>/`` holds ``state`` (Orbax PyTree) and ``data`` (Grain's per-process
iterator JSON, ``process_<i>-of-<n>.json``); Orbax writes each step under a temporary name and
renames it when complete, so an interrupted save is never taken for a checkpoint (Orbax's step
name format, :data:`STEP_NAMES`, is the one place that knows which names are complete steps).
A committed step also holds one manifest per process (``lmscale_jax/train/checkpoint_manifest.py``):
a resume loads the newest checkpoint that verifies (:func:`choose_resume_step`) and moves the
newer ones that do not, and any file in place of a step (:func:`misplaced_steps`), to
``<step>.corrupt``. Whose checkpoint it is, before one is restored, is
``lmscale_jax/train/checkpoint_binding.py``. Before each save the free space is checked
(``checkpoint.on_full``). Orbax removes the temporary directories of interrupted saves when
the next run builds its manager (``cleanup_tmp_directories``).
The rest of the workdir: its lock and ``run_state.json``, ``lmscale_jax/train/workdir.py``;
``config.json`` and the resume rules, ``lmscale_jax/train/run_record.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import threading
from typing import Callable

import grain
import jax
import orbax.checkpoint as ocp
from absl import logging

from lmscale_jax.cluster import distributed, preemption
from lmscale_jax.errors import IncompatibleCheckpoint, UserError
from lmscale_jax.store import file_io
from lmscale_jax.train import checkpoint_manifest as manifest_lib

# Orbax's default step names (``<step>``, complete steps only), shared by the manager that
# writes them and check_process_count, which reads them before any manager exists.
STEP_NAMES = ocp.path.step.standard_name_format()
# How Grain names each process's iterator state in a step's ``data`` item (its checkpoint
# handler, grain/_src/python/checkpoint/handler.py, builds the name inline).
_GRAIN_STATE_FILE = re.compile(r"process_\d+-of-(\d+)\.json")


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


# What a step holds: the train state, each process's loader position, and the run's record
# (workdir/config.json as it was when the step was saved: what a resume is checked against
# where config.json is lost or damaged; checkpoints from before it lack it). Orbax's
# JsonCheckpointHandler writes the record to <step>/config/metadata (its default file name).
RUN_RECORD = "config"
ITEMS = ("state", "data", RUN_RECORD)
_RUN_RECORD_FILE = os.path.join(RUN_RECORD, "metadata")


def saved_record(workdir: str, step: int) -> dict | None:
  """The run's record kept in checkpoint ``step``, or None (a checkpoint from before records
  were kept, or one unreadable: the checkpoint's manifest says whether its files are intact).
  One small JSON file: no array of the checkpoint is read."""
  try:
    with open(os.path.join(step_dir(workdir, step), _RUN_RECORD_FILE)) as f:
      record = json.load(f)
  except (OSError, ValueError):
    return None
  good = isinstance(record, dict) and all(isinstance(record.get(k), dict)
                                          for k in ("config", "model"))
  return record if good else None


class CheckpointCorrupt(UserError, ValueError):
  """No checkpoint of the workdir verifies against its manifests: nothing is trained."""


class CheckpointDiskFull(UserError, RuntimeError):
  """Too little free space for the next checkpoint (``checkpoint.on_full=error``)."""


# checkpoint.on_full (config.modes.ON_FULL): "error" stops cleanly before a save that does not
# fit (the previous checkpoint stays complete); "skip" warns and trains on without that save.
# Room kept beyond the expected checkpoint size: Orbax's metadata files, sizes that vary a
# little between steps, the manifest itself.
_SPACE_MARGIN = 1.1
_SPACE_SLACK_BYTES = 1 << 20
CORRUPT_SUFFIX = ".corrupt"


def complete_steps(workdir: str) -> list[int]:
  """The steps Orbax committed (its temporary directories excluded), newest first; only
  reads."""
  root = checkpoints_dir(workdir)
  if not os.path.isdir(root):
    return []
  return sorted((int(m.step) for m in STEP_NAMES.find_all(root)), reverse=True)


def misplaced_steps(workdir: str) -> list[tuple[int, list[str]]]:
  """Entries of the checkpoint directory named as a step that are no directory (a file, a FIFO,
  a broken link), newest first, as ``[(step, [what it is])]``: Orbax lists directories only, so
  a run would not see one, and its save of that step would replace it. A run moves them aside
  as it moves checkpoints that fail verification (:class:`ResumeChoice`). Only reads."""
  root = checkpoints_dir(workdir)
  names = os.listdir(root) if os.path.isdir(root) else []
  steps = [int(n) for n in names
           if n.isascii() and n.isdigit() and STEP_NAMES.build_name(int(n)) == n]
  return [(s, [f"{step_dir(workdir, s)} is {file_io.entry_kind(step_dir(workdir, s))}, not a "
               "checkpoint directory"])
          for s in sorted(steps, reverse=True) if not os.path.isdir(step_dir(workdir, s))]


def _size_or_zero(path: str) -> int:
  try:
    return os.path.getsize(path)
  except FileNotFoundError:
    return 0


def dir_bytes(path: str) -> int:
  """Bytes under ``path``. Files may vanish while it walks: other processes rename their
  temporary manifests into place in the same step directory (a CI run crashed here on
  ``.manifest.process_3-of-4.json.<random>.tmp``)."""
  return sum(_size_or_zero(os.path.join(root, f)) for root, _, files in os.walk(path)
             for f in files)


@dataclasses.dataclass
class ResumeChoice:
  """The checkpoint a run resumes from (None: none, start afresh) and what to move aside: the
  newer checkpoints that failed verification and the entries in place of a step that are no
  directory (:func:`misplaced_steps`), ``[(step, problems)]``."""
  workdir: str
  step: int | None
  failed: list

  def set_aside(self) -> None:
    """Moves the failed checkpoints to ``<step>.corrupt`` (process 0; every process waits
    for it): kept for a person to look at, no longer a step Orbax lists, loads or rotates."""
    def move():
      if jax.process_index() != 0:
        return
      for step, _ in self.failed:
        source, target = step_dir(self.workdir, step), step_dir(self.workdir, step)
        target += CORRUPT_SUFFIX
        n = 1
        while os.path.exists(target):
          target, n = f"{step_dir(self.workdir, step)}{CORRUPT_SUFFIX}-{n}", n + 1
        os.rename(source, target)
        logging.warning("moved checkpoint %s aside to %s", source, target)

    if self.failed:
      distributed.agree("set aside corrupt checkpoints", move)


def choose_resume_step(workdir: str) -> ResumeChoice:
  """The newest checkpoint that verifies (:mod:`checkpoint_manifest`), the same in every
  process: each process checks its own part of a candidate, they exchange the outcome, and a
  failure anywhere moves all of them to the next older one (warned, naming checkpoint and
  file). Only reads. Raises :class:`CheckpointCorrupt`, naming every checkpoint and why, if
  there are checkpoints and none verifies."""
  me, count = jax.process_index(), jax.process_count()
  failed, misplaced = [], misplaced_steps(workdir)
  for step, problems in misplaced if me == 0 else []:
    logging.warning("%s: a save of step %d would replace it; it will be moved aside to %s%s",
                    problems[0], step, step_dir(workdir, step), CORRUPT_SUFFIX)
  for step in complete_steps(workdir):
    path = step_dir(workdir, step)
    mine = manifest_lib.verify(path, me, count)
    problems = [p for answer in distributed.allgather("checkpoint verification",
                                                      json.dumps(mine))
                for p in json.loads(answer)]
    if not problems:
      if failed and me == 0:
        logging.warning("resuming from %s, the newest checkpoint that verifies", path)
      return ResumeChoice(workdir, step, failed + misplaced)
    failed.append((step, problems))
    if me == 0:
      logging.warning("checkpoint %s does not verify, not loading it: %s%s; it will be moved "
                      "aside to %s%s", path, problems[0],
                      f" (and {len(problems) - 1} more)" if len(problems) > 1 else "", path,
                      CORRUPT_SUFFIX)
  if failed:
    why = "; ".join(f"{step_dir(workdir, step)}: {problems[0]}"
                    + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                    for step, problems in failed)
    raise CheckpointCorrupt(
        f"no checkpoint in {checkpoints_dir(workdir)} verifies, nothing was trained: {why}. "
        f"Restore the files from a copy (lmscale inspect {workdir} --verify "
        "checks them), or move the checkpoints directory away to start afresh")
  return ResumeChoice(workdir, None, misplaced)


class Checkpointer:
  """The Orbax manager of ``workdir/checkpoints``: the train state and the Grain iterator of
  each saved step, their manifests, and the free-space check before each save. Every process
  builds one and calls each method at the same steps (:meth:`poll` excepted).

  Manifests (:mod:`checkpoint_manifest`): process 0 writes its part in Orbax's
  ``post_finalization_callback``, which runs once every process's files are written and
  before the temporary directory is renamed, so a single-process checkpoint is never complete
  without it. Every other process writes its part into the committed directory once its save
  has finished (:meth:`poll` each step; at the latest the next save, :meth:`wait` or
  :meth:`close`); until then the checkpoint does not verify. ``use_async=False`` saves
  through the same path and waits for it.
  """

  def __init__(self, workdir: str, *, keep: int, use_async: bool = True,
               on_full: str = "error", run_record: dict | None = None):
    self.workdir, self.use_async, self.on_full = workdir, use_async, on_full
    self.run_record = run_record  # config.json's content, kept in each checkpoint
    self._saving: int | None = None     # the step whose save is in flight
    self._unlisted: int | None = None   # committed, this process's manifest not yet written
    self._size: int | None = None       # bytes of the latest checkpoint, once known
    self.manager = ocp.CheckpointManager(
        checkpoints_dir(workdir),
        item_names=ITEMS,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=True,
            cleanup_tmp_directories=True, step_name_format=STEP_NAMES,
            async_options=ocp.AsyncOptions(
                post_finalization_callback=self._manifest_before_commit,
                create_directories_asynchronously=False)))

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

  def save(self, step: int, state, data_iterator: grain.DatasetIterator) -> bool:
    """Saves ``step`` (in the background unless ``use_async=False``). Returns False if it was
    skipped for lack of space (``checkpoint.on_full=skip``); raises
    :class:`CheckpointDiskFull` for ``on_full=error``, with the previous checkpoint complete."""
    self.wait()  # Orbax's save waits for the previous one anyway; its size is known then
    if not self._room_for(step, state):
      return False
    self._saving = step
    items = dict(state=ocp.args.StandardSave(state),
                 data=grain.checkpoint.CheckpointSave(data_iterator))
    if self.run_record is not None:
      items[RUN_RECORD] = ocp.args.JsonSave(self.run_record)
    self.manager.save(step, args=ocp.args.Composite(**items), force=True,
                      custom_metadata={manifest_lib.METADATA_KEY: manifest_lib.FORMAT})
    if not self.use_async:
      self.wait()
    return True

  def _manifest_before_commit(self) -> None:
    # Orbax's background thread, process 0 only, before the rename (orbax async_checkpointer:
    # "post_finalization_callback", then "Finalizing checkpoint directory").
    final = step_dir(self.workdir, self._saving)
    tmp = final + ocp.path.step.TMP_DIR_SUFFIX
    manifest_lib.write_part(tmp if os.path.isdir(tmp) else final, 0, jax.process_count(),
                            self._saving)

  def poll(self) -> None:
    """Writes this process's manifest once its background save has finished (processes > 0;
    cheap when there is nothing to do). Call it every step; needs no other process."""
    if self._saving is not None and not self.manager.is_saving_in_progress():
      self.wait()

  def wait(self) -> None:
    """Waits for the save in flight; then this process's manifest of it is written. A save
    that failed raises its error here (once: it is no longer in flight)."""
    step = self._saving
    try:
      self.manager.wait_until_finished()  # process 0's manifest is written in here
    finally:
      self._saving = None
    if step is not None:
      if jax.process_index() != 0:
        manifest_lib.write_part(step_dir(self.workdir, step), jax.process_index(),
                                jax.process_count(), step)
      self._size = dir_bytes(step_dir(self.workdir, step))

  def _room_for(self, step: int, state) -> bool:
    """Free space at the checkpoint directory (the least any process sees) against the size
    of the latest checkpoint, or before the first one the bytes of the state."""
    needed, basis = self._expected_bytes(state)
    root = checkpoints_dir(self.workdir)
    free = min(int(x) for x in distributed.allgather(
        "checkpoint free space", str(shutil.disk_usage(root).free)))
    if free >= needed:
      return True
    latest = self.latest_step()
    kept = f"checkpoint {step_dir(self.workdir, latest)} is kept" if latest is not None else (
        "no checkpoint was saved yet")
    line = (f"no room for checkpoint {step}: {root} has {free:,} bytes free, the checkpoint "
            f"needs about {needed:,} ({basis})")
    if self.on_full == "skip":
      if jax.process_index() == 0:
        logging.warning("%s; not saved (checkpoint.on_full=skip), training goes on; %s",
                        line, kept)
      return False
    raise CheckpointDiskFull(
        f"{line}; {kept}: free space and rerun the same command to resume from it (or set "
        "checkpoint.on_full=skip to train on without saving)")

  def _expected_bytes(self, state) -> tuple[int, str]:
    latest = self.latest_step()
    if self._size is None and latest is not None:
      self._size = dir_bytes(step_dir(self.workdir, latest))
    if self._size is not None:
      size, basis = self._size, "the size of the latest checkpoint, plus 10%"
    else:
      size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
      basis = "the bytes of the train state, plus 10%"
    return int(size * _SPACE_MARGIN) + _SPACE_SLACK_BYTES, basis

  def restore(self, step: int, abstract_state, data_iterator: grain.DatasetIterator):
    """Returns the restored state (sharded like ``abstract_state``); restores the iterator."""
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=grain.checkpoint.CheckpointRestore(data_iterator)))
    return out["state"]

  def close(self) -> None:
    self.wait()
    self.manager.close()

  def end(self, timeout_s: float | None) -> None:
    """Closes on the way out of a failed run: the save in flight is finished, so it is kept
    (its own failure, or one not done within ``timeout_s``, only logged: the run's error is
    what to report). A save abandoned that way is never taken for a checkpoint (Orbax renames
    complete saves only) and the next run removes its tmp directory. ``timeout_s`` bounds the
    wait where a peer process may never finish its part (None: no bound)."""
    step = self._saving
    ended = threading.Thread(target=self._close_quietly, args=(step,), daemon=True)
    ended.start()
    ended.join(timeout_s)
    if ended.is_alive():
      logging.warning("abandoned checkpoint %s, still being written after %.0f s; the last "
                      "complete checkpoint is kept", step_dir(self.workdir, step), timeout_s)

  def _close_quietly(self, step: int | None) -> None:
    try:
      self.close()
    except Exception as e:
      if step is None:  # a failure already raised (and reported) by an earlier wait
        return
      latest = self.latest_step()
      logging.warning("checkpoint %s was not completed (%s); the last complete one is %s",
                      step_dir(self.workdir, step), str(e).strip().splitlines()[0][:300],
                      "none" if latest is None else step_dir(self.workdir, latest))


def restore_params(workdir: str, step: int | None, abstract_params,
                   check: Callable[[int], None] | None = None) -> tuple[int, object]:
  """``(step, params)`` of the checkpoint at ``step`` (None: the latest complete one): only the
  ``params`` of its ``state`` item (Orbax's partial restore), neither the optimizer state nor
  the data iterator: what the tools that run a trained model need (export, evaluate,
  fill-mask, embed). ``abstract_params``: the parameters' shapes (ShapeDtypeStructs, with the
  sharding to restore them to), e.g. ``jax.eval_shape`` of the model's init; the Adam moments,
  twice the parameters' bytes, are never read (benchmarks/bench_model_load.py). Only reads (a
  read-only manager: nothing cleaned, nothing created). A workdir without checkpoints, or a
  step it does not hold, is one line naming what there is; so is a checkpoint that does not
  verify against its manifests (which checksum every file of the step, optimizer's too: the
  OCDBT files hold both). ``check(step)``: the caller's refusal of the chosen step, before any
  array is read (``checkpoint_binding.check_checkpoint_run``: a checkpoint of another run)."""
  root = checkpoints_dir(workdir)
  latest = latest_complete_step(workdir) if os.path.isdir(root) else None
  if latest is None:
    raise UserError(f"{workdir}: no complete checkpoint under {root} (train with "
                    f"--workdir={workdir} first, or give the workdir of a run)")
  manager = ocp.CheckpointManager(root, item_names=ITEMS,
                                 options=ocp.CheckpointManagerOptions(
                                     create=False, read_only=True, step_name_format=STEP_NAMES))
  try:
    step = _verified_step(workdir, manager, latest, step)
    if check is not None:
      check(step)
    target = {"params": abstract_params}
    out = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True)))
  finally:
    manager.close()
  return step, out["state"]["params"]


def _verified_step(workdir: str, manager, latest: int, step: int | None) -> int:
  """``step`` (None: ``latest``) once ``manager`` holds it and it verifies against its
  manifests; otherwise one line naming what there is."""
  have = sorted(manager.all_steps())
  step = latest if step is None else int(step)
  if step not in have:
    raise UserError(f"{workdir}: no checkpoint at step {step}; it has steps "
                    f"{', '.join(map(str, have))} (omit --step for the latest, {latest})")
  problems = manifest_lib.verify(step_dir(workdir, step))  # every process's part
  if problems:
    raise CheckpointCorrupt(f"{step_dir(workdir, step)} does not verify: {problems[0]}"
                            + (f" (and {len(problems) - 1} more)" if len(problems) > 1
                               else "") + "; give another --step")
  return step
