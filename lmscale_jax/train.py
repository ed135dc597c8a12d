"""Training: one jitted, data-parallel MLM step over a device mesh; evaluation; checkpoints.

The hot loop is: pull the prefetched batch (already on device) → dispatch the jitted step (state
donated) → every ``log_every`` steps fetch the *previous* window's metrics, so dispatch never
waits on the device. Everything per-step runs inside ``train_step``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lmscale_jax import autotune as autotune_lib
from lmscale_jax import checkpoint as ckpt_lib
from lmscale_jax import data as data_lib
from lmscale_jax import dataset
from lmscale_jax import flops as flops_lib
from lmscale_jax import metrics as metrics_lib
from lmscale_jax import model as model_lib
from lmscale_jax import preemption


class NonFiniteLoss(FloatingPointError):
  pass


@struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


# ----------------------------------------------------------------------------- config
def check_config(config: ml_collections.ConfigDict) -> None:
  t = config.train
  for key in ("batch_size", "steps", "log_every", "eval_every", "eval_batches"):
    if int(t[key]) <= 0:
      raise ValueError(f"train.{key}={t[key]}: expected a positive integer")
  if config.checkpoint.every <= 0 or config.checkpoint.keep <= 0:
    raise ValueError("checkpoint.every and checkpoint.keep must be positive")
  if t.schedule not in ("linear", "cosine"):
    raise ValueError(f"train.schedule={t.schedule!r}: expected 'linear' or 'cosine'")
  if t.nonfinite not in NONFINITE_MODES:
    raise ValueError(f"train.nonfinite={t.nonfinite!r}: expected one of {list(NONFINITE_MODES)}")
  if int(t.max_consecutive_nonfinite) <= 0:
    raise ValueError(f"train.max_consecutive_nonfinite={t.max_consecutive_nonfinite}: expected "
                     "a positive integer")
  parse_steps(t.inject_nonfinite_steps, "train.inject_nonfinite_steps")
  devices = jax.device_count()
  if t.batch_size % devices:
    raise ValueError(f"train.batch_size={t.batch_size} is not divisible by the {devices} "
                     "devices of the data-parallel mesh")
  accum = int(t.grad_accum_steps)
  if accum < 1:
    raise ValueError(f"train.grad_accum_steps={accum}: expected a positive integer")
  if (t.batch_size // devices) % accum:
    raise ValueError(f"train.batch_size={t.batch_size} gives {t.batch_size // devices} "
                     f"sequences per device, not divisible by train.grad_accum_steps={accum}")
  if t.grad_allreduce_dtype not in REDUCE_DTYPES:
    raise ValueError(f"train.grad_allreduce_dtype={t.grad_allreduce_dtype!r}: expected one of "
                     f"{sorted(REDUCE_DTYPES)}")
  if t.dropout_rng not in DROPOUT_RNGS:
    raise ValueError(f"train.dropout_rng={t.dropout_rng!r}: expected one of {list(DROPOUT_RNGS)}")


def num_predictions(config, seq_len: int) -> int:
  return int(config.data.max_predictions) or int(np.ceil(config.data.mask_prob * seq_len))


# ----------------------------------------------------------------------------- optimizer
def learning_rate_schedule(t) -> optax.Schedule:
  warmup = optax.linear_schedule(0.0, t.learning_rate, max(1, t.warmup_steps))
  decay_steps = max(1, t.steps - t.warmup_steps)
  end = t.learning_rate * t.end_lr_frac
  if t.schedule == "cosine":
    decay = optax.cosine_decay_schedule(t.learning_rate, decay_steps, alpha=t.end_lr_frac)
  else:
    decay = optax.linear_schedule(t.learning_rate, end, decay_steps)
  return optax.join_schedules([warmup, decay], [t.warmup_steps])


def _decay_mask(params):
  # BERT's recipe: no weight decay on biases and LayerNorm parameters (all 1-D leaves here).
  return jax.tree.map(lambda p: p.ndim > 1, params)


# "error": stop the run, naming the step and the last good checkpoint; "skip": drop the update
# and count it (metrics ``nonfinite_skipped``), stopping after max_consecutive_nonfinite in a row.
NONFINITE_MODES = ("error", "skip")
# optax.apply_if_finite applies a non-finite update anyway after this many in a row; the loop
# enforces train.max_consecutive_nonfinite itself, so that never happens.
_NEVER = 2**31 - 1


def parse_steps(text, key: str) -> tuple[int, ...]:
  """``"3,7"`` -> ``(3, 7)`` (the fault-injection step list)."""
  try:
    steps = tuple(int(x) for x in str(text).replace(" ", "").split(",") if x)
  except ValueError:
    raise ValueError(f"{key}={text!r}: expected comma-separated step numbers") from None
  if any(s <= 0 for s in steps):
    raise ValueError(f"{key}={text!r}: step numbers start at 1")
  return steps


def make_optimizer(t) -> optax.GradientTransformation:
  opt = optax.chain(
      optax.clip_by_global_norm(t.clip_norm),
      optax.adamw(learning_rate_schedule(t), b1=t.b1, b2=t.b2, eps=t.eps,
                  weight_decay=t.weight_decay, mask=_decay_mask))
  if t.get("nonfinite", "error") == "skip":
    # A NaN/inf gradient never reaches the parameters or the Adam moments. Only in skip mode:
    # error mode stops before any later checkpoint, and its step stays the plain program.
    opt = optax.apply_if_finite(opt, max_consecutive_errors=_NEVER)
  return opt


# ----------------------------------------------------------------------------- steps
REDUCE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# "threefry" is jax's default (bit-identical on any device count); "rbg" draws dropout masks
# with XLA's RngBitGenerator, much cheaper on GPU but not partition-invariant.
DROPOUT_RNGS = ("threefry", "rbg")
AXIS = "data"


def mlm_loss(logits, labels, weights):
  """Weighted mean cross-entropy over predicted positions, plus (correct, weight) sums."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
  wsum = jnp.maximum(weights.sum(), 1.0)
  correct = ((jnp.argmax(logits, -1) == labels) * weights).sum()
  return (ce * weights).sum() / wsum, (ce * weights).sum(), correct, weights.sum()


