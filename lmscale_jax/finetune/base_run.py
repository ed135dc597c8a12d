"""What every fine-tuning run shares, whatever its task (contrastive: contrastive_run.py;
classification: classify_run.py): the model step 0 starts from, the encoder's config as
fine-tuning runs it, the refusals before any work, the workdir's lock, and the hooks of the one
loop (:class:`FinetuneRun`: the start model, its tokenizer copied into the workdir, the resume
check, the step-0 state, the batches' placement) with its log (:class:`FinetuneLog`).

Start: a pretraining workdir's checkpoint (``init.source="workdir"``), an HF directory
(``"hf"``), or fresh weights of a run's or HF directory's architecture (``"random"``). A task
supplies its head and its batches; freezing (``finetune.freeze_layers``) is the optimizer's
(:func:`lmscale_jax.finetune.finetune_state.optimizer`).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Callable

import jax
import ml_collections
import numpy as np

from lmscale_jax.config import checks as config_checks
from lmscale_jax.config import defaults as config_defaults
from lmscale_jax.errors import ConfigError, UserError
from lmscale_jax.inference import model_dir, model_files, trained_model
from lmscale_jax.store import dataset, file_io
from lmscale_jax.train import checkpoint as ckpt_lib
from lmscale_jax.train import metrics as metrics_lib
from lmscale_jax.train import run_loop
from lmscale_jax.train import workdir as workdir_lib

TOKENIZER = dataset.TOKENIZER  # the workdir's copy of the model's tokenizer
MODEL_KEYS = tuple(config_defaults.get_base_config().model.keys())


# ----------------------------------------------------------------------------- the model
def read_start(config) -> model_dir.ModelDir:
  """The start model's directory, read and checked once (its config and tokenizer; the
  weights are :func:`load_start`'s): a run's workdir (``init.source="workdir"``), an HF
  directory (``"hf"``), or either (``"random"``: only its architecture is used)."""
  init = config.init
  if not os.path.isdir(init.path):
    raise UserError(f"init.path={init.path} (--init-{init.source}): no such directory")
  is_hf = model_files.is_hf_dir(init.path)  # the kind first: the wrong one is not read
  if init.source in ("workdir", "hf") and is_hf != (init.source == "hf"):
    other = ("a Hugging Face model directory: give --init-hf" if is_hf else
             "a training run's workdir: give --init-workdir")
    raise UserError(f"init.path={init.path} (--init-{init.source}) is {other} {init.path}")
  tokenizer = "" if init.source == "hf" else init.tokenizer
  if is_hf:
    return model_dir.read_hf(init.path, tokenizer)
  return model_dir.read_run(init.path, tokenizer)


def load_start(config, read: model_dir.ModelDir | None = None) -> trained_model.TrainedModel:
  """The model step 0 starts from (its encoder parameters, resolved config, tokenizer): the
  weights of the directory :func:`check_start` read (read here if it was not)."""
  init, read = config.init, read or read_start(config)
  if init.source == "random":
    return trained_model.random_init(trained_model.architecture(read), config.train.seed)
  return trained_model.from_dir(read, None if init.step < 0 else init.step)


def finetune_cfg(config, cfg) -> ml_collections.ConfigDict:
  """The encoder's resolved config as fine-tuning runs it (compute dtype, dropout)."""
  cfg = ml_collections.ConfigDict(cfg.to_dict())
  cfg.dtype, cfg.dropout = config.finetune.dtype, float(config.finetune.dropout)
  cfg.remat = str(config.train.remat)  # what the backward pass recomputes (pretraining's lever)
  if config.finetune.freeze_layers > cfg.layers:
    raise ConfigError(f"finetune.freeze_layers={config.finetune.freeze_layers}, but the model "
                      f"({config.init.path}) has {cfg.layers} layers")
  return cfg


def resumed_model(workdir: str) -> trained_model.TrainedModel:
  """A resume needs no start model: the encoder's config is in config.json, its tokenizer in
  the workdir."""
  return trained_model.architecture(model_dir.read_run(workdir))


