"""Pretraining: the setup built from the config, its rows (:class:`TrainLog`), its evaluation,
and the task (:class:`Pretraining`) the one loop (:mod:`lmscale_jax.train.run_loop`) runs.

The hot loop is: pull the prefetched batch (already on device) → dispatch the jitted step (state
donated) → every ``log_every`` steps close a window whose device metrics are fetched when the
*next* step has been dispatched, so dispatch never waits on the device. Everything per-step
runs inside ``steps.train_step``.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from lmscale_jax.config import checks as config_checks
from lmscale_jax.input import autotune, grain_pipeline as loader, masking, prefetch
from lmscale_jax.model import bert as model_lib
from lmscale_jax.model import flops as flops_lib
from lmscale_jax.model import hf_convert
from lmscale_jax.pretrain import mlm
from lmscale_jax.store import dataset, records
from lmscale_jax.train import checkpoint as ckpt_lib
from lmscale_jax.train import metrics as metrics_lib
from lmscale_jax.train import preflight
from lmscale_jax.train import run_loop
from lmscale_jax.train import startup
from lmscale_jax.train import steps as steps_lib
from lmscale_jax.train import run_record
from lmscale_jax.train import workdir as workdir_lib


NonFiniteLoss = metrics_lib.NonFiniteLoss  # every run's (train.nonfinite)


class Interrupted(KeyboardInterrupt):
  """Ctrl-C during training, raised once the loader's workers are stopped and any checkpoint
  save in flight has finished: the process may exit normally (main: one line, exit 130)."""


# ----------------------------------------------------------------------------- setup
@dataclasses.dataclass
class Setup:
  """Everything built from the config before the loop; also what --dry_run reports."""
  config: ml_collections.ConfigDict
  meta: dataset.DatasetMeta
  model_cfg: ml_collections.ConfigDict
  predictions: int
  param_count: int
  flops_per_step: float
  memory_bytes: float           # the estimate of a step at this batch, per device
  memory_at: Callable[[int], int]  # the same at another per-device batch


def build_setup(config: ml_collections.ConfigDict, meta: dataset.DatasetMeta | None = None,
                workdir: str | None = None, *, checked: bool = False) -> Setup:
  """Checks the config (config_checks steps 1-2; ``checked``: the command did, main through
  train.startup, so each check runs once), loads the dataset's metadata once (unless given)
  and resolves the model and its costs (``model.positions="auto"``: the run in ``workdir``
  keeps its own, :func:`start_positions`)."""
  if not checked:  # a library caller (tests, tools) that never passed through main
    startup.check_before_runtime(config)
    config_checks.check_batch(config.train.batch_size, processes=jax.process_count(),
                              devices_per_process=jax.local_device_count(),
                              accum_steps=config.train.grad_accum_steps)
  devices = jax.device_count()
  meta = meta or dataset.DatasetMeta.load(config.data.path)
  model_cfg = model_lib.resolve_model_config(config.model, meta, remat=config.train.remat,
                                             start_positions=start_positions(config, workdir))
  predictions = masking.num_predictions(config.data.mask_prob, config.data.max_predictions,
                                        meta.seq_len)
  per_device = config.train.batch_size // devices

  def memory_at(batch: int) -> int:
    return flops_lib.memory_estimate_bytes(
        model_cfg, batch, meta.seq_len, predictions,
        accum_steps=int(config.train.grad_accum_steps),
        fsdp_devices=devices if config.train.fsdp else 1)

  return Setup(
      config=config, meta=meta, model_cfg=model_cfg, predictions=predictions,
      param_count=flops_lib.count_params_from_config(model_cfg),
      flops_per_step=flops_lib.train_flops_per_step(model_cfg, config.train.batch_size,
                                                    meta.seq_len, predictions),
      memory_bytes=memory_at(per_device), memory_at=memory_at)


def start_positions(config: ml_collections.ConfigDict, workdir: str | None) -> str | None:
  """What ``model.positions="auto"`` keeps: the positions of the model the run starts from,
  the run in ``workdir`` (a resume: one begun before "auto" was the default resumes as it
  began) or else ``init_from``'s; None for a new model (the dataset decides)."""
  if config.model.positions != "auto":
    return None
  resumed = run_record.recorded_positions(workdir) if workdir else None
  if resumed:
    return resumed
  if config.init_from:
    return hf_convert.positions_of(hf_convert.model_keys(str(config.init_from)))
  return None


