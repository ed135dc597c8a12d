"""The one resumable loop of every run (pretraining, contrastive fine-tuning, …), in the manner of
levanter's and MaxText's single trainer that tasks plug into. A task (:class:`RunTask`) supplies
only its steps and state, its batches (an iterator whose position each checkpoint saves), its
start state, its optional evaluation and its log rows; :func:`run_task` owns the lifecycle:

  the refusals, from what is on disk (the workdir's entries; the checkpoint to resume, the newest
  that verifies; a checkpoint of another run; a workdir past train.steps; the task's own; a
  changed config) → a checkpoint that failed to verify (or a file in place of one) set aside
  → config.json → the Checkpointer → restore or init → run_state.json "running" → the steps
  (Ctrl-C at step boundaries, a preemption notice, saves with the data position, evaluation;
  the log's clock paused for both) → the last rows → run_state.json "finished" or "preempted".

A refused run leaves the workdir as it was. On the way out, Ctrl-C stops the task's data source
and lets a save in flight finish; any other exception finishes the save in flight too, so a
rerun resumes from it.
"""

from __future__ import annotations

import time

import jax

from lmscale_jax.cluster import preemption
from lmscale_jax.train import checkpoint as ckpt_lib
from lmscale_jax.train import checkpoint_binding
from lmscale_jax.train import metrics as metrics_lib
from lmscale_jax.train import run_record
from lmscale_jax.train import startup
from lmscale_jax.train import workdir as workdir_lib


class RunTask:
  """What a run supplies to :func:`run_task` (a subclass per task; a hook's default is a task
  without it). :meth:`open` sets ``steps`` (:class:`lmscale_jax.train.steps.Steps`: its
  ``abstract_state`` and ``train_step``) and ``batches`` (restored and saved with each
  checkpoint: its position) at the latest."""

  interrupted: type | None = None  # what Ctrl-C leaves as (None: the KeyboardInterrupt itself)
  eval_every: int = 0  # evaluation every so many steps and after the last (0: none)
  steps = None
  batches = None

  # Before anything is written: what a refusal needs.
  def past_end_advice(self, step: int) -> str:
    """The refusal's last words, after "…: nothing to train"."""
    raise NotImplementedError

  def check_resume(self, step: int) -> None:
    """The task's own refusal of resuming from checkpoint ``step``."""

  def model_cfg(self, resume_step: int | None):
    """The model's resolved config (config.json's ``model``), compared with the record's."""
    raise NotImplementedError

  def data_identity(self) -> dict | None:
    """The dataset config.json binds the run to (:func:`run_record.dataset_identity`)."""
    return None

  def before_save_config(self, check: run_record.ConfigCheck) -> None:
    """After the refusals and before config.json (which records what this chooses)."""

  # After the Checkpointer.
  def open(self, checkpointer: ckpt_lib.Checkpointer) -> None:
    """Builds what the steps need (``steps``, ``batches``, files of the workdir)."""

  def resumed(self, step: int) -> None:
    """After the state and ``batches``' position are restored from checkpoint ``step``."""

  def init_state(self):
    """Step 0's state (a new run)."""
    raise NotImplementedError

  def make_log(self, start: int, checkpointer: ckpt_lib.Checkpointer) -> metrics_lib.StepLog:
    raise NotImplementedError

  def next_batch(self):
    """The next step's batch, as ``steps.train_step`` takes it."""
    return next(self.batches)

  def evaluate(self, state) -> dict:
    """An evaluation row (``eval_every`` > 0)."""
    raise NotImplementedError

  def report_preempted(self, step: int, total: int, checkpoint: str) -> None:
    """Process 0's words after a preemption notice stopped the run (its checkpoint saved)."""

  def close(self) -> None:
    """Stops the data source on the way out of a failed or interrupted run."""

  def result(self, log: metrics_lib.StepLog, state) -> dict:
    """What the run returns: its last metrics."""
    return log.last


def run_task(task: RunTask, config, workdir: str, *, allow_config_change: bool = False) -> dict:
  """Runs ``task`` in ``workdir`` (resuming from its newest checkpoint that verifies) up to
  ``config.train.steps``; returns ``task.result``. The caller holds the workdir's lock."""
  checkpointer = _open(task, config, workdir, allow_config_change)
  task.open(checkpointer)
  start = checkpointer.latest_step()
  try:
    return _run(task, config, workdir, checkpointer, start)
  except KeyboardInterrupt:
    # Ctrl-C: the loader's worker processes ignore SIGINT (data.ignore_signals_in_worker) so
    # that only main reports it; stop them now, and let a checkpoint save in flight finish
    # (it is nearly written; an interpreter exit under it would fail in its thread). A second
    # Ctrl-C abandons it: main then leaves at once, and Orbax never takes its tmp directory
    # for a checkpoint.
    task.close()
    checkpointer.close()
    if task.interrupted is None:
      raise
    raise task.interrupted() from None
  except BaseException:
    # Any other way out (bad data, a full disk, a bug): the save in flight is finished, so a
    # rerun resumes from it (without this a data error one step after a save lost it: only
    # its tmp directory was left).
    task.close()
    checkpointer.end(None if jax.process_count() == 1
                     else float(config.distributed.heartbeat_timeout))
    raise


