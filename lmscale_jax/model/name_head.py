"""The function-naming head of a naming fine-tune (finetune/name_run.py): the sequence
classifier's network (:class:`lmscale_jax.model.classifier.SequenceClassifier`: masked-mean
pooling → Dense to one logit per name sub-token), read as independent sigmoids (XFL's
multi-label head) over the run's name-token vocabulary, and the two files that give those
outputs their meaning:

* ``name_vocab.json``: the vocabulary (output ``i`` is ``tokens[i]``: every sub-token of the
  training names seen at least ``min_count`` times), checked against the head's size wherever
  a model is loaded (another file in its place is refused in one line);
* the prediction rule (:data:`RULES`): which of a function's scored tokens make its name,
  chosen on a held-out slice of the training data and saved in ``naming_eval.json``.

Parameters are the classifier's ``{"bert", "classifier": {"kernel" [H, V], "bias" [V]}}``,
so a naming run exports as ``LmscaleForSequenceClassification`` with
``problem_type="multi_label_classification"`` (model/hf_classifier.py).
"""

from __future__ import annotations

import json
import os

import numpy as np

from lmscale_jax.errors import UserError
from lmscale_jax.store import file_io

VOCAB = "name_vocab.json"
VOCAB_FORMAT = "lmscale_jax.name_vocab/1"
# threshold: every token with p >= t; threshold_min1: the same, and the best token where none
# reaches t; topk: the k best tokens.
RULES = ("threshold", "threshold_min1", "topk")
DEFAULT_RULE = {"kind": "threshold_min1", "threshold": 0.5}  # a run never evaluated
EVAL_REPORT = "naming_eval.json"  # a run's held-out scores and its chosen rule
TOP = 32  # a function's best tokens every rule chooses among (the evaluation reads back these)


class NameVocabError(UserError, ValueError):
  """A name vocabulary that does not fit the model or the task."""


def save_vocab(directory: str, tokens: list[str], min_count: int, source_sha256: str) -> None:
  file_io.atomic_write_json(os.path.join(directory, VOCAB),
                            {"format": VOCAB_FORMAT, "tokens": list(tokens),
                             "min_count": int(min_count), "labels_sha256": source_sha256})


def load_vocab(directory: str) -> dict:
  """A naming run's (or export's) ``name_vocab.json``, checked for its shape."""
  path = os.path.join(directory, VOCAB)
  saved = file_io.read_json(path, "the run's name vocabulary",
                            "a naming run (lmscale finetune --task name) writes it when it starts")
  tokens = saved.get("tokens") if isinstance(saved, dict) else None
  if not isinstance(saved, dict) or saved.get("format") != VOCAB_FORMAT \
      or not isinstance(tokens, list) or not tokens \
      or not all(isinstance(t, str) for t in tokens) or len(set(tokens)) != len(tokens):
    raise NameVocabError(f"{path}: not a name vocabulary (expected {{\"format\": "
                         f"\"{VOCAB_FORMAT}\", \"tokens\": [distinct sub-tokens], …}})")
  return saved


def check_fits(tokens: list[str], outputs: int, where: str) -> None:
  """The vocabulary has one token per output of the head."""
  if len(tokens) != outputs:
    raise NameVocabError(f"{where}: the name vocabulary has {len(tokens)} tokens, the model's "
                         f"naming head {outputs} outputs: not the vocabulary this model was "
                         "trained with (restore its own name_vocab.json)")


def check_same(saved: list[str], tokens: list[str], where: str, fix: str) -> None:
  """A task's vocabulary is the one the model was trained with (same tokens, same order)."""
  if saved != tokens:
    new = sorted(set(tokens) - set(saved))[:3]
    gone = sorted(set(saved) - set(tokens))[:3]
    raise NameVocabError(
        f"{where}: the model's name vocabulary ({len(saved)} tokens) is not this task's "
        f"({len(tokens)} tokens; new {new}, missing {gone}): {fix}")


def sigmoid(logits: np.ndarray) -> np.ndarray:
  return 1.0 / (1.0 + np.exp(-np.asarray(logits, np.float64)))


def apply_rule(rule: dict, top_tokens: list[list[str]], top_probs: np.ndarray) -> list[list[str]]:
  """The predicted name of each function from its best tokens (best first) and their
  probabilities [N, K] (or lists, one per function, as long as its tokens) under ``rule``
  ({"kind": one of RULES, "threshold" or "k"})."""
  kind, out = rule["kind"], []
  for tokens, probs in zip(top_tokens, top_probs):
    if kind == "topk":
      out.append(list(tokens[:int(rule["k"])]))
      continue
    chosen = [t for t, p in zip(tokens, probs) if p >= float(rule["threshold"])]
    out.append(chosen or (list(tokens[:1]) if kind == "threshold_min1" else []))
  return out


def saved_rule(path: str) -> dict:
  """The prediction rule a run chose (its naming_eval.json's ``rule``), :data:`DEFAULT_RULE`
  where it has none yet (a run stopped before its first evaluation)."""
  try:
    with open(path) as f:
      rule = json.load(f).get("rule") or {}
  except (OSError, ValueError, AttributeError):
    return dict(DEFAULT_RULE)
  return rule if rule.get("kind") in RULES else dict(DEFAULT_RULE)
