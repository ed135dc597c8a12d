"""The jitted functions of a run: the one data-parallel train step of every task (MLM
pretraining, contrastive fine-tuning: :mod:`lmscale_jax.train.tasks`) with its two gradient
paths and every lever, the MLM eval step, and :func:`build_task_steps`, which places them and
the train state on the mesh (:func:`build_steps`: pretraining's; :func:`build_eval_step`: the
eval step alone, for scoring a checkpoint).

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
from lmscale_jax.config import modes
from lmscale_jax.config.modes import GRAD_ALLREDUCE
from lmscale_jax.model import bert as model_lib
from lmscale_jax.train import optim, sharding, tasks
from lmscale_jax.train.sharding import AXIS


@struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


REDUCE_DTYPES = {name: jnp.dtype(name) for name in modes.DTYPES}
mlm_loss = tasks.mlm_loss  # pretraining's loss (lmscale_jax.train.tasks)


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
  * **manual** (anything else): :func:`make_grads_fn`, a ``shard_map`` over the ``data`` axis
    in which each device gathers FSDP-sharded parameters, runs its microbatches with
    ``lax.scan``, and reduces its float32-accumulated gradients once with ``psum`` (replicated
    leaves; with ``flat_reduce`` one ``psum`` of them all, concatenated) or ``psum_scatter``
    (FSDP leaves) in ``reduce_dtype``.

  The optimizer update runs in the global view either way, on parameters and moments sharded
  like ``param_specs`` (elementwise, so no communication, except the scalar of the global-norm
  clip). Metric ``nonfinite``: the loss or gradient norm is NaN/inf (``train.nonfinite=skip``
  then skips the update: ``optax.apply_if_finite``). ``inject_nonfinite_steps`` (fault
  injection, for tests of that path) makes the loss and gradients of those 1-based steps NaN.
  """
  if manual is None:
    manual = needs_manual_grads(accum_steps, reduce_dtype, param_specs, flat_reduce)
  grads_fn = None
  if manual:
    if mesh is None:
      raise ValueError("the manual gradient path needs the device mesh")
    grads_fn = make_grads_fn(task, mesh, param_specs, accum_steps=accum_steps,
                             reduce_dtype=reduce_dtype, compute_dtype=compute_dtype,
                             flat_reduce=flat_reduce)

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


def needs_manual_grads(accum_steps: int, reduce_dtype: str, param_specs,
                       flat_reduce: bool = False) -> bool:
  """Whether the step takes the shard_map gradient path (anything but the plain step)."""
  sharded = param_specs is not None and sharding.is_sharded(param_specs)
  return int(accum_steps) > 1 or reduce_dtype != "float32" or sharded or bool(flat_reduce)


def _to_varying(x):
  """Marks ``x`` as differing across ``data`` inside shard_map: its gradients stay local (the
  transpose of the implicit invariant->varying cast would otherwise psum them)."""
  if hasattr(jax.lax, "pcast"):
    return jax.lax.pcast(x, AXIS, to="varying")
  return jax.lax.pvary(x, AXIS)  # jax releases before pcast


def _sharded_dim(spec: PartitionSpec) -> int | None:
  return next((i for i, a in enumerate(spec) if a is not None), None)


def _psum_concatenated(grads, param_specs, reduce):
  """``reduce`` of every leaf, the replicated ones as one ``psum`` of their concatenation
  (one collective instead of one per leaf; see :func:`resolve_grad_allreduce`)."""
  is_spec = lambda x: isinstance(x, PartitionSpec)
  leaves, treedef = jax.tree.flatten(grads)
  specs = jax.tree.leaves(param_specs, is_leaf=is_spec)
  replicated = [i for i, spec in enumerate(specs) if _sharded_dim(spec) is None]
  out = [None if _sharded_dim(spec) is None else reduce(g, spec)
         for g, spec in zip(leaves, specs)]
  if replicated:
    summed = reduce(jnp.concatenate([leaves[i].ravel() for i in replicated]), PartitionSpec())
    offset = 0
    for i in replicated:
      size = leaves[i].size
      out[i] = summed[offset:offset + size].reshape(leaves[i].shape)
      offset += size
  return jax.tree.unflatten(treedef, out)


def _microbatches(tree, k: int):
  """Rows ``a*k + i`` of every leaf → microbatch ``i`` (leading axis ``k``): every microbatch
  takes the same rows from every device, so the split needs no communication."""
  return jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1),
                      tree)


