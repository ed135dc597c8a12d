"""A contrastive fine-tuning run for binary code similarity (jTrans' recipe: pretrain, then
fine-tune): the encoder, a pooling and a projection head (:mod:`lmscale_jax.model.contrastive`)
trained with symmetric InfoNCE over in-batch negatives on pairs of one function compiled two ways
(:mod:`lmscale_jax.finetune.pairs`).

  finetune(config, workdir)   # config: get_config() with data.pairs and init.* set

Start (shared with every fine-tuning task: :mod:`lmscale_jax.finetune.base_run`): a pretraining
workdir's checkpoint (``init.source="workdir"``), an HF directory (``"hf"``), or fresh weights
of a run's or HF directory's architecture (``"random"``: the baseline "random init +
fine-tune"; the weights ``eval_similarity.py``'s random-init row has for the same seed).
``finetune.freeze_layers=k`` freezes the embeddings and the k lowest layers (their gradients
are stopped and their updates zeroed: ``optax.multi_transform``); the MLM head, outside the
loss, is always frozen and kept, so the encoder still exports as a ``BertForMaskedLM``.

The run is the one loop of every run (lmscale_jax/train/run_loop.py) in a workdir like
pretraining's (lmscale_jax/train/workdir.py, run_record.py, checkpoint.py): its lock,
``config.json`` (this config, ``model`` the encoder's resolved keys, a resume under changed
keys refused by the same rules), ``metrics.jsonl``, ``run_state.json``, ``checkpoints/<step>``
(train state + the batch sampler's position) and ``tokenizer.json`` (the model's own, so the
workdir is a usable model by itself: ``trained_model.load(workdir=...)``). A killed run,
rerun, resumes from its newest checkpoint that verifies, and its losses after it are the
uninterrupted run's, bit for bit (batches and dropout keyed by (seed, step)).

The step is every run's (:mod:`lmscale_jax.train.steps`) with the contrastive task
(:func:`contrastive_task`), so it has every lever of ``train.*``: FSDP,
gradient accumulation, the gradient reduction's dtype and shape, remat, ``train.nonfinite``.
Pair rows split over the ``data`` axis of the pretraining mesh; the similarity matrix spans the
global batch (the embeddings gathered, also over microbatches). Several processes start like
``python -m lmscale_jax.main`` (``distributed.initialize(config)``; lmscale finetune).
"""

from __future__ import annotations

from typing import Callable

import jax
from absl import logging

from lmscale_jax.config import finetune as finetune_config
from lmscale_jax.errors import ConfigError  # noqa: F401 (tests use it here)
from lmscale_jax.finetune import base_run, finetune_state
from lmscale_jax.finetune import pairs as finetune_pairs
from lmscale_jax.model import bert as model_lib
from lmscale_jax.model import contrastive
from lmscale_jax.train import checkpoint as ckpt_lib
from lmscale_jax.train import metrics as metrics_lib
from lmscale_jax.train import steps as steps_lib
from lmscale_jax.train import tasks
# What tests and tools reach through this module (the shared code lives in base_run).
from lmscale_jax.finetune.base_run import (  # noqa: F401
    TOKENIZER, finetune_cfg, load_start, place, resumed_model)
from lmscale_jax.finetune.finetune_state import trainable_labels  # noqa: F401

get_config, check_config = finetune_config.get_config, finetune_config.check_config


# ----------------------------------------------------------------------------- steps
def contrastive_task(model, labels: Callable, temperature: float, pad_id: int) -> tasks.BatchTask:
  """Fine-tuning's symmetric InfoNCE over in-batch negatives (:func:`contrastive.info_nce`) on
  batches of pair rows ``ids [B, 2, S]`` (anchor, positive). ``labels(params)``: "frozen" or
  "train" per leaf (:func:`stop_frozen`)."""

  def embed(params, ids, rng):
    b, _, s = ids.shape
    frozen = finetune_state.stop_frozen(params, labels)
    return model.apply({"params": frozen}, ids.reshape(2 * b, s),
                       deterministic=False, rngs={"dropout": rng}).reshape(b, 2, -1)

  def loss(z):
    value, accuracy = contrastive.info_nce(z[:, 0], z[:, 1], temperature)
    return value, {"accuracy": accuracy}

  return tasks.BatchTask(embed=embed, loss=loss,
                         sums=lambda ids: {"tokens": (ids != pad_id).sum()},
                         compute_cast=finetune_state.head_in_float32("projection"))