def describe(setup: Setup) -> str:
  train_config, cfg = setup.config.train, setup.model_cfg
  levers = (f"remat {train_config.remat}, grad_accum_steps {train_config.grad_accum_steps}, "
            f"fsdp {bool(train_config.fsdp)}, "
            f"grad_allreduce_dtype {train_config.grad_allreduce_dtype}, "
            f"grad_allreduce {train_config.get('grad_allreduce', 'auto')}")
  return (f"model: {setup.param_count:,} parameters ({cfg.layers} layers × {cfg.hidden}, "
          f"vocab {cfg.vocab_size}, seq {setup.meta.seq_len}, {cfg.positions} positions, "
          f"{cfg.norm}-LN); "
          f"{setup.flops_per_step / 1e12:.3f} TFLOP per step (global batch "
          f"{train_config.batch_size}, "
          f"{setup.predictions} predictions/sequence); "
          f"≈{setup.memory_bytes / 2**30:.2f} GiB per device ({levers})")


# ----------------------------------------------------------------------------- logging
Window = metrics_lib.Window


class TrainLog(metrics_lib.StepLog):
  """Pretraining's rows: MLM loss and accuracy, throughput and MFU, input wait, the unigram
  baseline in a run's first row, corrupt records; evaluation rows between them."""

  def __init__(self, setup: Setup, workdir: str, start: int, checkpointer, train_iter):
    config, self.setup = setup.config, setup
    self.checkpointer = checkpointer
    super().__init__(config.train, workdir, start, reset_wait=train_iter.reset_wait)
    peak = flops_lib.device_peak_flops(jax.devices()[0].device_kind,
                                       config.metrics.peak_tflops, dtype=setup.model_cfg.dtype)
    self.peak_total = peak * jax.device_count() if peak else None
    self.baseline = records.unigram_entropy(setup.meta,
                                            on_corrupt=str(config.data.on_corrupt))
    self.last = {"unigram_baseline": self.baseline}
    if self.is_writer:
      logging.info(describe(setup))
      logging.info("devices: %d × %s; unigram baseline loss %.4f nats; MFU peak %s",
                   jax.device_count(), jax.devices()[0].device_kind, self.baseline,
                   f"{peak / 1e12:.0f} TFLOP/s per device" if peak else
                   "unknown for this device (mfu = null; set metrics.peak_tflops)")

  def last_good(self) -> str:
    latest = self.checkpointer.latest_step()
    return ckpt_lib.step_dir(self.workdir, latest) if latest is not None else "none"

  def make_row(self, window: Window, host: list, good: list) -> dict:
    row = {
        "loss": float(np.mean([m["loss"] for m in good])),
        "mlm_accuracy": float(np.mean([m["mlm_accuracy"] for m in good])),
        "learning_rate": float(host[-1]["learning_rate"]),
        "grad_norm": float(good[-1]["grad_norm"]),
    }
    timed = host[window.untimed:]
    row.update(metrics_lib.throughput(
        steps=len(timed), seconds=window.seconds, wait_seconds=window.input_wait,
        global_batch=self.train_config.batch_size,
        tokens=float(sum(m["tokens"] for m in timed)),
        flops_per_step=self.setup.flops_per_step, peak_flops_total=self.peak_total))
    if "corrupt_records" in host[0]:
      row["corrupt_records"] = int(sum(m["corrupt_records"] for m in host))
    if window.first_step == self.start + 1 and self.is_writer:  # first window of this run
      row["unigram_baseline"] = self.baseline
    return row


def evaluate(steps: steps_lib.Steps, params, eval_batches) -> dict:
  """MLM loss and accuracy over the fixed validation batches (``iter`` afresh each time)."""
  sums = None
  for host in iter(eval_batches):
    batch = jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(steps.batch_sharding, x), host)
    out = steps.eval_step(params, batch)
    sums = out if sums is None else jax.tree.map(jnp.add, sums, out)
  sums = jax.device_get(sums)
  weight = max(float(sums["weight"]), 1.0)
  return {"eval_loss": float(sums["ce_sum"]) / weight,
          "eval_mlm_accuracy": float(sums["correct"]) / weight}


# ----------------------------------------------------------------------------- the run
def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       meta: dataset.DatasetMeta | None = None, *,
                       allow_config_change: bool = False, checked: bool = False) -> dict:
  """Trains (resuming from ``workdir`` if it holds a checkpoint); returns the last metrics.
  ``checked``: the config's checks ran already (main's, :func:`build_setup`).
  ``meta``: the dataset's metadata if the caller has loaded it (main has), else loaded here.
  ``allow_config_change``: resume under changed result keys (``run_record.RESULT_KEYS``),
  recording them in config.json (``--allow_config_change``).

  The workdir's lock (``workdir_lib.holding_for_job``): ``main`` takes it for every process of a
  job; a single-process library caller (tests, tools) gets it here, for the call."""
  with workdir_lib.holding(workdir):
    return _train(config, workdir, meta, allow_config_change, checked)


