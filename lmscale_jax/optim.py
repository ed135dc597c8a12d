"""The optimizer: AdamW behind a global-norm clip, BERT's learning-rate schedule (linear warmup,
then linear or cosine decay), no weight decay on biases and LayerNorm parameters, and the
non-finite guard of ``train.nonfinite=skip``."""

from __future__ import annotations

import jax
import optax

SCHEDULES = ("linear", "cosine")
# "error": stop the run, naming the step and the last good checkpoint; "skip": drop the update
# and count it (metrics ``nonfinite_skipped``), stopping after max_consecutive_nonfinite in a row.
NONFINITE_MODES = ("error", "skip")
# optax.apply_if_finite applies a non-finite update anyway after this many in a row; the loop
# enforces train.max_consecutive_nonfinite itself, so that never happens.
_NEVER = 2**31 - 1


def learning_rate_schedule(train_config) -> optax.Schedule:
  t = train_config
  warmup = optax.linear_schedule(0.0, t.learning_rate, max(1, t.warmup_steps))
  decay_steps = max(1, t.steps - t.warmup_steps)
  end = t.learning_rate * t.end_lr_frac
  if t.schedule == "cosine":
    decay = optax.cosine_decay_schedule(t.learning_rate, decay_steps, alpha=t.end_lr_frac)
  else:
    decay = optax.linear_schedule(t.learning_rate, end, decay_steps)
  return optax.join_schedules([warmup, decay], [t.warmup_steps])


def decay_mask(params):
  # BERT's recipe: no weight decay on biases and LayerNorm parameters (all 1-D leaves here).
  return jax.tree.map(lambda p: p.ndim > 1, params)


def make_optimizer(train_config) -> optax.GradientTransformation:
  t = train_config
  optimizer = optax.chain(
      optax.clip_by_global_norm(t.clip_norm),
      optax.adamw(learning_rate_schedule(t), b1=t.b1, b2=t.b2, eps=t.eps,
                  weight_decay=t.weight_decay, mask=decay_mask))
  if t.nonfinite == "skip":
    # A NaN/inf gradient never reaches the parameters or the Adam moments. Only in skip mode:
    # error mode stops before any later checkpoint, and its step stays the plain program.
    optimizer = optax.apply_if_finite(optimizer, max_consecutive_errors=_NEVER)
  return optimizer
