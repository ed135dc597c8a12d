"""What every fine-tune's state shares: a ``TrainState`` whose parameters are ``{"bert":
encoder, head}`` (the contrastive projection, a classifier, a namer), the optimizer that trains
every leaf but the frozen ones (:func:`trainable_labels`, :func:`optimizer`), the contrastive
state's init and restore target, and the losses' helpers (:func:`stop_frozen`,
:func:`head_in_float32`). The tasks' losses live with their runs (``finetune/*_run.py``)."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from lmscale_jax.model import bert as model_lib
from lmscale_jax.model import contrastive
from lmscale_jax.train import optim, sharding
from lmscale_jax.train.steps import TrainState


def trainable_labels(params, freeze_layers: int):
  """"train" or "frozen" per leaf of ``{"bert", "projection"}``: the MLM head is frozen (not
  in the loss: weight decay alone would shrink it); with ``freeze_layers`` k > 0 also the
  embeddings and layers 0..k-1."""

  def label(path, _):
    top, part = path[0].key, path[1].key if len(path) > 1 else ""
    if top != "bert":
      return "train"
    if part.startswith("mlm_"):
      return "frozen"
    if part == "embeddings" or part.startswith("layer_"):
      below = part == "embeddings" or int(part.removeprefix("layer_")) < freeze_layers
      return "frozen" if freeze_layers > 0 and below else "train"
    return "train"  # final_LayerNorm (pre-LN)

  return jax.tree_util.tree_map_with_path(label, params)


def optimizer(config):
  """(optimizer, labels): AdamW on the "train" leaves, zero updates on the "frozen" ones."""
  labels = functools.partial(trainable_labels, freeze_layers=int(config.finetune.freeze_layers))
  return optax.multi_transform(
      {"train": optim.make_optimizer(config.train), "frozen": optax.set_to_zero()},
      labels), labels


def init_fn(config, cfg, tx):
  """(encoder params, rng) -> the step-0 TrainState with a fresh projection head."""
  proj_dim = config.finetune.proj_dim

  def init_state(bert, rng):
    params = {"bert": bert, "projection": contrastive.init_projection(cfg, proj_dim, rng)}
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  return init_state


def abstract_state(config, cfg, mesh=None):
  """The state's shapes, replicated over ``mesh`` (the data mesh by default): the Orbax
  restore target."""
  mesh = mesh if mesh is not None else sharding.data_mesh()
  replicated = NamedSharding(mesh, PartitionSpec())
  init_state = init_fn(config, cfg, optimizer(config)[0])
  bert = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.key(0)))
  shapes = jax.eval_shape(init_state, bert, jax.random.key(0))
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated),
                      shapes)


def stop_frozen(params, labels: Callable):
  """``params`` with no gradient through the leaves ``labels(params)`` calls "frozen" (none is
  then computed at all; the optimizer also zeroes their updates)."""
  return jax.tree.map(lambda p, lab: jax.lax.stop_gradient(p) if lab == "frozen" else p,
                      params, labels(params))


def head_in_float32(head: str) -> Callable:
  """A fine-tuning task's ``compute_cast``: the encoder's matrices cast, the ``head`` (which
  runs in float32: model/contrastive.py, model/classifier.py) not."""

  def compute_cast(params):
    return {"bert": jax.tree.map(lambda p: p.ndim > 1, params["bert"]),
            head: jax.tree.map(lambda _: False, params[head])}

  return compute_cast
