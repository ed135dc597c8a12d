"""The config's history, in one place: keys added after runs already existed (:data:`VALUES`,
the value that reproduces what a run whose ``config.json`` lacks the key did) and keys renamed
(:data:`RENAMED`). A workdir resumes under a legacy value as unchanged
(``train.run_record.check_config_change``), and a run's config read back from ``config.json``
(:func:`complete`) has every key, so no reader needs a per-key fallback; an old spelling is
refused with its new name, on the command line (``config.loader``) and in a config file
(``config.checks``)."""

from __future__ import annotations

import copy

# Keys renamed: old spelling -> new (a config file or command line that still uses it is refused).
RENAMED = {"checkpoint.async": "checkpoint.async_save",
           "model.pre_ln": "model.norm"}  # pre_ln=True is norm=pre, False is norm=post

VALUES = {
    "model.packed_attention": "cross",  # one attention window per sequence
    "init_from": "",                    # random initial weights
    "train.grad_allreduce": "auto",
    "train.grad_accum_steps": 1,        # one microbatch per step
    "train.grad_allreduce_dtype": "float32",
    "train.warmup_fraction": 0.0,       # the warm-up is train.warmup_steps
    # Fine-tuning's levers (its config had none of these before the one train step): a
    # replicated state, the encoder without recomputation, jax's default dropout generator,
    # no fault injection; its train.nonfinite was always "error", so the skip limit is moot.
    "train.fsdp": False,
    "train.remat": "none",
    "train.dropout_rng": "threefry",
    "train.max_consecutive_nonfinite": 20,
    "train.inject_nonfinite_steps": "",
    # The classification task (finetune.task): a run from before it is a contrastive one.
    "finetune.task": "contrastive",
    "finetune.labels": "",
    "finetune.eval_labels": "",
    # The naming task's keys (finetune.task=name): unread by the tasks before it, so a run
    # from before them resumes unchanged under today's defaults.
    "finetune.name_min_count": 2,
    "finetune.name_calibration": 0.1,
    # A naming run from before library-own tokens were left out trained on every sub-token.
    "finetune.name_library_share": 0.0,
    # A classification run from before windows read each function's first window only.
    "finetune.windows": 1,
}


def upgrade_model(model: dict) -> dict:
  """A config's model section in today's keys: ``pre_ln`` (a bool) becomes ``norm`` ("pre" or
  "post"), and a missing ``positions`` is what such a run computed: its positions followed its
  attention windows (``packed_attention`` "segment": from 0 at each [CLS]; "cross": 0..S-1)."""
  out = dict(model)
  pre_ln = out.pop("pre_ln", False)
  out.setdefault("norm", "pre" if pre_ln else "post")
  if "positions" not in out:
    windows = out.get("packed_attention", VALUES["model.packed_attention"])
    out["positions"] = "segment" if windows == "segment" else "absolute"
  return out


def complete_record(record: dict) -> dict:
  """A run's ``config.json`` record (``{"config", "model"}``) with :func:`complete` applied to
  its config, and ``norm``/``positions`` in its resolved model (the shape keys a resume and the
  tools compare) taken from that completed config where the record predates them."""
  out = dict(record, config=complete(record["config"]))
  model = dict(record["model"])
  model.pop("pre_ln", None)
  completed = out["config"].get("model", {})
  for key, default in (("norm", "post"), ("positions", "segment")):
    model.setdefault(key, completed.get(key, default))
  out["model"] = model
  return out


def complete(tree: dict) -> dict:
  """``config.json``'s ``"config"`` (a nested dict) with each key of :data:`VALUES` it lacks set
  to its legacy value (keys of a section the config does not have are left out), and its model
  section in today's keys (:func:`upgrade_model`)."""
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
  if isinstance(out.get("model"), dict):
    out["model"] = upgrade_model(out["model"])
  return out
