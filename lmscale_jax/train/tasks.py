"""What a task plugs into the one training step (:mod:`lmscale_jax.train.steps`): its loss,
its metric sums and, through them, its batch structure. The step owns everything else (the
gradient paths, FSDP, accumulation, the reduction, the optimizer, ``train.nonfinite``). The
tasks themselves live with their runs (:mod:`lmscale_jax.pretrain.mlm`, the fine-tunes'
``finetune/*_run.py``): the core names none.

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
