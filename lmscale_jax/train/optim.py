"""The optimizer: AdamW behind a global-norm clip, BERT's learning-rate schedule (linear warmup
over ``train.warmup_steps`` or a ``train.warmup_fraction`` of the steps, then linear or cosine
decay), no weight decay on biases and LayerNorm parameters, and the non-finite guard of
``train.nonfinite=skip``."""

from __future__ import annotations

import jax
import optax

# optax.apply_if_finite applies a non-finite update anyway after this many in a row; the loop
# enforces train.max_consecutive_nonfinite itself, so that never happens.
_NEVER = 2**31 - 1


def warmup_steps(train_config) -> int:
  """``train.warmup_steps``, or with ``train.warmup_fraction`` > 0 that fraction of
  ``train.steps``, truncated as undertale's ``int(warmup * total_steps)`` (its 2.5%: 0.025 ×
  10,000 steps = 250), so a ``--config.train.steps`` override keeps the fraction."""
  fraction = float(train_config.get("warmup_fraction", 0.0))
  if fraction > 0:
    return int(fraction * train_config.steps)
  return int(train_config.warmup_steps)


def learning_rate_schedule(train_config) -> optax.Schedule:
  t = train_config
  warmup_end = warmup_steps(t)
  warmup = optax.linear_schedule(0.0, t.learning_rate, max(1, warmup_end))
  decay_steps = max(1, t.steps - warmup_end)
  end = t.learning_rate * t.end_lr_frac
  if t.schedule == "cosine":
    decay = optax.cosine_decay_schedule(t.learning_rate, decay_steps, alpha=t.end_lr_frac)
  else:
    decay = optax.linear_schedule(t.learning_rate, end, decay_steps)
  return optax.join_schedules([warmup, decay], [warmup_end])


def decay_mask(params):
  # BERT's recipe: no weight decay on biases and LayerNorm parameters (all 1-D leaves here).
  return jax.tree.map(lambda p: p.ndim > 1, params)


def make_optimizer(train_config) -> optax.GradientTransformation:
  t = train_config
  schedule = learning_rate_schedule(t)
  if t.nonfinite != "skip":
    return optax.chain(
        optax.clip_by_global_norm(t.clip_norm),
        optax.adamw(schedule, b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay,
                    mask=decay_mask))
  # Skip mode: a NaN/inf gradient never reaches the parameters or the Adam moments (only in
  # skip mode: error mode stops before any later checkpoint, and its step stays the plain
  # program). The guard wraps adamw's parts but its learning-rate scaling
  # (optax.adamw = scale_by_adam -> add_decayed_weights -> scale_by_learning_rate): that
  # one's step count then advances on every step, skipped or not, so the rate applied is
  # schedule(state.step), the one logged; inside the guard it would lag by the skips.
  guarded = optax.apply_if_finite(
      optax.chain(optax.clip_by_global_norm(t.clip_norm),
                  optax.scale_by_adam(b1=t.b1, b2=t.b2, eps=t.eps),
                  optax.add_decayed_weights(t.weight_decay, decay_mask)),
      max_consecutive_errors=_NEVER)
  return optax.chain(guarded, optax.scale_by_learning_rate(schedule))


def finite_guard(opt_state) -> optax.ApplyIfFiniteState | None:
  """The ``train.nonfinite=skip`` guard's state (skipped-step counters), None in error mode."""
  return next((s for s in jax.tree.leaves(
      opt_state, is_leaf=lambda x: isinstance(x, optax.ApplyIfFiniteState))
               if isinstance(s, optax.ApplyIfFiniteState)), None)