def step_rng(seed: int, step, dropout_rng: str = "threefry"):
  """Dropout key of a step: keyed by (seed, step), so identical after a resume."""
  impl = None if dropout_rng == "threefry" else "unsafe_rbg"
  return jax.random.fold_in(jax.random.key(seed, impl=impl), step)


def make_train_step(model, optimizer, schedule, seed: int, pad_id: int, *,
                    accum_steps: int = 1, mesh: Mesh | None = None, param_specs=None,
                    reduce_dtype: str = "float32", compute_dtype: str = "float32",
                    dropout_rng: str = "threefry", manual: bool | None = None,
                    inject_nonfinite_steps: tuple[int, ...] = ()):
  """The training step ``(state, batch) -> (state, metrics)`` (to be jitted).

  Two ways to get the gradients of the global batch:

  * **plain** (``accum_steps == 1``, float32 reduction, replicated parameters): the
    global-view step: XLA partitions it over the batch-sharded mesh and inserts the gradient
    all-reduce itself.
  * **manual** (anything else): :func:`make_grads_fn`, a ``shard_map`` over the ``data`` axis
    in which each device gathers FSDP-sharded parameters, runs its microbatches with
    ``lax.scan``, and reduces its float32-accumulated gradients once with ``psum`` (replicated
    leaves) or ``psum_scatter`` (FSDP leaves) in ``reduce_dtype``.

  The optimizer update runs in the global view either way, on parameters and moments sharded
  like ``param_specs`` (elementwise, so no communication, except the scalar of the global-norm
  clip). Metric ``nonfinite``: the loss or gradient norm is NaN/inf (``train.nonfinite=skip``
  then skips the update: ``optax.apply_if_finite``). ``inject_nonfinite_steps`` (fault
  injection, for tests of that path) makes the loss and gradients of those 1-based steps NaN.
  """
  if manual is None:
    manual = needs_manual_grads(accum_steps, reduce_dtype, param_specs)
  grads_fn = None
  if manual:
    if mesh is None:
      raise ValueError("the manual gradient path needs the device mesh")
    grads_fn = make_grads_fn(model, mesh, param_specs, accum_steps=accum_steps,
                             reduce_dtype=reduce_dtype, compute_dtype=compute_dtype)

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
    if isinstance(opt_state, optax.ApplyIfFiniteState):  # skip mode
      metrics["consecutive_nonfinite"] = opt_state.notfinite_count
    if "corrupt" in batch:  # data.on_corrupt="skip": rows the loader replaced
      metrics["corrupt_records"] = batch["corrupt"].sum()
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  return train_step