def _unmicrobatch(tree):
  """The inverse of :func:`_microbatches`."""
  return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(-1, *x.shape[2:]), tree)


def make_grads_fn(task, mesh: Mesh, param_specs, *, accum_steps: int, reduce_dtype: str,
                  compute_dtype: str, flat_reduce: bool = False):
  """``(params, batch, rng) -> (grads, loss, task metrics)`` over the global batch, as a
  ``shard_map``.

  Per device: all-gather the FSDP-sharded leaves (matrices cast to the compute dtype first,
  those ``task.compute_cast`` allows: the model casts them to it anyway, so this is exact and
  halves the bytes gathered in bfloat16); split the local rows into ``accum_steps``
  microbatches (:func:`_microbatches`); accumulate float32 gradients (:func:`_sum_task_grads`
  or :func:`_batch_task_grads`); then one reduction per leaf in ``reduce_dtype``
  (``flat_reduce``: one for all replicated leaves together).

  Dropout: the key is ``fold_in(step key, device index)`` and, with accumulation,
  ``fold_in(·, microbatch)``: masks differ from the plain step's (statistically the same);
  with ``dropout == 0`` the losses equal the plain step's to float32 rounding.
  """
  cdtype, rdtype = model_lib.DTYPES[compute_dtype], REDUCE_DTYPES[reduce_dtype]
  k = int(accum_steps)
  is_spec = lambda x: isinstance(x, PartitionSpec)

  def gather(p, spec, cast):
    if cast:
      p = p.astype(cdtype)
    d = _sharded_dim(spec)
    if d is None:  # replicated: its gradient must stay this device's own until reduce()
      return _to_varying(p)
    return jax.lax.all_gather(p, AXIS, axis=d, tiled=True)

  def reduce(g, spec):
    g = g.astype(rdtype)
    d = _sharded_dim(spec)
    if d is None:
      g = jax.lax.psum(g, AXIS)
    else:
      g = jax.lax.psum_scatter(g, AXIS, scatter_dimension=d, tiled=True)
    return g.astype(jnp.float32)

  grads_of = _sum_task_grads if isinstance(task, tasks.SumTask) else _batch_task_grads

  def grads_fn(params, batch, rng):
    specs = param_specs
    if specs is None:  # replicated
      specs = jax.tree.map(lambda _: PartitionSpec(), params)

    def local(params, batch, rng):
      casts = (task.compute_cast(params) if task.compute_cast is not None
               else jax.tree.map(lambda p: p.ndim > 1, params))
      full = jax.tree.map(gather, params, specs, casts, is_leaf=is_spec)
      rng = jax.random.fold_in(rng, jax.lax.axis_index(AXIS))
      grads, loss, metrics = grads_of(task, full, batch, rng, k)
      if flat_reduce:
        grads = _psum_concatenated(grads, specs, reduce)
      else:
        grads = jax.tree.map(reduce, grads, specs, is_leaf=is_spec)
      return grads, loss, metrics

    return jax.shard_map(local, mesh=mesh,
                         in_specs=(specs, PartitionSpec(AXIS), PartitionSpec()),
                         out_specs=(specs, PartitionSpec(), PartitionSpec()))(params, batch, rng)

  return grads_fn


def _accumulate(grad_fn, full, micro, rng, k: int):
  """``lax.scan`` of ``grad_fn(params, microbatch, key) -> (grads, sums)`` over the ``k``
  microbatches: float32 gradient and sum totals (peak activation memory: one microbatch's)."""

  def body(carry, xs):
    i, mb = xs
    g, sums = grad_fn(full, mb, jax.random.fold_in(rng, i))
    acc, sums_acc = carry
    return (jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc, g),
            jax.tree.map(jnp.add, sums_acc, sums)), None

  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), full)
  zero_sums = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                           jax.eval_shape(lambda: grad_fn(full, _first(micro), rng)[1]))
  init = _to_varying((zeros, zero_sums))  # the carry varies like the gradients
  (grads, sums), _ = jax.lax.scan(body, init, (jnp.arange(k), micro))
  return grads, sums


def _first(micro):
  return jax.tree.map(lambda x: x[0], micro)


