"""The jitted functions of a run: the data-parallel MLM train step (with its two gradient paths),
the eval step, and :func:`build_steps`, which places them and the train state on the mesh.

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
from lmscale_jax.train import optim, sharding
from lmscale_jax.train.sharding import AXIS


@struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


REDUCE_DTYPES = {name: jnp.dtype(name) for name in modes.DTYPES}


def mlm_loss(logits, labels, weights):
  """Weighted mean cross-entropy over predicted positions, plus (correct, weight) sums."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
  wsum = jnp.maximum(weights.sum(), 1.0)
  correct = ((jnp.argmax(logits, -1) == labels) * weights).sum()
  return (ce * weights).sum() / wsum, (ce * weights).sum(), correct, weights.sum()


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


def make_train_step(model, optimizer, schedule, seed: int, pad_id: int, *,
                    accum_steps: int = 1, mesh: Mesh | None = None, param_specs=None,
                    reduce_dtype: str = "float32", compute_dtype: str = "float32",
                    dropout_rng: str = "threefry", manual: bool | None = None,
                    flat_reduce: bool = False,
                    inject_nonfinite_steps: tuple[int, ...] = ()):
  """The training step ``(state, batch) -> (state, metrics)`` (to be jitted).

  Two ways to get the gradients of the global batch:

  * **plain** (``accum_steps == 1``, float32 reduction, replicated parameters): the
    global-view step: XLA partitions it over the batch-sharded mesh and inserts the gradient
    all-reduce itself.
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
    grads_fn = make_grads_fn(model, mesh, param_specs, accum_steps=accum_steps,
                             reduce_dtype=reduce_dtype, compute_dtype=compute_dtype,
                             flat_reduce=flat_reduce)

  def train_step(state: TrainState, batch):
    rng = step_rng(seed, state.step, dropout_rng)
    if grads_fn is None:
      def loss_fn(params):
        logits = model.apply({"params": params}, batch["input_ids"], batch["mlm_positions"],
                             deterministic=False, rngs={"dropout": rng})
        loss, _, correct, wsum = mlm_loss(logits, batch["mlm_labels"], batch["mlm_weights"])
        return loss, (correct, wsum)

      (loss, (correct, wsum)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
      tokens = (batch["input_ids"] != pad_id).sum()
    else:
      grads, sums = grads_fn(state.params, batch, rng)
      loss = sums["ce"] / jnp.maximum(sums["weight"], 1.0)
      correct, wsum, tokens = sums["correct"], sums["weight"], sums["tokens"]
    if inject_nonfinite_steps:
      hit = jnp.isin(state.step + 1, jnp.asarray(inject_nonfinite_steps, jnp.int32))
      poison = jnp.where(hit, jnp.nan, 1.0).astype(jnp.float32)
      loss = loss * poison
      grads = jax.tree.map(lambda g: g * poison.astype(g.dtype), grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {
        "loss": loss,
        "mlm_accuracy": correct / jnp.maximum(wsum, 1.0),
        "grad_norm": optax.tree.norm(grads),
        "learning_rate": schedule(state.step),
        "tokens": tokens,
    }
    finite = jnp.isfinite(loss) & jnp.isfinite(metrics["grad_norm"])
    metrics["nonfinite"] = jnp.logical_not(finite).astype(jnp.int32)
    if (guard := optim.finite_guard(opt_state)) is not None:  # skip mode
      metrics["consecutive_nonfinite"] = guard.notfinite_count
    if "corrupt" in batch:  # data.on_corrupt="skip": rows the loader replaced
      metrics["corrupt_records"] = batch["corrupt"].sum()
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  return train_step


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


def make_grads_fn(model, mesh: Mesh, param_specs, *, accum_steps: int, reduce_dtype: str,
                  compute_dtype: str, flat_reduce: bool = False):
  """``(params, batch, rng) -> (grads, sums)`` over the global batch, as a ``shard_map``.

  Per device: all-gather the FSDP-sharded leaves (matrices cast to the compute dtype first:
  the model casts them to it anyway, so this is exact and halves the bytes gathered in
  bfloat16); split the local rows into ``accum_steps`` microbatches (row ``a*k + i`` goes to
  microbatch ``i``, so every microbatch takes the same rows from every device and the split
  needs no communication); ``lax.scan`` over them accumulating float32 gradients of
  ``ce_sum(microbatch) / W`` with ``W`` the global batch's prediction count, whose sum is
  exactly the gradient of the global mean loss; then one reduction per leaf in
  ``reduce_dtype`` (``flat_reduce``: one for all replicated leaves together). Peak activation
  memory is one microbatch's.

  Dropout: the key is ``fold_in(step key, device index)`` and, with accumulation,
  ``fold_in(·, microbatch)``: masks differ from the plain step's (statistically the same);
  with ``dropout == 0`` the losses equal the plain step's to float32 rounding.
  """
  if param_specs is None:
    param_specs = jax.tree.map(lambda _: PartitionSpec(),
                               jax.eval_shape(lambda: model_lib.init_params(
                                   model.cfg, jax.random.key(0))))
  cdtype, rdtype = model_lib.DTYPES[compute_dtype], REDUCE_DTYPES[reduce_dtype]
  k = int(accum_steps)
  is_spec = lambda x: isinstance(x, PartitionSpec)

  def gather(p, spec):
    if p.ndim > 1:
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

  def local(params, batch, rng):
    full = jax.tree.map(gather, params, param_specs, is_leaf=is_spec)
    rng = jax.random.fold_in(rng, jax.lax.axis_index(AXIS))
    total_w = jnp.maximum(jax.lax.psum(batch["mlm_weights"].sum(), AXIS), 1.0)

    def micro_loss(p, mb, key):
      logits = model.apply({"params": p}, mb["input_ids"], mb["mlm_positions"],
                           deterministic=False, rngs={"dropout": key})
      _, ce_sum, correct, _ = mlm_loss(logits, mb["mlm_labels"], mb["mlm_weights"])
      return ce_sum / total_w, (ce_sum, correct)

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
    if k == 1:
      (_, (ce, correct)), grads = grad_fn(full, batch, rng)
    else:
      micro = jax.tree.map(
          lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), batch)

      def body(carry, xs):
        i, mb = xs
        (_, (ce_i, correct_i)), g = grad_fn(full, mb, jax.random.fold_in(rng, i))
        acc, ce_acc, correct_acc = carry
        acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc, g)
        return (acc, ce_acc + ce_i, correct_acc + correct_i), None

      zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), full)
      zero = jnp.zeros((), jnp.float32)
      init = _to_varying((zeros, zero, zero))  # the carry varies like the gradients
      (grads, ce, correct), _ = jax.lax.scan(body, init, (jnp.arange(k), micro))
    if flat_reduce:
      grads = _psum_concatenated(grads, param_specs, reduce)
    else:
      grads = jax.tree.map(reduce, grads, param_specs, is_leaf=is_spec)
    sums = {"ce": ce, "correct": correct, "weight": batch["mlm_weights"].sum(),
            "tokens": (batch["input_ids"] != model.cfg.pad_id).sum()}
    return grads, jax.lax.psum(sums, AXIS)

  return jax.shard_map(local, mesh=mesh, in_specs=(param_specs, PartitionSpec(AXIS),
                                                   PartitionSpec()),
                       out_specs=(param_specs, PartitionSpec()))


def make_eval_step(model):
  def eval_step(params, batch):
    logits = model.apply({"params": params}, batch["input_ids"], batch["mlm_positions"],
                         deterministic=True)
    _, ce_sum, correct, wsum = mlm_loss(logits, batch["mlm_labels"], batch["mlm_weights"])
    return {"ce_sum": ce_sum, "correct": correct, "weight": wsum}

  return eval_step


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
  init: Any                # rng -> TrainState (jitted, placed per state_sharding)
  train_step: Any          # (state, batch) -> (state, metrics); state donated
  eval_step: Any           # (params, batch) -> sums
  manual: bool             # gradients through make_grads_fn (see make_train_step)
  grad_allreduce: str = "per_tensor"  # train.grad_allreduce as resolved for this run


def build_steps(config: ml_collections.ConfigDict, model_cfg: ml_collections.ConfigDict,
                predictions: int, mesh: Mesh | None = None, *,
                manual: bool | None = None) -> Steps:
  """Model, optimizer, shardings and the jitted init/train/eval functions for ``config``.

  ``manual`` forces (True) or forbids (False) the shard_map gradient path; None picks it
  from the config (:func:`needs_manual_grads`)."""
  t = config.train
  if mesh is None:
    mesh = sharding.data_mesh()
  replicated = NamedSharding(mesh, PartitionSpec())
  batch_sharding = sharding.batch_sharding(mesh)
  model = model_lib.BertForMLM(model_cfg)
  schedule = optim.learning_rate_schedule(t)
  optimizer = optim.make_optimizer(t)

  def init_state(rng):
    params = model_lib.init_params(model_cfg, rng, predictions=predictions)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(params))

  abstract = jax.eval_shape(init_state, jax.random.key(t.seed))
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
      model, optimizer, schedule, t.seed, model_cfg.pad_id, accum_steps=int(t.grad_accum_steps),
      mesh=mesh, param_specs=specs.params, reduce_dtype=t.grad_allreduce_dtype,
      compute_dtype=model_cfg.dtype, dropout_rng=t.dropout_rng, manual=manual,
      flat_reduce=flat_reduce,
      inject_nonfinite_steps=config_checks.parse_steps(t.inject_nonfinite_steps,
                                                       "train.inject_nonfinite_steps"))
  train_step = jax.jit(step_fn, in_shardings=(state_sharding, batch_sharding),
                       out_shardings=(state_sharding, replicated), donate_argnums=0)
  eval_step = jax.jit(make_eval_step(model), in_shardings=(state_sharding.params,
                                                            batch_sharding),
                      out_shardings=replicated)
  init = jax.jit(init_state, out_shardings=state_sharding)
  return Steps(mesh=mesh, model=model, optimizer=optimizer, schedule=schedule,
               state_sharding=state_sharding, batch_sharding=batch_sharding,
               abstract_state=abstract, init=init, train_step=train_step,
               eval_step=eval_step, manual=manual,
               grad_allreduce="flat" if flat_reduce else "per_tensor")

