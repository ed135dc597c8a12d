"""The jitted functions of every run: the one data-parallel train step of any task (a
:class:`~lmscale_jax.train.tasks.SumTask` or ``BatchTask``: pretraining's MLM in
:mod:`lmscale_jax.pretrain.mlm`, the fine-tunes' in :mod:`lmscale_jax.finetune`) with its two
gradient paths and every lever, and :func:`build_task_steps`, which places it, the task's eval
step and the train state on the mesh. The core names no task.

The train step is one XLA program per step: forward, backward, gradient reduction, optimizer
update; everything per-step runs inside it (nothing in Python between steps but dispatch).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lmscale_jax.config import checks as config_checks
from lmscale_jax.config.modes import GRAD_ALLREDUCE
from lmscale_jax.train import manual_grads, optim, sharding, tasks
from lmscale_jax.train.sharding import AXIS


@struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


def resolve_grad_allreduce(mode: str) -> str:
  """``auto`` is ``flat`` where the collectives are gloo's (the CPU backend, several
  processes) and ``per_tensor`` elsewhere.

  Why: XLA:CPU reduces each operand of its combined all-reduce with a collective call of its
  own (xla/backends/cpu/runtime/all_reduce_thunk.cc loops ``comm.AllReduce`` over them), and
  over gloo each call pays the transport's latency. Measured here (2 processes on 2 cores,
  2026-12-01, see docs/scaling.md): 7.6 MB as the 42 gradients of a 2-layer, 256-wide BERT
  took 28–58 ms to reduce against 9–10 ms as one buffer, and the whole step 247–276 ms
  against 205–219 ms. On GPUs XLA combines the all-reduces into few NCCL calls and overlaps
  them with the backward pass; one buffer would wait for the whole backward pass and copy
  every gradient twice.
  """
  if mode not in GRAD_ALLREDUCE:
    raise ValueError(f"train.grad_allreduce {mode!r}: expected one of {GRAD_ALLREDUCE}")
  if mode != "auto":
    return mode
  return "flat" if jax.default_backend() == "cpu" and jax.process_count() > 1 else "per_tensor"


def step_rng(seed: int, step, dropout_rng: str = "threefry"):
  """Dropout key of a step: keyed by (seed, step), so identical after a resume."""
  impl = None if dropout_rng == "threefry" else "unsafe_rbg"
  return jax.random.fold_in(jax.random.key(seed, impl=impl), step)


def make_train_step(task, optimizer, schedule, seed: int, *, accum_steps: int = 1,
                    mesh: Mesh | None = None, param_specs=None, reduce_dtype: str = "float32",
                    compute_dtype: str = "float32", dropout_rng: str = "threefry",
                    manual: bool | None = None, flat_reduce: bool = False,
                    inject_nonfinite_steps: tuple[int, ...] = ()):
  """The training step ``(state, batch) -> (state, metrics)`` (to be jitted) of ``task`` (a
  :class:`~lmscale_jax.train.tasks.SumTask` or ``BatchTask``: its loss, metric sums, batch).

  Two ways to get the gradients of the global batch:

  * **plain** (``accum_steps == 1``, float32 reduction, replicated parameters): the
    global-view step: XLA partitions it over the batch-sharded mesh and inserts the gradient
    all-reduce itself (and, for a BatchTask, gathers the per-row outputs).
  * **manual** (anything else): :func:`~lmscale_jax.train.manual_grads.make_grads_fn`, a
    ``shard_map`` over the ``data`` axis in which each device gathers FSDP-sharded parameters,
    runs its microbatches with ``lax.scan``, and reduces its float32-accumulated gradients
    once with ``psum`` (replicated leaves; with ``flat_reduce`` one ``psum`` of them all,
    concatenated) or ``psum_scatter`` (FSDP leaves) in ``reduce_dtype``.

  The optimizer update runs in the global view either way, on parameters and moments sharded
  like ``param_specs`` (elementwise, so no communication, except the scalar of the global-norm
  clip). Metric ``nonfinite``: the loss or gradient norm is NaN/inf (``train.nonfinite=skip``
  then skips the update: ``optax.apply_if_finite``). ``inject_nonfinite_steps`` (fault
  injection, for tests of that path) makes the loss and gradients of those 1-based steps NaN.
  """
  if manual is None:
    manual = manual_grads.needs_manual_grads(accum_steps, reduce_dtype, param_specs,
                                             flat_reduce)
  grads_fn = None
  if manual:
    if mesh is None:
      raise ValueError("the manual gradient path needs the device mesh")
    grads_fn = manual_grads.make_grads_fn(task, mesh, param_specs, accum_steps=accum_steps,
                                          reduce_dtype=reduce_dtype,
                                          compute_dtype=compute_dtype, flat_reduce=flat_reduce)

  def train_step(state: TrainState, batch):
    rng = step_rng(seed, state.step, dropout_rng)
    if grads_fn is None:
      loss, grads, task_metrics = _plain_grads(task, state.params, batch, rng)
    else:
      grads, loss, task_metrics = grads_fn(state.params, batch, rng)
    if inject_nonfinite_steps:
      hit = jnp.isin(state.step + 1, jnp.asarray(inject_nonfinite_steps, jnp.int32))
      poison = jnp.where(hit, jnp.nan, 1.0).astype(jnp.float32)
      loss = loss * poison
      grads = jax.tree.map(lambda g: g * poison.astype(g.dtype), grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, **task_metrics, "grad_norm": optax.tree.norm(grads),
               "learning_rate": schedule(state.step)}
    finite = jnp.isfinite(loss) & jnp.isfinite(metrics["grad_norm"])
    metrics["nonfinite"] = jnp.logical_not(finite).astype(jnp.int32)
    if (guard := optim.finite_guard(opt_state)) is not None:  # skip mode
      metrics["consecutive_nonfinite"] = guard.notfinite_count
    if isinstance(batch, dict) and "corrupt" in batch:  # data.on_corrupt="skip": rows replaced
      metrics["corrupt_records"] = batch["corrupt"].sum()
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  return train_step


def _plain_grads(task, params, batch, rng):
  """(loss, grads, task metrics) in the global view."""
  if isinstance(task, tasks.SumTask):
    weight = task.weight(batch)

    def loss_fn(p):
      loss_sum, sums = task.loss_sum(p, batch, rng)
      return loss_sum / jnp.maximum(weight, 1.0), sums

    (loss, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return loss, grads, task.metrics({**sums, "weight": weight})

  def batch_loss(p):
    return task.loss(task.embed(p, batch, rng))

  (loss, metrics), grads = jax.value_and_grad(batch_loss, has_aux=True)(params)
  return loss, grads, {**metrics, **task.sums(batch)}


@dataclasses.dataclass
class Steps:
  """The jitted functions of a run and the shardings they were built with."""
  mesh: Mesh
  model: Any
  optimizer: Any
  schedule: Any
  state_sharding: Any      # pytree of NamedSharding, like TrainState
  batch_sharding: Any
  abstract_state: Any      # ShapeDtypeStructs carrying state_sharding (Orbax restore target)
  init: Any                # (*init args) -> TrainState (jitted, placed per state_sharding)
  train_step: Any          # (state, batch) -> (state, metrics); state donated
  eval_step: Any           # (params, batch) -> sums; None for a task without one
  manual: bool             # gradients through manual_grads.make_grads_fn
  grad_allreduce: str = "per_tensor"  # train.grad_allreduce as resolved for this run


def build_task_steps(config: ml_collections.ConfigDict, task, model, optimizer, init_state,
                     init_args: tuple, *, compute_dtype: str, mesh: Mesh | None = None,
                     manual: bool | None = None, eval_step=None) -> Steps:
  """Any task's :class:`Steps`: the state placed per ``train.fsdp``
  (:func:`sharding.state_specs`), the step of :func:`make_train_step` with every lever of
  ``config.train``. ``init_state(*init_args)``: the step-0 state (``init_args``: examples of
  its arguments, for its shapes); ``eval_step``: ``(params, batch) -> sums``, if any."""
  t = config.train
  if mesh is None:
    mesh = sharding.data_mesh()
  replicated = NamedSharding(mesh, PartitionSpec())
  batch_sharding = sharding.batch_sharding(mesh)
  schedule = optim.learning_rate_schedule(t)
  abstract = jax.eval_shape(init_state, *init_args)
  specs = sharding.state_specs(abstract, mesh.shape[AXIS], bool(t.fsdp))
  state_sharding = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                is_leaf=lambda x: isinstance(x, PartitionSpec))
  abstract = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                          abstract, state_sharding)
  flat_reduce = resolve_grad_allreduce(str(t.grad_allreduce)) == "flat"
  if manual is None:
    manual = manual_grads.needs_manual_grads(t.grad_accum_steps, t.grad_allreduce_dtype,
                                             specs.params, flat_reduce)
  step_fn = make_train_step(
      task, optimizer, schedule, t.seed, accum_steps=int(t.grad_accum_steps), mesh=mesh,
      param_specs=specs.params, reduce_dtype=t.grad_allreduce_dtype,
      compute_dtype=compute_dtype, dropout_rng=t.dropout_rng, manual=manual,
      flat_reduce=flat_reduce,
      inject_nonfinite_steps=config_checks.parse_steps(t.inject_nonfinite_steps,
                                                       "train.inject_nonfinite_steps"))
  train_step = jax.jit(step_fn, in_shardings=(state_sharding, batch_sharding),
                       out_shardings=(state_sharding, replicated), donate_argnums=0)
  if eval_step is not None:
    eval_step = jax.jit(eval_step, in_shardings=(state_sharding.params, batch_sharding),
                        out_shardings=replicated)
  init = jax.jit(init_state, out_shardings=state_sharding)
  return Steps(mesh=mesh, model=model, optimizer=optimizer, schedule=schedule,
               state_sharding=state_sharding, batch_sharding=batch_sharding,
               abstract_state=abstract, init=init, train_step=train_step,
               eval_step=eval_step, manual=manual,
               grad_allreduce="flat" if flat_reduce else "per_tensor")
