"""Training: one jitted, data-parallel MLM step over a device mesh; evaluation; checkpoints.

The hot loop is: pull the prefetched batch (already on device) → dispatch the jitted step (state
donated) → every ``log_every`` steps fetch the *previous* window's metrics, so dispatch never
waits on the device. Everything per-step runs inside ``train_step``.
"""

from __future__ import annotations

import dataclasses
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

from lmscale_jax import checkpoint as ckpt_lib
from lmscale_jax import data as data_lib
from lmscale_jax import dataset as ds
from lmscale_jax import flops as flops_lib
from lmscale_jax import metrics as metrics_lib
from lmscale_jax import model as model_lib


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
  if t.nonfinite not in ("error",):
    raise ValueError(f"train.nonfinite={t.nonfinite!r}: expected 'error'")
  if int(t.grad_accum_steps) != 1:
    raise ValueError("train.grad_accum_steps > 1 is not supported yet")
  devices = jax.device_count()
  if t.batch_size % devices:
    raise ValueError(f"train.batch_size={t.batch_size} is not divisible by the {devices} "
                     "devices of the data-parallel mesh")


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


def make_optimizer(t) -> optax.GradientTransformation:
  return optax.chain(
      optax.clip_by_global_norm(t.clip_norm),
      optax.adamw(learning_rate_schedule(t), b1=t.b1, b2=t.b2, eps=t.eps,
                  weight_decay=t.weight_decay, mask=_decay_mask))