def place(tree, shardings):
  """Host arrays → global arrays (every process holds the same values: replicated)."""
  return jax.tree.map(lambda a, sh: jax.make_array_from_callback(
      np.shape(a), sh, lambda index: np.asarray(a)[index]), tree, shardings)


# ----------------------------------------------------------------------------- refusals
@dataclasses.dataclass
class Checked:
  """What a fine-tune's checks read, before any runtime, passed down once: the task's inputs
  (its ``check_inputs``': pairs, labels files) and, a new run, the start model's directory."""
  data: object
  start: model_dir.ModelDir | None = None


def check(config, workdir: str, check_inputs: Callable) -> Checked:
  """A task's checks (``check_inputs(config, workdir)``: its config and files), then the
  workdir's and the start model's (:func:`check_start`); nothing is written."""
  data = check_inputs(config, workdir)
  return Checked(data=data, start=check_start(config, workdir))


def check_start(config, workdir: str) -> model_dir.ModelDir | None:
  """The workdir holds nothing or a fine-tuning run of this task, and (a new run) the start
  model's directory, read: a bad start model leaves no empty workdir. → what was read (None:
  a resume, which needs no start model)."""
  check_workdir(workdir, str(config.finetune.task))
  fresh = not os.path.isdir(workdir) or ckpt_lib.latest_complete_step(workdir) is None
  return read_start(config) if fresh else None


def check_workdir(workdir: str, task: str) -> None:
  """A workdir that holds a run already holds a fine-tuning run of ``task``: a pretraining
  run's would otherwise be "resumed" (its data state has no pairs file, its step may be past
  --steps), another task's would restore into another head."""
  if not os.path.exists(os.path.join(workdir, model_files.RUN_CONFIG)):
    return
  run_config, _ = model_files.read_run(workdir)  # a damaged config.json: its one line
  if not model_dir.is_finetuned(run_config):
    raise UserError(f"--workdir {workdir} holds a pretraining run (its config.json has no "
                    "'finetune' section), not a fine-tuning run to resume: give a new "
                    f"--workdir, and --init-workdir {workdir} to start from that run")
  if run_config.finetune.task != task:
    raise UserError(f"--workdir {workdir} holds a --task {run_config.finetune.task} fine-tuning "
                    f"run, not a --task {task} one to resume: give a new --workdir")


# ----------------------------------------------------------------------------- the run
def run_finetune(task: "FinetuneRun", allow_config_change: bool,
                 checked: bool = False) -> dict:
  """Runs ``task`` in the one loop (its config and workdir); returns its last row. A
  single-process caller gets the workdir's lock here; a multi-process one takes it as ``main``
  does (process 0, ``distributed.agree``). ``checked``: the command's start-up checked the
  batch over the job's devices (``train/preflight``); a library caller's is checked here."""
  config, workdir, t = task.config, task.workdir, task.config.train
  with workdir_lib.holding(workdir):
    if not checked:
      config_checks.check_batch(t.batch_size, processes=jax.process_count(),
                                devices_per_process=jax.local_device_count(),
                                accum_steps=t.grad_accum_steps)
    return run_loop.run_task(task, config, workdir, allow_config_change=allow_config_change)


