"""The config's history, in one place: keys added after runs already existed (:data:`VALUES`,
the value that reproduces what a run whose ``config.json`` lacks the key did) and keys renamed
(:data:`RENAMED`). A workdir resumes under a legacy value as unchanged
(``train.workdir.check_config_change``), and a run's config read back from ``config.json``
(:func:`complete`) has every key, so no reader needs a per-key fallback; an old spelling is
refused with its new name, on the command line (``config.loader``) and in a config file
(``config.checks``)."""

from __future__ import annotations

import copy

# Keys renamed: old spelling -> new (a config file or command line that still uses it is refused).
RENAMED = {"checkpoint.async": "checkpoint.async_save"}

VALUES = {
    "model.packed_attention": "cross",  # one attention window per sequence
    "init_from": "",                    # random initial weights
    "train.grad_allreduce": "auto",
    "train.grad_accum_steps": 1,        # one microbatch per step
    "train.grad_allreduce_dtype": "float32",
    # Fine-tuning's levers (its config had none of these before the one train step): a
    # replicated state, the encoder without recomputation, jax's default dropout generator,
    # no fault injection; its train.nonfinite was always "error", so the skip limit is moot.
    "train.fsdp": False,
    "train.remat": "none",
    "train.dropout_rng": "threefry",
    "train.max_consecutive_nonfinite": 20,
    "train.inject_nonfinite_steps": "",
}


def complete(tree: dict) -> dict:
  """``config.json``'s ``"config"`` (a nested dict) with each key of :data:`VALUES` it lacks set
  to its legacy value (keys of a section the config does not have are left out)."""
  out = copy.deepcopy(tree)
  for key, value in VALUES.items():
    *sections, leaf = key.split(".")
    node = out
    for section in sections:
      node = node.get(section)
      if not isinstance(node, dict):
        break
    else:
      node.setdefault(leaf, value)
  return out
