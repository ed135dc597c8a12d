"""The training pairs of contrastive fine-tuning: a file in the similarity benchmark's format
(:mod:`lmscale_jax.similarity.function_groups`: a header line, then one source function per line with
its compiled ``variants``), and the batches drawn from it.

Step ``k`` (1-based) of a run with seed ``s`` takes B distinct groups and two different
variants of each, in a random order (anchor, positive), drawn by ``np.random.default_rng([s,
k])``: a function of (seed, step) alone, so a resumed run, or another process, draws exactly
the batch an uninterrupted run draws at that step. Every process draws the whole batch and
tokenises only its own rows (process p of P: rows ``p*B/P … (p+1)*B/P - 1``). A group is one
source function; two groups with byte-identical text (two copies of a helper) are still
negatives of each other, as in the benchmark.

:class:`PairBatches` is also the "data" item of a checkpoint
(:class:`lmscale_jax.finetune.batches.StepBatches`): it records the next step, the seed, the
batch size and the pairs file's sha256; a resume on other contents is refused.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from lmscale_jax.errors import UserError
from lmscale_jax.finetune import batches as finetune_batches
from lmscale_jax.inference import trained_model
from lmscale_jax.similarity import function_groups
from lmscale_jax.store import file_io


class PairsError(UserError, ValueError):
  """The pairs file cannot train: missing, not the format, or too few groups."""


@dataclasses.dataclass
class Pairs:
  path: str
  sha256: str
  texts: list[list[str]]      # per usable group: its variants' texts (sorted variant names)
  dropped: int                # groups with fewer than two variants

  def __len__(self) -> int:
    return len(self.texts)


def load(path: str, max_groups: int = 0, seed: int = 0) -> Pairs:
  """The groups of ``path`` that have at least two variants; with ``max_groups`` > 0, a
  random ``max_groups`` of them (drawn by ``default_rng([seed, 0])``, a stream no step uses,
  kept in file order): fewer labelled functions, for learning curves."""
  if not os.path.isfile(path):
    raise PairsError(f"--pairs {path}: no such file (a file lmscale similarity-build "
                     "wrote, e.g. from the training sources of lmscale similarity-sources)")
  try:
    _, groups = function_groups.load(path)
  except function_groups.FunctionGroupsError as e:
    raise PairsError(f"--pairs: {e}") from None
  texts = [[g["variants"][v]["text"] for v in sorted(g["variants"])] for g in groups]
  usable = [t for t in texts if len(t) >= 2]
  if not usable:
    raise PairsError(f"--pairs {path}: none of its {len(groups)} groups has two variants (a "
                     "pair needs the same function compiled two ways)")
  dropped = len(texts) - len(usable)
  if 0 < max_groups < len(usable):
    keep = np.sort(np.random.default_rng([seed, 0]).choice(len(usable), max_groups,
                                                            replace=False))
    usable = [usable[i] for i in keep.tolist()]
  return Pairs(path=path, sha256=file_io.sha256_file(path), texts=usable, dropped=dropped)


def check_enough(pairs: Pairs, batch_size: int) -> None:
  if len(pairs) < batch_size:
    raise PairsError(
        f"--pairs {pairs.path}: {len(pairs)} groups with two or more variants, fewer than "
        f"train.batch_size={batch_size} (each batch takes that many distinct functions): "
        f"give a batch size <= {len(pairs)} or a larger pairs file")


def draw(n_groups: int, variants: list[int], seed: int, step: int, batch_size: int) -> list:
  """Step ``step``'s batch: ``[(group, anchor variant, positive variant)] * batch_size``."""
  rng = np.random.default_rng([seed, step])
  groups = rng.choice(n_groups, batch_size, replace=False)
  out = []
  for g in groups.tolist():
    a, b = rng.choice(variants[g], 2, replace=False).tolist()
    out.append((g, a, b))
  return out


class PairBatches(finetune_batches.StepBatches):
  """This process's rows of each step's batch: int32 ``[B/P, 2, seq_len]`` token ids, each
  ``[CLS] text [SEP]`` cut at the model's length and padded
  (:class:`finetune_batches.StepBatches`)."""

  file_key = "pairs_sha256"

  def __init__(self, pairs: Pairs, model: trained_model.TrainedModel, *, seed: int,
               batch_size: int, process_index: int = 0, process_count: int = 1):
    check_enough(pairs, batch_size)
    super().__init__(model, pairs.sha256, seed=seed, batch_size=batch_size,
                     process_index=process_index, process_count=process_count)
    self.pairs = pairs
    self.variants = [len(t) for t in pairs.texts]

  def batch(self, step: int) -> np.ndarray:
    drawn = draw(len(self.pairs), self.variants, self.seed, step, self.batch_size)[self.rows]
    texts = self.pairs.texts
    ids = self.padded([self.encode((g, v), texts[g][v]) for g, a, b in drawn for v in (a, b)])
    return ids.reshape(len(drawn), 2, self.model.cfg.seq_len)

  def check_same_file(self, saved: dict) -> None:
    check_same_file(self.pairs, saved)


def check_same_file(pairs: Pairs, saved: dict) -> None:
  if "pairs_sha256" not in saved:  # trainer.check_workdir refuses such a workdir first
    raise PairsError(f"--pairs {pairs.path}: the checkpoint's data state records no pairs file "
                     "(not a fine-tuning run's checkpoint); use a new --workdir")
  finetune_batches.check_same_source("--pairs", pairs.path, pairs.sha256,
                                     saved.get("pairs_sha256"), PairsError)


def check_resume(pairs: Pairs, step_dir: str, process_index: int, process_count: int) -> None:
  """Before a resume writes anything: the checkpoint's batches came from ``pairs``' contents
  (its sampler state, :func:`finetune_batches.saved_state`)."""
  saved = finetune_batches.saved_state(step_dir, process_index, process_count)
  if saved is not None:
    check_same_file(pairs, saved)
