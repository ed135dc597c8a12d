"""Config keys added after runs already existed, and the value that reproduces what a run whose
``config.json`` lacks the key did. The one place that knows them: a workdir resumes under that
value as unchanged (``train.workdir.check_config_change``), and a run's config read back from
``config.json`` (:func:`complete`) has every key, so no reader needs a per-key fallback."""

from __future__ import annotations

import copy

VALUES = {
    "model.packed_attention": "cross",  # one attention window per sequence
    "init_from": "",                    # random initial weights
    "train.grad_allreduce": "auto",
    "train.grad_accum_steps": 1,        # one microbatch per step
    "train.grad_allreduce_dtype": "float32",
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
