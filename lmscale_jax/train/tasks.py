"""What a task plugs into the one training step (:mod:`lmscale_jax.train.steps`): its loss,
its metric sums and, through them, its batch structure. The step owns everything else (the
gradient paths, FSDP, accumulation, the reduction, the optimizer, ``train.nonfinite``).

Two kinds, by how the loss decomposes over the batch's rows:

* :class:`SumTask`: a sum over rows divided by a weight (MLM: cross-entropy summed over the
  predicted positions / their count; classification: over the rows / their count).
  Microbatches and devices are then independent: the gradients of ``loss_sum(microbatch) /
  W`` (``W`` the global batch's weight) sum exactly to the global mean loss's.
* :class:`BatchTask`: a loss over the per-row outputs of the whole global batch (contrastive:
  every row is the others' negative). The manual path gathers every device's outputs, takes
  the loss's gradient with respect to them, and pulls each device's share back through its
  own rows (GradCache, Gao et al. 2021: with accumulation a forward pass without gradients
  first, then one per microbatch with its vector-Jacobian product), so the negatives span
  the global batch whatever the microbatching.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from lmscale_jax.model import contrastive


@dataclasses.dataclass(frozen=True)
class SumTask:
  loss_sum: Callable  # (params, batch, rng) -> (loss summed over rows, {name: metric sum})
  weight: Callable    # batch -> the loss's denominator summed over its rows
  metrics: Callable   # ({name: sum over the global batch, "weight": W}) -> step metrics
  # params -> True per leaf the manual path may cast to the compute dtype before gathering it
  # (the model casts it anyway); None: every matrix
  compute_cast: Callable | None = None


@dataclasses.dataclass(frozen=True)
class BatchTask:
  embed: Callable     # (params, batch, rng) -> per-row outputs, leading axis = the batch's rows
  loss: Callable      # (outputs of the global batch) -> (loss, {name: step metric})
  sums: Callable      # batch -> {name: count summed over the batch} (e.g. tokens)
  compute_cast: Callable | None = None  # as SumTask's


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


def contrastive_task(model, labels: Callable, temperature: float, pad_id: int) -> BatchTask:
  """Fine-tuning's symmetric InfoNCE over in-batch negatives (:func:`contrastive.info_nce`) on
  batches of pair rows ``ids [B, 2, S]`` (anchor, positive). ``labels(params)``: "frozen" or
  "train" per leaf (:func:`stop_frozen`)."""

  def embed(params, ids, rng):
    b, _, s = ids.shape
    return model.apply({"params": stop_frozen(params, labels)}, ids.reshape(2 * b, s),
                       deterministic=False, rngs={"dropout": rng}).reshape(b, 2, -1)

  def loss(z):
    value, accuracy = contrastive.info_nce(z[:, 0], z[:, 1], temperature)
    return value, {"accuracy": accuracy}

  return BatchTask(embed=embed, loss=loss, sums=lambda ids: {"tokens": (ids != pad_id).sum()},
                   compute_cast=head_in_float32("projection"))


def classification_task(model, labels: Callable, pad_id: int) -> SumTask:
  """A classification fine-tune's cross-entropy (:mod:`lmscale_jax.model.classifier`) summed
  over the rows of batches ``{"ids" [B,S], "label" [B]}`` / their count; a row labelled -1
  counts nowhere. ``labels(params)``: "frozen" or "train" per leaf, as the contrastive task's."""

  def loss_sum(params, batch, rng):
    logits = model.apply({"params": stop_frozen(params, labels)}, batch["ids"],
                         deterministic=False, rngs={"dropout": rng})
    real = batch["label"] >= 0
    target = jnp.where(real, batch["label"], 0)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), target)
    correct = (jnp.argmax(logits, -1) == target) & real
    return (ce * real).sum(), {"correct": correct.sum(),
                               "tokens": (batch["ids"] != pad_id).sum()}

  def metrics(sums):
    return {"accuracy": sums["correct"] / jnp.maximum(sums["weight"], 1.0),
            "tokens": sums["tokens"]}

  return SumTask(loss_sum=loss_sum, weight=lambda b: (b["label"] >= 0).sum(dtype=jnp.float32),
                 metrics=metrics, compute_cast=head_in_float32("classifier"))


def naming_task(model, labels: Callable, pad_id: int) -> SumTask:
  """A naming fine-tune's loss (:mod:`lmscale_jax.model.name_head`): binary cross-entropy of
  one sigmoid per name sub-token, summed over the vocabulary and the rows of batches ``{"ids"
  [B,S], "targets" [B,V]}`` / the rows. Its metric: the batch's micro token F1 at p >= 0.5
  (``f1``; true positives, predicted and true tokens summed over devices first)."""

  def loss_sum(params, batch, rng):
    logits = model.apply({"params": stop_frozen(params, labels)}, batch["ids"],
                         deterministic=False, rngs={"dropout": rng}).astype(jnp.float32)
    target = batch["targets"].astype(jnp.float32)
    bce = optax.sigmoid_binary_cross_entropy(logits, target).sum(-1)
    said = (logits >= 0).astype(jnp.float32)
    return bce.sum(), {"hit": (said * target).sum(), "said": said.sum(), "real": target.sum(),
                       "tokens": (batch["ids"] != pad_id).sum()}

  def metrics(sums):
    hit = sums["hit"]
    return {"f1": 2 * hit / jnp.maximum(sums["said"] + sums["real"], 1.0),
            "tokens": sums["tokens"]}

  return SumTask(loss_sum=loss_sum, weight=lambda b: jnp.asarray(b["ids"].shape[0], jnp.float32),
                 metrics=metrics, compute_cast=head_in_float32("classifier"))


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
