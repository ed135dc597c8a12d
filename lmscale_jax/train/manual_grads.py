"""The manual gradient path of the train step (:func:`lmscale_jax.train.steps.make_train_step`):
a ``shard_map`` over the ``data`` axis for everything the plain global-view step cannot do —
gradient accumulation (``lax.scan`` over microbatches), a gradient all-reduce in another dtype
than float32, FSDP-sharded parameters (all-gather, then ``psum_scatter``) and one flat
all-reduce of the replicated leaves (gloo). Each task kind has its own way through it: a SumTask
sums ``loss_sum / W`` over microbatches; a BatchTask (GradCache) gathers every device's outputs
first, so its negatives span the global batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from lmscale_jax.config import modes
from lmscale_jax.model import bert as model_lib
from lmscale_jax.train import sharding, tasks
from lmscale_jax.train.sharding import AXIS

REDUCE_DTYPES = {name: jnp.dtype(name) for name in modes.DTYPES}


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
  (one collective instead of one per leaf; see
  :func:`lmscale_jax.train.steps.resolve_grad_allreduce`)."""
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