# ----------------------------------------------------------------------------- steps
def mlm_loss(logits, labels, weights):
  """Weighted mean cross-entropy over predicted positions, plus (correct, weight) sums."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
  wsum = jnp.maximum(weights.sum(), 1.0)
  correct = ((jnp.argmax(logits, -1) == labels) * weights).sum()
  return (ce * weights).sum() / wsum, (ce * weights).sum(), correct, weights.sum()


def make_train_step(model, optimizer, schedule, seed: int, pad_id: int):
  def train_step(state: TrainState, batch):
    # Dropout randomness keyed by (seed, step): identical after a resume.
    rng = jax.random.fold_in(jax.random.key(seed), state.step)

    def loss_fn(params):
      logits = model.apply({"params": params}, batch["input_ids"], batch["mlm_positions"],
                           deterministic=False, rngs={"dropout": rng})
      loss, _, correct, wsum = mlm_loss(logits, batch["mlm_labels"], batch["mlm_weights"])
      return loss, (correct, wsum)

    (loss, (correct, wsum)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {
        "loss": loss,
        "mlm_accuracy": correct / jnp.maximum(wsum, 1.0),
        "grad_norm": optax.tree.norm(grads),
        "learning_rate": schedule(state.step),
        "tokens": (batch["input_ids"] != pad_id).sum(),
    }
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  return train_step


def make_eval_step(model):
  def eval_step(params, batch):
    logits = model.apply({"params": params}, batch["input_ids"], batch["mlm_positions"],
                         deterministic=True)
    _, ce_sum, correct, wsum = mlm_loss(logits, batch["mlm_labels"], batch["mlm_weights"])
    return {"ce_sum": ce_sum, "correct": correct, "weight": wsum}

  return eval_step


# ----------------------------------------------------------------------------- helpers
def unigram_entropy(meta: ds.DatasetMeta, max_records: int = 20_000) -> float:
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
      counts += np.bincount(ds.decode_record(rec, meta.seq_len, path), minlength=meta.vocab_size)
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
  meta: ds.DatasetMeta
  model_cfg: ml_collections.ConfigDict
  predictions: int
  param_count: int
  flops_per_step: float
  memory_bytes: float


def build_setup(config: ml_collections.ConfigDict) -> Setup:
  check_config(config)
  meta = ds.DatasetMeta.load(config.data.path)
  model_cfg = model_lib.resolve_model_config(config.model, meta, remat=config.train.remat)
  p = num_predictions(config, meta.seq_len)
  per_device = config.train.batch_size // jax.device_count()
  return Setup(
      config=config, meta=meta, model_cfg=model_cfg, predictions=p,
      param_count=flops_lib.count_params_from_config(model_cfg),
      flops_per_step=flops_lib.train_flops_per_step(model_cfg, config.train.batch_size,
                                                    meta.seq_len, p),
      memory_bytes=flops_lib.memory_estimate_bytes(model_cfg, per_device, meta.seq_len, p))


def describe(s: Setup) -> str:
  return (f"model: {s.param_count:,} parameters ({s.model_cfg.layers} layers × "
          f"{s.model_cfg.hidden}, vocab {s.model_cfg.vocab_size}, seq {s.meta.seq_len}); "
          f"{s.flops_per_step / 1e12:.3f} TFLOP per step (global batch "
          f"{s.config.train.batch_size}, {s.predictions} predictions/sequence); "
          f"≈{s.memory_bytes / 2**30:.2f} GiB per device")


# ----------------------------------------------------------------------------- the loop
def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains (resuming from ``workdir`` if it holds a checkpoint); returns the last metrics."""
  s = build_setup(config)
  t = config.train
  is_writer = jax.process_index() == 0
  ckpt_lib.check_or_save_config(workdir, config, s.model_cfg, is_writer)

  mesh = Mesh(np.asarray(jax.devices()), ("data",))
  replicated = NamedSharding(mesh, PartitionSpec())
  batch_sharding = data_lib.batch_sharding(mesh)

  model = model_lib.BertForMLM(s.model_cfg)
  schedule = learning_rate_schedule(t)
  optimizer = make_optimizer(t)

  def init_state(rng):
    params = model_lib.init_params(s.model_cfg, rng, predictions=s.predictions)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(params))

  abstract = jax.eval_shape(init_state, jax.random.key(t.seed))
  state_sharding = jax.tree.map(lambda _: replicated, abstract)
  abstract = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                          abstract, state_sharding)

  train_step = jax.jit(make_train_step(model, optimizer, schedule, t.seed, s.meta.pad_id),
                       in_shardings=(state_sharding, batch_sharding),
                       out_shardings=(state_sharding, replicated), donate_argnums=0)
  eval_step = jax.jit(make_eval_step(model), in_shardings=(state_sharding.params,
                                                            batch_sharding),
                      out_shardings=replicated)

  pi, pc = jax.process_index(), jax.process_count()
  train_iter = data_lib.DevicePrefetcher(
      iter(data_lib.make_dataset(config, "train", train=True, process_index=pi,
                                 process_count=pc)), batch_sharding)
  eval_ds = data_lib.make_dataset(config, "validation", train=False, process_index=pi,
                                  process_count=pc)

  checkpointer = ckpt_lib.Checkpointer(workdir, keep=config.checkpoint.keep,
                                       use_async=bool(config.checkpoint["async"]))
  start = checkpointer.latest_step()
  if start is not None:
    state = checkpointer.restore(start, abstract, train_iter)
    logging.info("resumed from %s/checkpoints/%d", workdir, start)
  else:
    start = 0
    state = jax.jit(init_state, out_shardings=state_sharding)(jax.random.key(t.seed))

  peak = flops_lib.device_peak_flops(jax.devices()[0].device_kind, config.metrics.peak_tflops,
                                     dtype=s.model_cfg.dtype)
  peak_total = peak * jax.device_count() if peak else None
  writer = metrics_lib.MetricsWriter(workdir, enabled=is_writer, total_steps=t.steps)
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

  def flush_window(step: int, device_metrics: list, seconds: float, wait: float) -> dict:
    host = jax.device_get(device_metrics)
    loss = float(np.mean([m["loss"] for m in host]))
    if not np.isfinite(loss):
      latest = checkpointer.latest_step()
      raise NonFiniteLoss(
          f"non-finite loss at step {step} (window mean {loss}); last good checkpoint: "
          + (f"{workdir}/checkpoints/{latest}" if latest is not None else "none"))
    row = {
        "loss": loss,
        "mlm_accuracy": float(np.mean([m["mlm_accuracy"] for m in host])),
        "learning_rate": float(host[-1]["learning_rate"]),
        "grad_norm": float(host[-1]["grad_norm"]),
        **metrics_lib.throughput(
            steps=len(host), seconds=seconds, wait_seconds=wait,
            global_batch=t.batch_size, tokens=float(sum(m["tokens"] for m in host)),
            flops_per_step=s.flops_per_step, peak_flops_total=peak_total),
    }
    if step == start + len(host) and is_writer:  # first window of this process
      row["unigram_baseline"] = baseline
    return row

  for step in range(start + 1, t.steps + 1):
    batch = next(train_iter)
    state, m = train_step(state, batch)
    window.append(m)
    if pending is not None:  # the previous window's metrics are ready by now
      row = flush_window(*pending)
      writer.write(pending[0], row)
      writer.console(pending[0], row)
      last.update(row)
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
    if step % config.checkpoint.every == 0 or step == t.steps:
      checkpointer.save(step, state, train_iter)
  if pending is not None:
    row = flush_window(*pending)
    writer.write(pending[0], row)
    writer.console(pending[0], row)
    last.update(row)
  checkpointer.close()
  writer.close()
  last["step"] = int(jax.device_get(state.step))
  return last
