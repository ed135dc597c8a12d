"""A contrastive fine-tuning run for binary code similarity (jTrans' recipe: pretrain, then
fine-tune): the encoder, a pooling and a projection head (:mod:`lmscale_jax.model.contrastive`)
trained with symmetric InfoNCE over in-batch negatives on pairs of one function compiled two ways
(:mod:`lmscale_jax.finetune.pairs`).

  finetune(config, workdir)   # config: get_config() with data.pairs and init.* set

Start: a pretraining workdir's checkpoint (``init.source="workdir"``), an HF directory
(``"hf"``), or fresh weights of a run's or HF directory's architecture (``"random"``: the
baseline "random init + fine-tune"; the weights ``eval_similarity.py``'s random-init row has
for the same seed). ``finetune.freeze_layers=k`` freezes the embeddings and the k lowest
layers (their gradients are stopped and their updates zeroed: ``optax.multi_transform``); the
MLM head, outside the loss, is always frozen and kept, so the encoder still exports as a
``BertForMaskedLM``.

The run is the one loop of every run (lmscale_jax/train/run_loop.py) in a workdir like
pretraining's (lmscale_jax/train/workdir.py, checkpoint.py): its lock,
``config.json`` (this config, ``model`` the encoder's resolved keys, a resume under changed
keys refused by the same rules), ``metrics.jsonl``, ``run_state.json``, ``checkpoints/<step>``
(train state + the batch sampler's position) and ``tokenizer.json`` (the model's own, so the
workdir is a usable model by itself: ``trained_model.load(workdir=...)``). A killed run,
rerun, resumes from its newest checkpoint that verifies, and its losses after it are the
uninterrupted run's, bit for bit (batches and dropout keyed by (seed, step)).

The step is pretraining's (:mod:`lmscale_jax.train.steps`) with the contrastive task
(:func:`lmscale_jax.train.tasks.contrastive_task`), so it has every lever of ``train.*``: FSDP,
gradient accumulation, the gradient reduction's dtype and shape, remat, ``train.nonfinite``.
Pair rows split over the ``data`` axis of the pretraining mesh; the similarity matrix spans the
global batch (the embeddings gathered, also over microbatches). Several processes start like
``python -m lmscale_jax.main`` (``distributed.initialize(config)``; lmscale finetune).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Callable

import jax
import ml_collections
import numpy as np
from absl import logging

from lmscale_jax.config import checks as config_checks
from lmscale_jax.config import defaults as config_defaults
from lmscale_jax.config import finetune as finetune_config
from lmscale_jax.errors import ConfigError, UserError
from lmscale_jax.finetune import pairs as finetune_pairs
from lmscale_jax.inference import model_files, trained_model
from lmscale_jax.model import contrastive
from lmscale_jax.store import dataset, file_io
from lmscale_jax.train import checkpoint as ckpt_lib
from lmscale_jax.model import bert as model_lib
from lmscale_jax.train import finetune_state
from lmscale_jax.train import steps as steps_lib
from lmscale_jax.train import tasks
from lmscale_jax.train import metrics as metrics_lib
from lmscale_jax.train import run_loop
from lmscale_jax.train import workdir as workdir_lib
from lmscale_jax.train.finetune_state import trainable_labels  # noqa: F401 (tests use it here)

TOKENIZER = dataset.TOKENIZER  # the workdir's copy of the model's tokenizer
get_config, check_config = finetune_config.get_config, finetune_config.check_config


# ----------------------------------------------------------------------------- the model
MODEL_KEYS = tuple(config_defaults.get_base_config().model.keys())


def load_start(config) -> trained_model.TrainedModel:
  """The model step 0 starts from (its encoder parameters, resolved config, tokenizer)."""
  init = config.init
  if init.source == "workdir":
    return trained_model.from_workdir(init.path, None if init.step < 0 else init.step,
                                      init.tokenizer)
  if init.source == "hf":
    return trained_model.from_hf(init.path)
  return trained_model.random_init(trained_model.architecture(init.path, init.tokenizer),
                                   config.train.seed)


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
  return trained_model.architecture(workdir)


# ----------------------------------------------------------------------------- steps
def build_steps(config, cfg, mesh=None, *, manual: bool | None = None) -> steps_lib.Steps:
  """The model, optimizer, shardings and jitted init/step of a fine-tuning run: the one train
  step (:func:`steps_lib.build_task_steps`) of the contrastive task, with every lever of
  ``config.train``. ``init``: (encoder params, rng) -> TrainState; ``train_step``: (state,
  ids [B,2,S]) -> (state, metrics)."""
  t, f = config.train, config.finetune
  model = contrastive.ContrastiveEncoder(cfg, int(f.proj_dim), str(f.pool))
  optimizer, labels = finetune_state.optimizer(config)
  init_state = finetune_state.init_fn(config, cfg, optimizer)
  bert = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.key(0)))
  task = tasks.contrastive_task(model, labels, float(f.temperature), int(cfg.pad_id))
  return steps_lib.build_task_steps(config, task, model, optimizer, init_state,
                                    (bert, jax.random.key(0)), compute_dtype=str(cfg.dtype),
                                    mesh=mesh, manual=manual)


def place(tree, shardings):
  """Host arrays → global arrays (every process holds the same values: replicated)."""
  return jax.tree.map(lambda a, sh: jax.make_array_from_callback(
      np.shape(a), sh, lambda index: np.asarray(a)[index]), tree, shardings)


# ----------------------------------------------------------------------------- logging
NonFiniteLoss = metrics_lib.NonFiniteLoss  # every run's (train.nonfinite)


class ContrastiveLog(metrics_lib.StepLog):
  """Fine-tuning's rows (:class:`metrics_lib.StepLog`): InfoNCE loss, in-batch accuracy,
  pairs and tokens per second, the batches' ``truncated_frac``; its console line through
  ``say``."""

  advice = ("Lower train.learning_rate or raise finetune.temperature (train.nonfinite=skip "
            "skips such steps instead)")

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
            "accuracy": float(np.mean([m["accuracy"] for m in good])),
            "learning_rate": float(host[-1]["learning_rate"]),
            "grad_norm": float(good[-1]["grad_norm"]),
            **{k: rates[k] for k in ("samples_per_sec", "tokens_per_sec", "step_time")},
            "truncated_frac": self.batches.truncated_fraction}

  def write(self, step: int, row: dict) -> None:
    super().write(step, row)
    self.last["step"] = step

  def console(self, step: int, row: dict) -> None:
    rate = f" | pairs/s {row['samples_per_sec']:.1f}" if row["samples_per_sec"] else ""
    self.say(f"step {step}/{self.train_config.steps} | loss {row['loss']:.4f} | accuracy "
             f"{row['accuracy']:.3f} | lr {row['learning_rate']:.2e}{rate}")


# ----------------------------------------------------------------------------- the run
def check_inputs(config, workdir: str) -> finetune_pairs.Pairs:
  """The checks that need no runtime and write nothing: the config, the pairs file, and (a
  new run) the model to start from. → the pairs."""
  check_config(config)
  pairs = finetune_pairs.load(config.data.pairs, config.data.max_groups, config.train.seed)
  finetune_pairs.check_enough(pairs, config.train.batch_size)
  check_workdir(workdir)
  fresh = not os.path.isdir(workdir) or ckpt_lib.latest_complete_step(workdir) is None
  if fresh and not os.path.isdir(config.init.path):
    raise UserError(f"init.path={config.init.path} (--init-{config.init.source}): no such "
                    "directory")
  if fresh:  # its config and tokenizer read now: a bad start model leaves no empty workdir
    trained_model.architecture(config.init.path, config.init.tokenizer)
  return pairs


def check_workdir(workdir: str) -> None:
  """A workdir that holds a run already holds a fine-tuning run: a pretraining run's would
  otherwise be "resumed" (its data state has no pairs file, its step may be past --steps)."""
  if not os.path.exists(os.path.join(workdir, model_files.RUN_CONFIG)):
    return
  run_config, _ = model_files.read_run(workdir)  # a damaged config.json: its one line
  if not trained_model.is_finetuned(run_config):
    raise UserError(f"--workdir {workdir} holds a pretraining run (its config.json has no "
                    "'finetune' section), not a fine-tuning run to resume: give a new "
                    f"--workdir, and --init-workdir {workdir} to start from that run")


def finetune(config, workdir: str, *, allow_config_change: bool = False, pairs=None,
             say: Callable[[str], None] = logging.info) -> dict:
  """Fine-tunes (resuming from ``workdir`` if it holds a checkpoint); returns the last row.
  ``pairs``: :func:`check_inputs`' result if the caller has it. A single-process caller gets
  the workdir's lock here; a multi-process one takes it as ``main`` does (process 0,
  ``distributed.agree``)."""
  pairs = pairs or check_inputs(config, workdir)
  took = jax.process_count() == 1 and workdir_lib.lock_workdir(workdir)
  try:
    return _finetune(copy.deepcopy(config), workdir, pairs, allow_config_change, say)
  finally:
    if took:
      workdir_lib.unlock_workdir(workdir)


def _finetune(config, workdir: str, pairs, allow_config_change: bool, say) -> dict:
  t = config.train
  say = say if jax.process_index() == 0 else (lambda line: None)
  config_checks.check_batch(t.batch_size, processes=jax.process_count(),
                            devices_per_process=jax.local_device_count(),
                            accum_steps=t.grad_accum_steps)
  return run_loop.run(ContrastiveFinetune(config, workdir, pairs, say), config, workdir,
                      allow_config_change=allow_config_change)


class ContrastiveFinetune(run_loop.RunTask):
  """Contrastive fine-tuning in the one loop (:mod:`lmscale_jax.train.run_loop`): batches of
  pairs (:class:`finetune_pairs.PairBatches`, its position saved), step 0 from a start model
  (:func:`load_start`), no evaluation, :class:`ContrastiveLog`'s rows, its words through
  ``say``; Ctrl-C leaves as the KeyboardInterrupt itself."""

  def __init__(self, config, workdir: str, pairs, say: Callable[[str], None]):
    self.config, self.workdir, self.pairs, self.say = config, workdir, pairs, say
    self.start_model = self.model = None

  def past_end_advice(self, step: int) -> str:
    return "; give a larger --steps to continue it, or another --workdir"

  def check_resume(self, step: int) -> None:  # refused before anything is written
    finetune_pairs.check_resume(self.pairs, ckpt_lib.step_dir(self.workdir, step),
                                jax.process_index(), jax.process_count())

  def model_cfg(self, resume_step: int | None):
    config = self.config
    self.start_model = load_start(config) if resume_step is None else None
    model = self.start_model or resumed_model(self.workdir)
    self.model = dataclasses.replace(model, cfg=finetune_cfg(config, model.cfg))
    config.model = {k: self.model.cfg[k] for k in MODEL_KEYS}
    return self.model.cfg

  def open(self, checkpointer) -> None:
    config, model, t = self.config, self.model, self.config.train
    if jax.process_index() == 0 and self.start_model is not None:
      file_io.atomic_write_bytes(os.path.join(self.workdir, TOKENIZER),
                                 model.tokenizer.to_str().encode())
    self.steps = build_steps(config, model.cfg)
    self.batches = finetune_pairs.PairBatches(self.pairs, model, seed=t.seed,
                                              batch_size=t.batch_size,
                                              process_index=jax.process_index(),
                                              process_count=jax.process_count())

  def resumed(self, step: int) -> None:
    if self.batches.next_step != step + 1:  # the sampler's position is saved with the state
      raise ckpt_lib.CheckpointCorrupt(
          f"{ckpt_lib.step_dir(self.workdir, step)}: its batch position is step "
          f"{self.batches.next_step}, its state step {step}; move the checkpoint aside")
    self.say(f"resumed from {ckpt_lib.step_dir(self.workdir, step)}")

  def init_state(self):
    config, model, pairs = self.config, self.model, self.pairs
    bert = place(self.start_model.params, self.steps.state_sharding.params["bert"])
    state = self.steps.init(bert, jax.random.fold_in(jax.random.key(config.train.seed), 1))
    subset = " (a seeded subset: data.max_groups)" if config.data.max_groups else ""
    self.say(f"fine-tuning {self.start_model.source}: {len(pairs)} groups{subset} from "
             f"{pairs.path} ({pairs.dropped} with one variant left out), {model.cfg.layers} "
             f"layers × {model.cfg.hidden}, head {model.cfg.hidden}→"
             f"{config.finetune.proj_dim} ({config.finetune.pool} pooling), "
             f"{jax.device_count()} device(s)")
    return state

  def make_log(self, start: int, checkpointer) -> ContrastiveLog:
    return ContrastiveLog(self.config, self.workdir, start, checkpointer, self.batches, self.say)

  def next_batch(self):
    return jax.make_array_from_process_local_data(self.steps.batch_sharding, next(self.batches))

  def report_preempted(self, step: int, total: int, checkpoint: str) -> None:
    self.say(f"preempted: stopped after step {step} of {total}; checkpoint {checkpoint} saved. "
             "Rerun the same command to continue")