def needs_manual_grads(accum_steps: int, reduce_dtype: str, param_specs) -> bool:
  """Whether the step takes the shard_map gradient path (anything but the plain step)."""
  sharded = param_specs is not None and any(
      s != PartitionSpec() for s in jax.tree.leaves(
          param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec)))
  return int(accum_steps) > 1 or reduce_dtype != "float32" or sharded


def _to_varying(x):
  """Marks ``x`` as differing across ``data`` inside shard_map: its gradients stay local (the
  transpose of the implicit invariant->varying cast would otherwise psum them)."""
  if hasattr(jax.lax, "pcast"):
    return jax.lax.pcast(x, AXIS, to="varying")
  return jax.lax.pvary(x, AXIS)  # jax releases before pcast


def _sharded_dim(spec: PartitionSpec) -> int | None:
  return next((i for i, a in enumerate(spec) if a is not None), None)


def make_grads_fn(model, mesh: Mesh, param_specs, *, accum_steps: int, reduce_dtype: str,
                  compute_dtype: str):
  """``(params, batch, rng) -> (grads, sums)`` over the global batch, as a ``shard_map``.

  Per device: all-gather the FSDP-sharded leaves (matrices cast to the compute dtype first:
  the model casts them to it anyway, so this is exact and halves the bytes gathered in
  bfloat16); split the local rows into ``accum_steps`` microbatches (row ``a*k + i`` goes to
  microbatch ``i``, so every microbatch takes the same rows from every device and the split
  needs no communication); ``lax.scan`` over them accumulating float32 gradients of
  ``ce_sum(microbatch) / W`` with ``W`` the global batch's prediction count, whose sum is
  exactly the gradient of the global mean loss; then one reduction per leaf in
  ``reduce_dtype``. Peak activation memory is one microbatch's.

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


# ----------------------------------------------------------------------------- sharding
# Leaves with fewer elements stay replicated under FSDP: sharding a bias or a LayerNorm scale
# saves nothing worth a collective.
FSDP_MIN_SIZE = 4096


def fsdp_spec(shape, devices: int) -> PartitionSpec:
  """ZeRO-3/FSDP placement of one parameter / optimizer-moment leaf over ``devices``.

  Split along the largest dimension divisible by the device count (the first such on ties);
  replicated when none divides, or the leaf is small. A parameter and its Adam moments have
  the same shape, hence the same placement.
  """
  if devices <= 1 or math.prod(shape) < FSDP_MIN_SIZE:
    return PartitionSpec()
  dims = [i for i, d in enumerate(shape) if d % devices == 0]
  if not dims:
    return PartitionSpec()
  best = max(dims, key=lambda i: (shape[i], -i))
  return PartitionSpec(*[AXIS if i == best else None for i in range(len(shape))])


def state_specs(abstract_state, devices: int, fsdp: bool):
  """PartitionSpec of every leaf of the train state (all replicated unless ``fsdp``)."""
  return jax.tree.map(lambda a: fsdp_spec(a.shape, devices) if fsdp else PartitionSpec(),
                      abstract_state)


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


def build_steps(config: ml_collections.ConfigDict, model_cfg: ml_collections.ConfigDict,
                predictions: int, mesh: Mesh | None = None, *,
                manual: bool | None = None) -> Steps:
  """Model, optimizer, shardings and the jitted init/train/eval functions for ``config``.

  ``manual`` forces (True) or forbids (False) the shard_map gradient path; None picks it
  from the config (:func:`needs_manual_grads`)."""
  t = config.train
  if mesh is None:
    mesh = Mesh(np.asarray(jax.devices()), (AXIS,))
  replicated = NamedSharding(mesh, PartitionSpec())
  batch_sharding = data_lib.batch_sharding(mesh, AXIS)
  model = model_lib.BertForMLM(model_cfg)
  schedule = learning_rate_schedule(t)
  optimizer = make_optimizer(t)

  def init_state(rng):
    params = model_lib.init_params(model_cfg, rng, predictions=predictions)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(params))

  abstract = jax.eval_shape(init_state, jax.random.key(t.seed))
  specs = state_specs(abstract, mesh.shape[AXIS], bool(t.fsdp))
  state_sharding = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                is_leaf=lambda x: isinstance(x, PartitionSpec))
  abstract = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                          abstract, state_sharding)
  if manual is None:
    manual = needs_manual_grads(t.grad_accum_steps, t.grad_allreduce_dtype, specs.params)
  step_fn = make_train_step(
      model, optimizer, schedule, t.seed, model_cfg.pad_id, accum_steps=int(t.grad_accum_steps),
      mesh=mesh, param_specs=specs.params, reduce_dtype=t.grad_allreduce_dtype,
      compute_dtype=model_cfg.dtype, dropout_rng=t.dropout_rng, manual=manual,
      inject_nonfinite_steps=parse_steps(t.inject_nonfinite_steps, "train.inject_nonfinite_steps"))
  train_step = jax.jit(step_fn, in_shardings=(state_sharding, batch_sharding),
                       out_shardings=(state_sharding, replicated), donate_argnums=0)
  eval_step = jax.jit(make_eval_step(model), in_shardings=(state_sharding.params,
                                                            batch_sharding),
                      out_shardings=replicated)
  init = jax.jit(init_state, out_shardings=state_sharding)
  return Steps(mesh=mesh, model=model, optimizer=optimizer, schedule=schedule,
               state_sharding=state_sharding, batch_sharding=batch_sharding,
               abstract_state=abstract, init=init, train_step=train_step,
               eval_step=eval_step, manual=manual)


def peak_bytes(memory_analysis) -> int:
  """Device bytes a compiled executable needs (``.compile().memory_analysis()``): arguments +
  outputs - donated buffers reused as outputs + XLA's temporary buffer."""
  m = memory_analysis
  return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
             + m.temp_size_in_bytes)