def _open(task: RunTask, config, workdir: str, allow_change: bool) -> ckpt_lib.Checkpointer:
  """The refusals first, from what is on disk: a refused run leaves the workdir as it was. The
  checkpoint to resume is the newest that verifies (the same in every process)."""
  workdir_lib.check_entries(workdir)
  resume = ckpt_lib.choose_resume_step(workdir)
  run = run_record.read_record(workdir, resume.step)
  if resume.step is not None:
    old, restored = run
    if not restored:  # config.json's record; one restored from this very checkpoint is its own
      checkpoint_binding.check_checkpoint_run(workdir, resume.step, old)
    _check_not_past_end(task, workdir, resume.step, int(config.train.steps))
    task.check_resume(resume.step)
  model_cfg = task.model_cfg(resume.step)
  data = task.data_identity()
  check = run_record.check_config_change(workdir, config, model_cfg, run,
                                         resume_step=resume.step, allow_change=allow_change,
                                         data=data)
  startup.show_log()  # no refusal left: the lines held since start-up, then the run's own
  resume.set_aside()  # <step>.corrupt: before the manager, which would list and rotate them
  task.before_save_config(check)
  record = run_record.save_config(workdir, config, model_cfg, check,
                                  jax.process_index() == 0, data)
  return ckpt_lib.Checkpointer(workdir, keep=config.checkpoint.keep,
                               use_async=bool(config.checkpoint.async_save),
                               on_full=str(config.checkpoint.on_full), run_record=record)


def _check_not_past_end(task: RunTask, workdir: str, start: int, steps: int) -> None:
  if start > steps:
    raise ckpt_lib.IncompatibleCheckpoint(
        f"{ckpt_lib.step_dir(workdir, start)}: the workdir is already at step {start}, past "
        f"train.steps={steps}: nothing to train{task.past_end_advice(start)}")


def _run(task: RunTask, config, workdir: str, checkpointer, start: int | None) -> dict:
  total, is_writer = config.train.steps, jax.process_index() == 0
  if start is not None:
    state = checkpointer.restore(start, task.steps.abstract_state, task.batches)
    task.resumed(start)
  else:
    start, state = 0, task.init_state()
  if is_writer:  # a crash leaves "running": job scripts requeue only a "preempted" run
    workdir_lib.write_run_state(workdir, "running", start, total)
  log = task.make_log(start, checkpointer)
  try:
    preempted, step, state = _steps(task, config, state, start, checkpointer, log)
    log.finish(step)
    if preempted and is_writer:
      task.report_preempted(step, total, ckpt_lib.step_dir(workdir, step))
  except BaseException:
    log.close(quiet=True)  # TensorBoard's buffered events; the run's own error is the report
    raise
  log.close()
  checkpointer.close()
  if is_writer:
    workdir_lib.write_run_state(workdir, "preempted" if preempted else "finished", step, total)
  return task.result(log, state)


def _steps(task: RunTask, config, state, start: int, checkpointer,
           log: metrics_lib.StepLog) -> tuple[bool, int, object]:
  """The steps ``start + 1 …``: returns (preempted, the last step, the state after it)."""
  total, eval_every = int(config.train.steps), int(task.eval_every)
  preempted, step = False, start
  with preemption.ctrl_c_at_step_boundaries():
    for step in range(start + 1, total + 1):
      if preemption.ctrl_c_requested():
        raise KeyboardInterrupt
      state, metrics = task.steps.train_step(state, task.next_batch())
      log.after_step(step, metrics)
      do_eval = eval_every > 0 and (step % eval_every == 0 or step == total)
      # Every process asks at every step and gets the same answer.
      preempted = checkpointer.reached_preemption(step) and step < total
      do_save = step % config.checkpoint.every == 0 or step == total or preempted
      if do_eval or do_save:
        log.pause()  # neither counts as training time
      if do_eval:
        row = task.evaluate(state)
        log.write(step, {**row, "eval_seconds": time.perf_counter() - log.paused_at})
      if do_save:
        log.check_before_save(step)
        checkpointer.save(step, state, task.batches)
      else:
        checkpointer.poll()  # the manifest of a finished background save (processes > 0)
      if do_eval or do_save:
        log.resume()
      if preempted:
        checkpointer.wait()  # synchronous: the process may be killed soon after it exits
        break
  return preempted, step, state
