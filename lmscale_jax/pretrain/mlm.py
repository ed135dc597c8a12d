"""Pretraining's task: the masked-language-model loss (:func:`mlm_task`, a
:class:`~lmscale_jax.train.tasks.SumTask` for the one train step of :mod:`lmscale_jax.train.steps`),
its eval step, and :func:`build_steps`, the placed steps of a pretraining run
(:func:`build_eval_step`: the eval step alone, for scoring a checkpoint: ``lmscale evaluate``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lmscale_jax.model import bert as model_lib
from lmscale_jax.train import optim, sharding
from lmscale_jax.train.sharding import AXIS
from lmscale_jax.train.steps import Steps, TrainState, build_task_steps
from lmscale_jax.train.tasks import SumTask


def mlm_loss(logits, labels, weights):
  """Weighted mean cross-entropy over predicted positions, plus (correct, weight) sums."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
  wsum = jnp.maximum(weights.sum(), 1.0)
  correct = ((jnp.argmax(logits, -1) == labels) * weights).sum()
  return (ce * weights).sum() / wsum, (ce * weights).sum(), correct, weights.sum()


def mlm_task(model, pad_id: int) -> SumTask:
  """Pretraining's masked-language-model loss over batches of ``input_ids``,
  ``mlm_positions``, ``mlm_labels`` and ``mlm_weights``."""

  def loss_sum(params, batch, rng):
    logits = model.apply({"params": params}, batch["input_ids"], batch["mlm_positions"],
                         deterministic=False, rngs={"dropout": rng})
    _, ce_sum, correct, _ = mlm_loss(logits, batch["mlm_labels"], batch["mlm_weights"])
    return ce_sum, {"correct": correct, "tokens": (batch["input_ids"] != pad_id).sum()}

  def metrics(sums):
    return {"mlm_accuracy": sums["correct"] / jnp.maximum(sums["weight"], 1.0),
            "tokens": sums["tokens"]}

  return SumTask(loss_sum=loss_sum, weight=lambda batch: batch["mlm_weights"].sum(),
                 metrics=metrics)


def make_eval_step(model):
  def eval_step(params, batch):
    logits = model.apply({"params": params}, batch["input_ids"], batch["mlm_positions"],
                         deterministic=True)
    _, ce_sum, correct, wsum = mlm_loss(logits, batch["mlm_labels"],
                                              batch["mlm_weights"])
    return {"ce_sum": ce_sum, "correct": correct, "weight": wsum}

  return eval_step


@dataclasses.dataclass
class EvalStep:
  """The MLM eval step alone, placed (``lmscale evaluate``): no optimizer, no TrainState."""
  mesh: Mesh
  model: Any
  batch_sharding: Any
  abstract_params: Any     # ShapeDtypeStructs carrying the params' shardings (restore target)
  eval_step: Any           # (params, batch) -> sums, jitted


def build_eval_step(model_cfg: ml_collections.ConfigDict, mesh: Mesh | None = None, *,
                    fsdp: bool = False) -> EvalStep:
  """:func:`build_steps`' eval step without what training needs besides: the parameters
  placed as training places them (replicated, or per ``fsdp``: :func:`sharding.state_specs`),
  the batch split over the ``data`` axis. Scoring a checkpoint builds no optimizer and reads
  no Adam moment (``model_files.restore_params`` of ``abstract_params``)."""
  if mesh is None:
    mesh = sharding.data_mesh()
  model = model_lib.BertForMLM(model_cfg)
  abstract = jax.eval_shape(lambda: model_lib.init_params(model_cfg, jax.random.key(0)))
  specs = sharding.state_specs(abstract, mesh.shape[AXIS], fsdp)
  params_sharding = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                 is_leaf=lambda x: isinstance(x, PartitionSpec))
  abstract = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                          abstract, params_sharding)
  batch_sharding = sharding.batch_sharding(mesh)
  eval_step = jax.jit(make_eval_step(model), in_shardings=(params_sharding, batch_sharding),
                      out_shardings=NamedSharding(mesh, PartitionSpec()))
  return EvalStep(mesh=mesh, model=model, batch_sharding=batch_sharding,
                  abstract_params=abstract, eval_step=eval_step)


def build_steps(config: ml_collections.ConfigDict, model_cfg: ml_collections.ConfigDict,
                predictions: int, mesh: Mesh | None = None, *,
                manual: bool | None = None) -> Steps:
  """Pretraining's model, optimizer, shardings and jitted init/train/eval functions
  (:func:`build_task_steps` of the MLM task).

  ``manual`` forces (True) or forbids (False) the shard_map gradient path; None picks it
  from the config (:func:`~lmscale_jax.train.manual_grads.needs_manual_grads`)."""
  t = config.train
  model = model_lib.BertForMLM(model_cfg)
  optimizer = optim.make_optimizer(t)

  def init_state(rng):
    params = model_lib.init_params(model_cfg, rng, predictions=predictions)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(params))

  return build_task_steps(config, mlm_task(model, model_cfg.pad_id), model, optimizer,
                          init_state, (jax.random.key(t.seed),),
                          compute_dtype=model_cfg.dtype, mesh=mesh, manual=manual,
                          eval_step=make_eval_step(model))