def abstract_batch(batch_size: int, seq_len: int, predictions: int, sharding=None) -> dict:
  """ShapeDtypeStructs of a global batch (for ``.lower()`` without data)."""
  shapes = {"input_ids": ((batch_size, seq_len), jnp.int32),
            "mlm_positions": ((batch_size, predictions), jnp.int32),
            "mlm_labels": ((batch_size, predictions), jnp.int32),
            "mlm_weights": ((batch_size, predictions), jnp.float32)}
  return {k: jax.ShapeDtypeStruct(s, d, sharding=sharding) for k, (s, d) in shapes.items()}


# ----------------------------------------------------------------------------- helpers
def unigram_entropy(meta: dataset.DatasetMeta, max_records: int = 20_000) -> float:
  """Entropy (nats) of the training split's token frequencies, specials excluded.

  The loss of a model that ignores context and predicts the unigram distribution: an MLM must
  get well below it to have learned anything.
  """
  from array_record.python import array_record_module

  counts = np.zeros(meta.vocab_size, np.int64)
  left = max_records
  for path in meta.shard_paths("train"):
    r = array_record_module.ArrayRecordReader(path)
    n = min(left, r.num_records())
    for rec in r.read(list(range(n))):
      counts += np.bincount(dataset.decode_record(rec, meta.seq_len, path), minlength=meta.vocab_size)
    r.close()
    left -= n
    if not left:
      break
  counts[list(meta.special_ids.values())] = 0
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log(p)).sum())


