"""The sequence classifier of a classification fine-tune (undertale's
``undertale/models/classification.py``): the BERT encoder, the mean of its last hidden layer
over the non-pad tokens ([CLS] and [SEP] included: :func:`contrastive.pool`), a Dense layer
to one logit per class (float32).

  logits = SequenceClassifier(cfg, num_classes).apply({"params": p}, ids)  # [B, C] float32

``p`` is ``{"bert": BertForMLM parameters, "classifier": {"kernel" [H, C], "bias" [C]}}``: the
encoder's tree is the pretraining one, MLM head included (outside the loss, kept as it was).
The class names, sorted, are the workdir's ``labels.json`` (:func:`save_labels`): class ``i``
is ``names[i]``.
"""

from __future__ import annotations

import functools
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from lmscale_jax.errors import UserError
from lmscale_jax.model import bert as model_lib
from lmscale_jax.model import contrastive
from lmscale_jax.store import file_io

LABELS = "labels.json"  # the class names, in class-index order
LABELS_FORMAT = "lmscale_jax.labels/1"


class SequenceClassifier(nn.Module):
  cfg: ml_collections.ConfigDict   # the resolved BertForMLM config
  num_classes: int

  @nn.compact
  def __call__(self, input_ids, deterministic: bool = True):
    h = model_lib.BertForMLM(self.cfg, name="bert")(input_ids, None, deterministic)
    pooled = contrastive.pool(h, input_ids, self.cfg.pad_id, "mean")
    return nn.Dense(self.num_classes, dtype=jnp.float32, param_dtype=jnp.float32,
                    name="classifier")(pooled)


def init_head(cfg, num_classes: int, rng) -> dict:
  """Fresh ``{"kernel", "bias"}`` of the head (flax's Dense initialisers); call under jit."""
  return nn.Dense(num_classes, param_dtype=jnp.float32).init(
      rng, jnp.zeros((1, cfg.hidden), jnp.float32))["params"]


@functools.lru_cache(maxsize=8)
def _logits_fn(cfg_json: str, num_classes: int):
  model = SequenceClassifier(ml_collections.ConfigDict(json.loads(cfg_json)), num_classes)
  return jax.jit(lambda p, ids: model.apply({"params": p}, ids, deterministic=True))


def logits(cfg, params, ids: np.ndarray) -> np.ndarray:
  """ids [B,S] → the classifier's logits, float32 [B,C] (``params``: ``{"bert",
  "classifier"}``)."""
  fn = _logits_fn(cfg.to_json(), int(np.shape(params["classifier"]["bias"])[0]))
  return np.asarray(fn(params, jnp.asarray(ids)))


# --------------------------------------------------------------------------- files
def save_labels(directory: str, names: list[str]) -> None:
  file_io.atomic_write_json(os.path.join(directory, LABELS),
                            {"format": LABELS_FORMAT, "labels": list(names)})


def load_labels(directory: str) -> list[str]:
  """The class names of a classification run's (or export's) ``labels.json``."""
  path = os.path.join(directory, LABELS)
  saved = file_io.read_json(path, "the run's class names",
                            "a classification run writes it when it starts")
  saved = saved if isinstance(saved, dict) else {}
  names = saved.get("labels")
  if saved.get("format") != LABELS_FORMAT or not isinstance(names, list) or len(names) < 2 \
      or not all(isinstance(n, str) for n in names):
    raise UserError(f"{path}: not a class list (expected {{\"format\": \"{LABELS_FORMAT}\", "
                    "\"labels\": [two or more names]}})")
  return names
