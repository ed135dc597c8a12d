"""A sequence classifier as a Hugging Face directory: ``LmscaleForSequenceClassification``.

The classification fine-tune's parameters, ``{"bert": encoder (BertForMLM's tree; an MLM head
in it is not exported), "classifier": {"kernel" [H, C], "bias" [C]}}``, with the class names
(index = class id), as a remote-code directory (lmscale_jax/model/hf_remote_convert.py) that

  AutoModelForSequenceClassification.from_pretrained(DIR, trust_remote_code=True)

loads: the mean of the last hidden layer over the non-pad tokens ([CLS] and [SEP] included,
``model.contrastive.pool(h, ids, pad_id, "mean")``) → ``classifier`` (Linear H → C); config.json
has ``id2label``/``label2id``. Always remote code, whatever the encoder: BERT's classifier pools
the [CLS] vector through a tanh pooler, not this mean. Parameter names: the encoder's as in
:mod:`lmscale_jax.model.hf_convert` (``bert.…``) + ``classifier.weight`` [C, H] and
``classifier.bias`` [C]. The tokenizer files are the caller's (``store/tokenizer.write_hf_files``).

A naming fine-tune (model/name_head.py) is the same network read as independent sigmoids:
:func:`save_namer` writes it with its name sub-tokens as ``id2label``,
``problem_type: "multi_label_classification"`` (transformers' own key for that reading) and
the run's prediction rule as ``naming_rule``; :func:`load_namer` reads it back.
"""

from __future__ import annotations

import os

import ml_collections
import numpy as np

from lmscale_jax.model import hf_convert
from lmscale_jax.model import hf_remote_convert as remote
from lmscale_jax.model.name_head import RULES

HFError = hf_convert.HFError


def classifier_state_dict(params, cfg: ml_collections.ConfigDict) -> dict[str, np.ndarray]:
  """``{"bert", "classifier"}`` parameters → ``LmscaleForSequenceClassification`` names and
  layouts (float32 numpy)."""
  sd = hf_convert.to_hf_state_dict(params["bert"], cfg, bert=False, mlm=False)
  head = params["classifier"]
  sd["classifier.weight"] = np.ascontiguousarray(np.asarray(head["kernel"], np.float32).T)
  sd["classifier.bias"] = np.asarray(head["bias"], np.float32)
  return sd


def classifier_from_state_dict(sd, cfg: ml_collections.ConfigDict, classes: int,
                               where: str = "HF state dict") -> dict:
  """The inverse of :func:`classifier_state_dict`: ``{"bert": encoder without MLM head,
  "classifier": {"kernel", "bias"}}`` (float32 numpy)."""
  sd = {k: np.asarray(v, np.float32) for k, v in sd.items()}
  head = {}
  for key, leaf, shape in (("classifier.weight", "kernel", (classes, cfg.hidden)),
                           ("classifier.bias", "bias", (classes,))):
    have = sd[key].shape if key in sd else None
    if have != shape:
      raise HFError(f"{where}: {key!r} has shape {have}, expected {shape} ({classes} labels in "
                    f"id2label, hidden size {cfg.hidden})")
    a = sd.pop(key)
    head[leaf] = np.ascontiguousarray(a.T if leaf == "kernel" else a)
  return {"bert": hf_convert.from_hf_state_dict(sd, cfg, where, mlm=False), "classifier": head}


MULTI_LABEL = "multi_label_classification"
RULE_KEY = "naming_rule"


def save_classifier(params, cfg: ml_collections.ConfigDict, labels: list[str],
                    out_dir: str, extra: dict | None = None) -> None:
  """config.json (``id2label``/``label2id`` from ``labels``, plus ``extra``'s keys),
  model.safetensors and the modeling code into ``out_dir`` (an existing directory). ``cfg``:
  the resolved model config."""
  hf_convert.check_exportable(cfg)
  classes = int(np.shape(params["classifier"]["bias"])[0])
  if len(labels) != classes or len(set(labels)) != classes:
    raise HFError(f"the classifier has {classes} classes but {len(labels)} labels "
                  f"({len(set(labels))} distinct) were given: expected {classes} distinct names")
  config = remote.remote_config(cfg, remote.CLASSIFIER, [str(x) for x in labels])
  hf_convert.write_files(out_dir, classifier_state_dict(params, cfg), {**config, **(extra or {})})
  remote.write_code(out_dir)


def load_classifier(hf_dir: str, cfg: ml_collections.ConfigDict) -> tuple[dict, list[str]]:
  """A :func:`save_classifier` directory → (``{"bert": encoder without MLM head,
  "classifier": {"kernel", "bias"}}`` float32 numpy, the class names by id). ``cfg``: the
  resolved model config (``inference/model_files.hf_model_config`` + the tokenizer)."""
  path = os.path.join(hf_dir, hf_convert.CONFIG)
  config = hf_convert.read_config(hf_dir)
  if not hf_convert.is_classifier(config):
    raise HFError(f"{path}: architectures={config.get('architectures')}, expected "
                  f"[{remote.CLASSIFIER!r}] (a classifier lmscale exported)")
  try:
    names = remote.labels(config)
  except (KeyError, AttributeError):
    raise HFError(f"{path}: id2label={config.get('id2label')!r} does not name the classes "
                  "0, 1, …") from None
  sd = hf_convert.read_weights(hf_dir)
  return (classifier_from_state_dict(sd, cfg, len(names),
                                     os.path.join(hf_dir, hf_convert.WEIGHTS)), names)


def save_namer(params, cfg: ml_collections.ConfigDict, tokens: list[str], rule: dict,
               out_dir: str) -> None:
  """A naming fine-tune's ``{"bert", "classifier"}`` (one output per name sub-token,
  ``tokens[i]``) as a multi-label ``LmscaleForSequenceClassification``; ``rule``: its
  prediction rule (name_head.RULES), which ``lmscale name --hf`` applies."""
  save_classifier(params, cfg, tokens, out_dir,
                  {"problem_type": MULTI_LABEL, RULE_KEY: dict(rule)})


def is_namer(config: dict) -> bool:
  """Whether a config.json is a naming export's (:func:`save_namer`)."""
  return hf_convert.is_classifier(config) and config.get("problem_type") == MULTI_LABEL


def load_namer(hf_dir: str, cfg: ml_collections.ConfigDict) -> tuple[dict, list[str], dict]:
  """A :func:`save_namer` directory → (its ``{"bert", "classifier"}`` parameters, the name
  sub-tokens by output, the prediction rule)."""
  config = hf_convert.read_config(hf_dir)
  path = os.path.join(hf_dir, hf_convert.CONFIG)
  rule = config.get(RULE_KEY)
  if not is_namer(config) or not isinstance(rule, dict) or rule.get("kind") not in RULES:
    raise HFError(f"{path}: problem_type={config.get('problem_type')!r}, "
                  f"{RULE_KEY}={rule!r}: not a naming model (lmscale export-hf of a lmscale "
                  "finetune --task name run makes one)")
  params, tokens = load_classifier(hf_dir, cfg)
  return params, tokens, rule