def build_steps(config, cfg, mesh=None, *, manual: bool | None = None) -> steps_lib.Steps:
  """The model, optimizer, shardings and jitted init/step of a fine-tuning run: the one train
  step (:func:`steps_lib.build_task_steps`) of the contrastive task, with every lever of
  ``config.train``. ``init``: (encoder params, rng) -> TrainState; ``train_step``: (state,
  ids [B,2,S]) -> (state, metrics)."""
  f = config.finetune
  model = contrastive.ContrastiveEncoder(cfg, int(f.proj_dim), str(f.pool))
  optimizer, labels = finetune_state.optimizer(config)
  init_state = finetune_state.init_fn(config, cfg, optimizer)
  bert = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.key(0)))
  task = contrastive_task(model, labels, float(f.temperature), int(cfg.pad_id))
  return steps_lib.build_task_steps(config, task, model, optimizer, init_state,
                                    (bert, jax.random.key(0)), compute_dtype=str(cfg.dtype),
                                    mesh=mesh, manual=manual)


# ----------------------------------------------------------------------------- logging
NonFiniteLoss = metrics_lib.NonFiniteLoss  # every run's (train.nonfinite)


class ContrastiveLog(base_run.FinetuneLog):
  """Fine-tuning's rows (:class:`base_run.FinetuneLog`): InfoNCE loss, in-batch accuracy,
  pairs and tokens per second, the batches' ``truncated_frac``."""

  rows = "pairs"
  advice = ("Lower train.learning_rate or raise finetune.temperature (train.nonfinite=skip "
            "skips such steps instead)")


# ----------------------------------------------------------------------------- the run
def check_inputs(config, workdir: str) -> finetune_pairs.Pairs:
  """The task's checks that need no runtime and write nothing (the start model's are
  :func:`base_run.check`'s): the config, the pairs file. → the pairs."""
  check_config(config)
  pairs = finetune_pairs.load(config.data.pairs, config.data.max_groups, config.train.seed)
  finetune_pairs.check_enough(pairs, config.train.batch_size)
  return pairs


def finetune(config, workdir: str, *, allow_config_change: bool = False,
             inputs: base_run.Checked | None = None,
             say: Callable[[str], None] = logging.info, checked: bool = False) -> dict:
  """Fine-tunes (resuming from ``workdir`` if it holds a checkpoint); returns the last row.
  ``inputs``: ``base_run.check``'s result (the pairs, the start model read) if the caller
  has it; ``checked``: see ``base_run.run_finetune``."""
  inputs = inputs or base_run.check(config, workdir, check_inputs)
  return base_run.run_finetune(ContrastiveFinetune(config, workdir, inputs, say),
                               allow_config_change, checked)


def done_line(row: dict, workdir: str) -> str:
  """``lmscale finetune``'s last words after a finished run: its accuracy, the model."""
  return (f"in-batch accuracy {row.get('accuracy', 0.0):.3f}; the model: {workdir} (lmscale "
          "embed --workdir, lmscale eval-similarity --workdir, lmscale export-hf --workdir)")


class ContrastiveFinetune(base_run.FinetuneRun):
  """Contrastive fine-tuning in the one loop: batches of pairs
  (:class:`finetune_pairs.PairBatches`, its position saved), no evaluation,
  :class:`ContrastiveLog`'s rows."""

  def __init__(self, config, workdir: str, inputs: base_run.Checked,
               say: Callable[[str], None]):
    super().__init__(config, workdir, say, inputs.start)
    self.pairs = inputs.data

  def check_resume(self, step: int) -> None:  # refused before anything is written
    finetune_pairs.check_resume(self.pairs, ckpt_lib.step_dir(self.workdir, step),
                                jax.process_index(), jax.process_count())

  def build(self) -> None:
    t = self.config.train
    self.steps = build_steps(self.config, self.model.cfg)
    self.batches = finetune_pairs.PairBatches(self.pairs, self.model, seed=t.seed,
                                              batch_size=t.batch_size,
                                              process_index=jax.process_index(),
                                              process_count=jax.process_count())

  def describe(self) -> str:
    config, pairs = self.config, self.pairs
    subset = " (a seeded subset: data.max_groups)" if config.data.max_groups else ""
    return (f"{len(pairs)} groups{subset} from {pairs.path} ({pairs.dropped} with one variant "
            f"left out), head {self.model.cfg.hidden}→{config.finetune.proj_dim} "
            f"({config.finetune.pool} pooling)")

  def make_log(self, start: int, checkpointer) -> ContrastiveLog:
    return ContrastiveLog(self.config, self.workdir, start, checkpointer, self.batches, self.say)