@dataclasses.dataclass
class Setup:
  """Everything built from the config before the loop; also what --dry_run reports."""
  config: ml_collections.ConfigDict
  meta: dataset.DatasetMeta
  model_cfg: ml_collections.ConfigDict
  predictions: int
  param_count: int
  flops_per_step: float
  memory_bytes: float


def synthetic_meta(seq_len: int, vocab_size: int) -> dataset.DatasetMeta:
  """Dataset metadata for runs without a dataset (benchmarks on synthetic batches)."""
  return dataset.DatasetMeta(path="<synthetic>", name="synthetic", seq_len=int(seq_len),
                        vocab_size=int(vocab_size),
                        special_ids={t: i for i, t in enumerate(dataset.SPECIAL_TOKENS)},
                        splits={}, raw={})


def build_setup(config: ml_collections.ConfigDict, meta: dataset.DatasetMeta | None = None) -> Setup:
  check_config(config)
  meta = meta or dataset.DatasetMeta.load(config.data.path)
  model_cfg = model_lib.resolve_model_config(config.model, meta, remat=config.train.remat)
  p = num_predictions(config, meta.seq_len)
  devices = jax.device_count()
  per_device = config.train.batch_size // devices
  return Setup(
      config=config, meta=meta, model_cfg=model_cfg, predictions=p,
      param_count=flops_lib.count_params_from_config(model_cfg),
      flops_per_step=flops_lib.train_flops_per_step(model_cfg, config.train.batch_size,
                                                    meta.seq_len, p),
      memory_bytes=flops_lib.memory_estimate_bytes(
          model_cfg, per_device, meta.seq_len, p,
          accum_steps=int(config.train.grad_accum_steps),
          fsdp_devices=devices if config.train.fsdp else 1))


def describe(s: Setup) -> str:
  t = s.config.train
  levers = (f"remat {t.remat}, grad_accum_steps {t.grad_accum_steps}, fsdp {bool(t.fsdp)}, "
            f"grad_allreduce_dtype {t.grad_allreduce_dtype}")
  return (f"model: {s.param_count:,} parameters ({s.model_cfg.layers} layers × "
          f"{s.model_cfg.hidden}, vocab {s.model_cfg.vocab_size}, seq {s.meta.seq_len}); "
          f"{s.flops_per_step / 1e12:.3f} TFLOP per step (global batch "
          f"{s.config.train.batch_size}, {s.predictions} predictions/sequence); "
          f"≈{s.memory_bytes / 2**30:.2f} GiB per device ({levers})")


def time_steps(steps: Steps, host_batch: dict, seed: int, n: int = 5) -> float:
  """Seconds per training step, timed on a scratch state (freed before returning)."""
  batch = jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(steps.batch_sharding, x), host_batch)
  state = steps.init(jax.random.key(seed))
  state, m = steps.train_step(state, batch)  # compiles
  jax.block_until_ready(m)
  t0 = time.perf_counter()
  for _ in range(n):
    state, m = steps.train_step(state, batch)
  jax.block_until_ready((state, m))
  seconds = (time.perf_counter() - t0) / n
  del state
  return seconds


def autotune_loader(config: ml_collections.ConfigDict, workdir: str, steps: Steps, *,
                    has_checkpoint: bool, is_writer: bool) -> ml_collections.ConfigDict:
  """``config`` with ``data.workers`` from the loader autotune (lmscale_jax/autotune.py)."""
  pi, pc = jax.process_index(), jax.process_count()

  def make_iterator(workers: int):
    c = copy.deepcopy(config)
    c.data.workers = workers
    return iter(data_lib.make_dataset(c, "train", train=True, process_index=pi,
                                      process_count=pc))

  def step_seconds() -> float:
    return time_steps(steps, next(make_iterator(0)), int(config.train.seed))

  workers = autotune_lib.resolve_workers(workdir, config.data, has_checkpoint=has_checkpoint,
                                         is_writer=is_writer, step_seconds=step_seconds,
                                         make_iterator=make_iterator)
  if pc > 1:  # every process takes process 0's choice, the one recorded
    from jax.experimental import multihost_utils

    workers = int(multihost_utils.broadcast_one_to_all(np.int32(workers)))
  config = copy.deepcopy(config)
  config.data.workers = workers
  return config


