"""The remote-code Hugging Face export: a model transformers' BERT cannot represent
(``model.norm="pre"``, ``model.positions="instruction"``) and the sequence classifier, as a
directory that carries its own modeling code.

  config.json                 model_type "lmscale_bert", auto_map → the two files below
  configuration_lmscale.py    LmscaleConfig      (copied from lmscale_jax/model/hf_remote/)
  modeling_lmscale.py         LmscaleModel, LmscaleForMaskedLM, LmscaleForSequenceClassification
  model.safetensors           BertForMaskedLM's parameter names (+ the variants' own):
                              lmscale_jax/model/hf_convert.py maps them

  AutoModelForMaskedLM.from_pretrained(DIR, trust_remote_code=True)

The two .py files are package data (torch + transformers; lmscale_jax never imports them).
This module holds what is particular to the variant: which runs need it
(:func:`needs_remote_code`), its config.json (:func:`remote_config`, :func:`config_problem`)
and the code files (:func:`write_code`). Nothing here reads or writes weights.
"""

from __future__ import annotations

import importlib.resources
import os

import ml_collections

from lmscale_jax.config import modes
from lmscale_jax.store import file_io

MODEL_TYPE = "lmscale_bert"
MLM = "LmscaleForMaskedLM"
CLASSIFIER = "LmscaleForSequenceClassification"
ARCHITECTURES = (MLM, CLASSIFIER)
CODE_FILES = ("configuration_lmscale.py", "modeling_lmscale.py")
AUTO_MAP = {
    "AutoConfig": "configuration_lmscale.LmscaleConfig",
    "AutoModel": "modeling_lmscale.LmscaleModel",
    "AutoModelForMaskedLM": f"modeling_lmscale.{MLM}",
    "AutoModelForSequenceClassification": f"modeling_lmscale.{CLASSIFIER}",
}
# The lmscale options the config.json carries: {field: the values modeling_lmscale.py takes}.
OPTIONS = {"positions": modes.POSITIONS, "norm": modes.NORMS,
           "packed_attention": modes.PACKED_ATTENTION}
_INTEGERS = ("cls_token_id", "next_token_id", "pad_token_id")


def needs_remote_code(cfg: ml_collections.ConfigDict) -> bool:
  """Whether a model has no ``BertForMaskedLM`` form: pre-LN, or instruction positions."""
  return cfg.norm != "post" or cfg.positions == "instruction"


def remote_config(cfg: ml_collections.ConfigDict, architecture: str = MLM,
                  labels: list[str] | None = None) -> dict:
  """config.json of a resolved model config (``labels``: a classifier's class names, index =
  class id). The fields are BertConfig's that change the computation, as hf_convert.hf_config
  writes them, plus the lmscale options and the [CLS]/[NEXT] ids the positions are counted by."""
  config = {
      "architectures": [architecture], "model_type": MODEL_TYPE, "auto_map": dict(AUTO_MAP),
      "vocab_size": int(cfg.vocab_size), "hidden_size": int(cfg.hidden),
      "num_hidden_layers": int(cfg.layers), "num_attention_heads": int(cfg.heads),
      "intermediate_size": int(cfg.ffn), "hidden_dropout_prob": float(cfg.dropout),
      "attention_probs_dropout_prob": float(cfg.attention_dropout),
      "max_position_embeddings": int(cfg.seq_len), "type_vocab_size": int(cfg.type_vocab_size),
      "initializer_range": float(cfg.initializer_range),
      "layer_norm_eps": float(cfg.layer_norm_eps), "pad_token_id": int(cfg.pad_id),
      "cls_token_id": int(cfg.cls_id), "next_token_id": int(cfg.next_id),
      "positions": str(cfg.positions), "norm": str(cfg.norm),
      "packed_attention": str(cfg.packed_attention), "dtype": "float32",
  }
  if labels is not None:
    config["id2label"] = {str(i): name for i, name in enumerate(labels)}
    config["label2id"] = {name: i for i, name in enumerate(labels)}
  return config


def config_problem(config: dict) -> str | None:
  """What makes a remote-code config.json one this model cannot take (a phrase), or None."""
  archs = config.get("architectures") or [MLM]
  if not set(archs) & set(ARCHITECTURES):
    return f"architectures={archs}: expected one of {list(ARCHITECTURES)}"
  for field, allowed in OPTIONS.items():
    if config.get(field) not in allowed:
      return f"{field}={config.get(field)!r}: expected one of {list(allowed)}"
  for field in _INTEGERS:
    if type(config.get(field)) is not int:
      return f"{field}={config.get(field)!r}: expected an integer token id"
  return None


def labels(config: dict) -> list[str]:
  """A classifier's class names, by class id, from its config.json's ``id2label``."""
  id2label = config.get("id2label") or {}
  return [id2label[str(i)] for i in range(len(id2label))]


def write_code(out_dir: str) -> None:
  """The modeling code (package data) into ``out_dir``, each file written atomically."""
  source = importlib.resources.files("lmscale_jax.model").joinpath("hf_remote")
  for name in CODE_FILES:
    file_io.atomic_write_bytes(os.path.join(out_dir, name), source.joinpath(name).read_bytes())