def _sum_task_grads(task, full, batch, rng, k: int):
  """A SumTask: the gradients of ``loss_sum(microbatch) / W``, ``W`` the global batch's
  weight, whose sum over microbatches and devices is exactly the gradient of the global mean
  loss. → (this device's gradients, the global loss, the task's metrics)."""
  total_w = jax.lax.psum(task.weight(batch), AXIS)

  def grad_fn(p, mb, key):
    def micro_loss(q):
      loss_sum, sums = task.loss_sum(q, mb, key)
      return loss_sum / jnp.maximum(total_w, 1.0), {**sums, "loss_sum": loss_sum}
    g, sums = jax.grad(micro_loss, has_aux=True)(p)
    return g, sums

  if k == 1:
    grads, sums = grad_fn(full, batch, rng)
  else:
    grads, sums = _accumulate(grad_fn, full, _microbatches(batch, k), rng, k)
  sums = jax.lax.psum({**sums, "weight": task.weight(batch)}, AXIS)
  return grads, sums["loss_sum"] / jnp.maximum(sums["weight"], 1.0), task.metrics(sums)


def _batch_task_grads(task, full, batch, rng, k: int):
  """A BatchTask (GradCache): this device's per-row outputs (``k == 1``: with the backward
  pass's residuals; else by a scan without gradients), all-gathered into the global batch's;
  the loss and its gradient with respect to them, computed alike on every device; then the
  gradient of this device's rows pulled back through the encoder (``k > 1``: per microbatch,
  its forward recomputed with the same dropout key). The gradients summed over devices are
  exactly the global loss's; with accumulation the negatives still span the global batch, at
  the cost of one more forward pass."""
  if k == 1:
    out, pull = jax.vjp(lambda p: task.embed(p, batch, rng), full)
  else:
    micro = _microbatches(batch, k)
    _, outs = jax.lax.scan(lambda c, xs: (c, task.embed(full, xs[1],
                                                         jax.random.fold_in(rng, xs[0]))),
                           None, (jnp.arange(k), micro))
    out = _unmicrobatch(outs)
  everyone = jax.lax.all_gather(out, AXIS, axis=0, tiled=True)
  (loss, metrics), d_everyone = jax.value_and_grad(task.loss, has_aux=True)(everyone)
  rows = jax.tree.leaves(out)[0].shape[0]
  start = jax.lax.axis_index(AXIS) * rows
  d_out = jax.tree.map(lambda d: jax.lax.dynamic_slice_in_dim(d, start, rows), d_everyone)
  if k == 1:
    (grads,) = pull(d_out)
  else:
    def grad_fn(p, mb_and_d, key):
      mb, d = mb_and_d
      _, pull_i = jax.vjp(lambda q: task.embed(q, mb, key), p)
      return pull_i(d)[0], {}
    grads, _ = _accumulate(grad_fn, full, (micro, _microbatches(d_out, k)), rng, k)
  same = lambda x: jax.lax.pmax(x, AXIS)  # equal on every device: marked invariant
  sums = jax.lax.psum(task.sums(batch), AXIS)
  return grads, same(loss), {**jax.tree.map(same, metrics), **sums}


def make_eval_step(model):
  def eval_step(params, batch):
    logits = model.apply({"params": params}, batch["input_ids"], batch["mlm_positions"],
                         deterministic=True)
    _, ce_sum, correct, wsum = tasks.mlm_loss(logits, batch["mlm_labels"],
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
  manual: bool             # gradients through make_grads_fn (see make_train_step)
  grad_allreduce: str = "per_tensor"  # train.grad_allreduce as resolved for this run


def build_steps(config: ml_collections.ConfigDict, model_cfg: ml_collections.ConfigDict,
                predictions: int, mesh: Mesh | None = None, *,
                manual: bool | None = None) -> Steps:
  """Pretraining's model, optimizer, shardings and jitted init/train/eval functions
  (:func:`build_task_steps` of the MLM task).

  ``manual`` forces (True) or forbids (False) the shard_map gradient path; None picks it
  from the config (:func:`needs_manual_grads`)."""
  t = config.train
  model = model_lib.BertForMLM(model_cfg)
  optimizer = optim.make_optimizer(t)

  def init_state(rng):
    params = model_lib.init_params(model_cfg, rng, predictions=predictions)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(params))

  return build_task_steps(config, tasks.mlm_task(model, model_cfg.pad_id), model, optimizer,
                          init_state, (jax.random.key(t.seed),),
                          compute_dtype=model_cfg.dtype, mesh=mesh, manual=manual,
                          eval_step=make_eval_step(model))


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
    manual = needs_manual_grads(t.grad_accum_steps, t.grad_allreduce_dtype, specs.params,
                                flat_reduce)
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