# ----------------------------------------------------------------------------- the loop
def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains (resuming from ``workdir`` if it holds a checkpoint); returns the last metrics."""
  s = build_setup(config)
  t = config.train
  is_writer = jax.process_index() == 0
  ckpt_lib.check_or_save_config(workdir, config, s.model_cfg, is_writer)

  steps = build_steps(config, s.model_cfg, s.predictions)
  train_step, eval_step = steps.train_step, steps.eval_step
  batch_sharding, abstract = steps.batch_sharding, steps.abstract_state

  pi, pc = jax.process_index(), jax.process_count()
  checkpointer = ckpt_lib.Checkpointer(workdir, keep=config.checkpoint.keep,
                                       use_async=bool(config.checkpoint["async"]))
  start = checkpointer.latest_step()
  if config.data.autotune:
    config = autotune_loader(config, workdir, steps, has_checkpoint=start is not None,
                             is_writer=is_writer)

  train_iter = data_lib.DevicePrefetcher(
      None, batch_sharding, reopen=lambda k: iter(data_lib.make_dataset(
          config, "train", train=True, process_index=pi, process_count=pc, start_batch=k)))
  eval_ds = data_lib.make_dataset(config, "validation", train=False, process_index=pi,
                                  process_count=pc)

  if start is not None:
    state = checkpointer.restore(start, abstract, train_iter)
    logging.info("resumed from %s/checkpoints/%d", workdir, start)
  else:
    start = 0
    state = steps.init(jax.random.key(t.seed))
  if is_writer:  # a crash leaves "running": job scripts requeue only a "preempted" run
    ckpt_lib.write_run_state(workdir, "running", start, t.steps)

  peak = flops_lib.device_peak_flops(jax.devices()[0].device_kind, config.metrics.peak_tflops,
                                     dtype=s.model_cfg.dtype)
  peak_total = peak * jax.device_count() if peak else None
  writer = metrics_lib.MetricsWriter(workdir, enabled=is_writer, total_steps=t.steps,
                                     resume_step=start)
  baseline = unigram_entropy(s.meta)
  if is_writer:
    logging.info(describe(s))
    logging.info("devices: %d × %s; unigram baseline loss %.4f nats; MFU peak %s",
                 jax.device_count(), jax.devices()[0].device_kind, baseline,
                 f"{peak / 1e12:.0f} TFLOP/s per device" if peak else
                 "unknown for this device (mfu = null; set metrics.peak_tflops)")

  def evaluate(params) -> dict:
    sums = None
    for host in iter(eval_ds):
      batch = jax.tree.map(lambda x: jax.make_array_from_process_local_data(batch_sharding, x),
                           host)
      out = eval_step(params, batch)
      sums = out if sums is None else jax.tree.map(jnp.add, sums, out)
    sums = jax.device_get(sums)
    w = max(float(sums["weight"]), 1.0)
    return {"eval_loss": float(sums["ce_sum"]) / w, "eval_mlm_accuracy": float(sums["correct"]) / w}

  last: dict = {"unigram_baseline": baseline}
  window: list = []
  window_start = time.perf_counter()
  train_iter.reset_wait()
  pending = None  # (step, device metrics of the window) fetched one step late

  def last_good() -> str:
    latest = checkpointer.latest_step()
    return f"{workdir}/checkpoints/{latest}" if latest is not None else "none"

  def flush_window(step: int, device_metrics: list, seconds: float, wait: float) -> dict:
    host = jax.device_get(device_metrics)
    first = step - len(host) + 1
    bad = [first + i for i, m in enumerate(host) if m["nonfinite"]]
    if bad and t.nonfinite == "error":
      raise NonFiniteLoss(
          f"non-finite loss or gradient at step {bad[0]}; last good checkpoint: "
          f"{last_good()} (nothing later was saved). train.nonfinite=skip skips such steps "
          "instead")
    run = int(host[-1].get("consecutive_nonfinite", 0))
    if run >= t.max_consecutive_nonfinite:
      raise NonFiniteLoss(
          f"{run} consecutive steps with a non-finite loss or gradient (steps {step - run + 1}"
          f"-{step}, all skipped; train.max_consecutive_nonfinite="
          f"{t.max_consecutive_nonfinite}); last good checkpoint: {last_good()}")
    good = [m for m in host if not m["nonfinite"]] or host
    row = {
        "loss": float(np.mean([m["loss"] for m in good])),
        "mlm_accuracy": float(np.mean([m["mlm_accuracy"] for m in good])),
        "learning_rate": float(host[-1]["learning_rate"]),
        "grad_norm": float(good[-1]["grad_norm"]),
        **metrics_lib.throughput(
            steps=len(host), seconds=seconds, wait_seconds=wait,
            global_batch=t.batch_size, tokens=float(sum(m["tokens"] for m in host)),
            flops_per_step=s.flops_per_step, peak_flops_total=peak_total),
    }
    if t.nonfinite == "skip":
      row["nonfinite_skipped"] = len(bad)
    if "corrupt_records" in host[0]:
      row["corrupt_records"] = int(sum(m["corrupt_records"] for m in host))
    if step == start + len(host) and is_writer:  # first window of this process
      row["unigram_baseline"] = baseline
    return row

  def log_window(pending) -> None:
    row = flush_window(*pending)
    writer.write(pending[0], row)
    writer.console(pending[0], row)
    last.update(row)

  def check_finite_before_save(step: int) -> None:
    """Error mode: never checkpoint past a non-finite step (the window may not be flushed yet);
    flushing the unflushed steps raises, naming the step."""
    if t.nonfinite != "error":
      return
    unflushed = [p for p in (pending, (step, window, 1.0, 0.0)) if p is not None and p[1]]
    flags = jax.device_get([[m["nonfinite"] for m in p[1]] for p in unflushed])
    for p, f in zip(unflushed, flags):
      if any(f):
        flush_window(*p)  # raises, naming the step

  preempted, step = False, start
  try:
    for step in range(start + 1, t.steps + 1):
      batch = next(train_iter)
      state, m = train_step(state, batch)
      window.append(m)
      if pending is not None:  # the previous window's metrics are ready by now
        log_window(pending)
        pending = None
      if step % t.log_every == 0 or step == t.steps:
        now = time.perf_counter()
        pending = (step, window, now - window_start, train_iter.reset_wait())
        window, window_start = [], now
      if step % t.eval_every == 0 or step == t.steps:
        row = evaluate(state.params)
        writer.write(step, row)
        writer.console(step, row)
        last.update(row)
        window_start = time.perf_counter()  # evaluation time is not training throughput
      # Every process asks at every step and gets the same answer (see preemption.py).
      preempted = preemption.reached(step) and step < t.steps
      if step % config.checkpoint.every == 0 or step == t.steps or preempted:
        check_finite_before_save(step)
        checkpointer.save(step, state, train_iter)
      if preempted:
        checkpointer.wait()  # synchronous: the process may be killed soon after it exits
        if is_writer:
          logging.warning("preempted: stopped after step %d of %d; checkpoint %s/checkpoints/%d "
                          "saved. Rerun the same command to continue from it.", step, t.steps,
                          workdir, step)
        break
    if pending is not None:
      log_window(pending)
    if window:  # preempted between logging steps: log the partial window
      log_window((step, window, time.perf_counter() - window_start, train_iter.reset_wait()))
  except NonFiniteLoss:
    # Raised alike in every process (the metrics are global), so waiting for a save still in
    # flight cannot block on a peer: the last good checkpoint named in the error is complete.
    checkpointer.close()
    raise
  checkpointer.close()
  writer.close()
  if is_writer:
    ckpt_lib.write_run_state(workdir, "preempted" if preempted else "finished", step,
                             t.steps)
  last["step"] = int(jax.device_get(state.step))
  return last