class FinetuneRun(run_loop.RunTask):
  """A fine-tuning task in the one loop (:mod:`lmscale_jax.train.run_loop`): step 0 from a
  start model (:func:`load_start`), its words through ``say`` (process 0's); Ctrl-C leaves as
  the KeyboardInterrupt itself. A subclass sets ``steps`` and ``batches`` in :meth:`build`
  and says what it trains in :meth:`describe`."""

  def __init__(self, config, workdir: str, say: Callable[[str], None],
               start: model_dir.ModelDir | None = None):
    self.config, self.workdir = copy.deepcopy(config), workdir
    self.say = say if jax.process_index() == 0 else (lambda line: None)
    self.start = start  # the start model's directory as the checks read it (Checked.start)
    self.start_model = self.model = None

  def build(self) -> None:
    raise NotImplementedError

  def describe(self) -> str:
    raise NotImplementedError

  def past_end_advice(self, step: int) -> str:
    return "; give a larger --steps to continue it, or another --workdir"

  def model_cfg(self, resume_step: int | None):
    config = self.config
    self.start_model = load_start(config, self.start) if resume_step is None else None
    model = self.start_model or resumed_model(self.workdir)
    self.model = dataclasses.replace(model, cfg=finetune_cfg(config, model.cfg))
    config.model = {k: self.model.cfg[k] for k in MODEL_KEYS}
    return self.model.cfg

  def open(self, checkpointer) -> None:
    if jax.process_index() == 0 and self.start_model is not None:
      file_io.atomic_write_bytes(os.path.join(self.workdir, TOKENIZER),
                                 self.model.tokenizer.to_str().encode())
    self.build()

  def resumed(self, step: int) -> None:
    if self.batches.next_step != step + 1:  # the sampler's position is saved with the state
      raise ckpt_lib.CheckpointCorrupt(
          f"{ckpt_lib.step_dir(self.workdir, step)}: its batch position is step "
          f"{self.batches.next_step}, its state step {step}; move the checkpoint aside")
    self.say(f"resumed from {ckpt_lib.step_dir(self.workdir, step)}")

  def init_state(self):
    bert = place(self.start_model.params, self.steps.state_sharding.params["bert"])
    state = self.steps.init(bert, jax.random.fold_in(jax.random.key(self.config.train.seed), 1))
    cfg = self.model.cfg
    self.say(f"fine-tuning {self.start_model.source}: {self.describe()}, {cfg.layers} layers × "
             f"{cfg.hidden}, {jax.device_count()} device(s)")
    return state

  def next_batch(self):
    batch = next(self.batches)
    shardings = jax.tree.map(lambda _: self.steps.batch_sharding, batch)
    return jax.make_array_from_process_local_data(shardings, batch)

  def report_preempted(self, step: int, total: int, checkpoint: str) -> None:
    self.say(f"preempted: stopped after step {step} of {total}; checkpoint {checkpoint} saved. "
             "Rerun the same command to continue")


class FinetuneLog(metrics_lib.StepLog):
  """A fine-tuning run's rows (:class:`metrics_lib.StepLog`): the loss, the task's accuracy,
  learning rate, gradient norm, rows and tokens per second, the batches' ``truncated_frac``;
  its console line through ``say`` (``rows``: what a row of the batch is called there)."""

  rows = "rows"
  score = "accuracy"  # the task's batch metric (the naming task's: f1)

  def __init__(self, config, workdir: str, start: int, checkpointer, batches,
               say: Callable[[str], None]):
    super().__init__(config.train, workdir, start)
    self.checkpointer, self.batches, self.say = checkpointer, batches, say

  def last_good(self) -> str:
    latest = self.checkpointer.latest_step()
    return ckpt_lib.step_dir(self.workdir, latest) if latest is not None else "none"

  def make_row(self, window, host: list, good: list) -> dict:
    timed = host[window.untimed:]
    rates = metrics_lib.throughput(
        steps=len(timed), seconds=window.seconds, wait_seconds=0.0,
        global_batch=self.train_config.batch_size,
        tokens=float(sum(m["tokens"] for m in timed)), flops_per_step=0.0,
        peak_flops_total=None)
    return {"loss": float(np.mean([m["loss"] for m in good])),
            self.score: float(np.mean([m[self.score] for m in good])),
            "learning_rate": float(host[-1]["learning_rate"]),
            "grad_norm": float(good[-1]["grad_norm"]),
            **{k: rates[k] for k in ("samples_per_sec", "tokens_per_sec", "step_time")},
            "truncated_frac": self.batches.truncated_fraction}

  def write(self, step: int, row: dict) -> None:
    super().write(step, row)
    self.last["step"] = step

  def console(self, step: int, row: dict) -> None:
    if "loss" not in row:  # an evaluation row: the task's own line
      return
    rate = f" | {self.rows}/s {row['samples_per_sec']:.1f}" if row["samples_per_sec"] else ""
    self.say(f"step {step}/{self.train_config.steps} | loss {row['loss']:.4f} | {self.score} "
             f"{row[self.score]:.3f} | lr {row['learning_rate']:.2e}{rate}")