def _warn_if_eval_wraps(config, meta: dataset.DatasetMeta, process: dict) -> None:
  """Warned, not refused: a small validation split still gives a usable (if noisier than it
  looks) eval loss, and smoke tests on tiny datasets rely on it."""
  records, rows = loader.eval_stream(config, meta, **process)
  wanted, available = int(config.train.eval_batches), records // rows
  if wanted > available and jax.process_index() == 0:
    fix = (f"Set train.eval_batches<={available} for a non-repeating evaluation" if available
           else "Prepare the dataset with a larger --val-fraction (or more input) for a "
           "non-repeating evaluation")
    logging.warning(
        "train.eval_batches=%d batches of %d rows but the validation split (%d records in %s) "
        "fills %d: each evaluation reads each record about %.1f times. %s", wanted, rows,
        meta.num_records("validation"), meta.path, available, wanted * rows / max(records, 1),
        fix)


def _train(config, workdir: str, meta, allow_config_change: bool, checked: bool) -> dict:
  config = copy.deepcopy(config)  # data.workers may be capped or set by the autotune below
  setup = build_setup(config, meta, workdir, checked=checked)
  is_writer = jax.process_index() == 0
  loader.cap_workers(config, is_writer=is_writer)
  steps = mlm.build_steps(config, setup.model_cfg, setup.predictions)
  if is_writer and jax.device_count() > 1:
    logging.info("gradient all-reduce: %s (train.grad_allreduce=%s)", steps.grad_allreduce,
                 config.train.grad_allreduce)
  preflight.check_memory(config, setup.memory_at)
  return run_loop.run_task(Pretraining(setup, workdir, steps), config, workdir,
                           allow_config_change=allow_config_change)


class Pretraining(run_loop.RunTask):
  """MLM pretraining in the one loop (:mod:`lmscale_jax.train.run_loop`): batches from the
  prefetching loader (their position: the loader's), evaluation on the validation split,
  step 0 fresh or from a BertForMaskedLM directory (``init_from``), :class:`TrainLog`'s rows."""

  interrupted = Interrupted

  def __init__(self, setup: Setup, workdir: str, steps: steps_lib.Steps):
    self.setup, self.config, self.workdir, self.steps = setup, setup.config, workdir, steps
    self.eval_every = int(self.config.train.eval_every)
    self.process = dict(process_index=jax.process_index(), process_count=jax.process_count())
    self.batches = self.eval_batches = None

  def past_end_advice(self, step: int) -> str:
    return (f". To continue it, set a larger train.steps (e.g. --config.train.steps={2 * step});"
            " for a new run, give another --workdir")

  def model_cfg(self, resume_step: int | None):
    return self.setup.model_cfg

  def data_identity(self) -> dict:
    return run_record.dataset_identity(self.setup.meta)

  def before_save_config(self, check) -> None:
    config, is_writer = self.config, jax.process_index() == 0
    for change in check.changes:
      if is_writer:
        logging.warning("config change from step %d on (recorded in config.json): %s: %r -> %r",
                        change["step"], change["key"], change["from"], change["to"])
    # After the config check (the autotune may take minutes; data.workers is a neutral key),
    # before config.json, which then records the choice.
    if config.data.autotune:
      config.data.workers = autotune.choose_for_run(config, self.setup.meta, self.workdir,
                                                    self.steps, is_writer=is_writer)

  def open(self, checkpointer) -> None:
    config, meta, process = self.config, self.setup.meta, self.process
    _warn_if_eval_wraps(config, meta, process)
    self.batches = prefetch.DevicePrefetcher(self.steps.batch_sharding, reopen=lambda k: iter(
        loader.make_dataset(config, meta, "train", train=True, start_batch=k, **process)))
    self.eval_batches = loader.make_dataset(config, meta, "validation", train=False, **process)

  def resumed(self, step: int) -> None:
    if step < int(self.config.train.steps):  # a finished run: main says so, once
      logging.info("resumed from %s", ckpt_lib.step_dir(self.workdir, step))

  def init_state(self):
    state = self.steps.init(jax.random.key(self.config.train.seed))
    if self.config.init_from:  # step 0 from a BertForMaskedLM directory (hf_convert)
      state = hf_convert.init_state(self.config.init_from, state, self.steps, self.setup)
    return state

  def make_log(self, start: int, checkpointer) -> TrainLog:
    return TrainLog(self.setup, self.workdir, start, checkpointer, self.batches)

  def evaluate(self, state) -> dict:
    return evaluate(self.steps, state.params, self.eval_batches)

  def report_preempted(self, step: int, total: int, checkpoint: str) -> None:
    logging.warning("preempted: stopped after step %d of %d; checkpoint %s saved. Rerun the "
                    "same command to continue from it.", step, total, checkpoint)

  def close(self) -> None:
    if self.batches is not None:
      self.batches.close()

  def result(self, log, state) -> dict:
    return {**log.last, "step": int(jax.device_get(state.step))}
