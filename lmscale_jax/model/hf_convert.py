"""The Hugging Face side of the model: ``BertForMaskedLM`` weights and ``BertConfig``.

A 1:1 renaming, no arithmetic: :func:`to_hf_state_dict` / :func:`from_hf_state_dict` map the
parameter tree of ``model.BertForMLM`` onto ``BertForMaskedLM.state_dict()`` names and
layouts (a Linear weight is our Dense kernel transposed; the decoder is tied to the word
embeddings, as in BERT). :func:`hf_config` gives every ``BertConfig`` field that changes the
computation, from the resolved model config (so from a run's own ``config.json``: no dataset).
:func:`model_keys` is the inverse (``--config.init_from``, lmscale import-hf).

Files, read and written with ``safetensors`` (no torch needed here): an HF model directory is
``config.json`` + ``model.safetensors`` (+ the tokenizer files, lmscale_jax/store/tokenizer.py).

``model.norm="pre"`` and ``model.positions="instruction"`` have no transformers BERT
equivalent: BERT, RoBERTa and ELECTRA are post-LN with a position table, and Megatron-BERT,
the pre-LN one (``MegatronBertForMaskedLM``: LayerNorms on the branch inputs plus a final one),
has no LayerNorm after the embeddings, which ours keeps. :func:`check_bert` refuses them as a
``BertForMaskedLM``; :func:`save_model` exports them with remote code instead
(``LmscaleForMaskedLM``: lmscale_jax/model/hf_remote_convert.py), whose parameter names are
BERT's plus ``bert.embeddings.{instruction,argument}_embeddings`` and
``bert.encoder.final_LayerNorm``: one mapping serves both. So does the sequence classifier's
encoder (lmscale_jax/model/hf_classifier.py, ``LmscaleForSequenceClassification``: ``bert.*``
+ ``classifier.{weight,bias}``), always remote code (its masked-mean pooling is not BERT's).
"""

from __future__ import annotations

import json
import os

import jax
import ml_collections
import numpy as np

from lmscale_jax.model import bert as model_lib
from lmscale_jax.model import hf_dir_checks as dir_checks
from lmscale_jax.model import hf_remote_convert as remote
from lmscale_jax.store import dataset, file_io
from lmscale_jax.store import tokenizer as toklib

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
ARCHITECTURE = "BertForMaskedLM"


HFError = dir_checks.HFError  # an HF directory, or a model option, the mapping cannot take


# --------------------------------------------------------------------------- weights
_HF_LAYER = {  # our per-layer module → BertLayer submodule in transformers
    "query": "attention.self.query",
    "key": "attention.self.key",
    "value": "attention.self.value",
    "attention_output": "attention.output.dense",
    "attention_LayerNorm": "attention.output.LayerNorm",
    "intermediate": "intermediate.dense",
    "output": "output.dense",
    "output_LayerNorm": "output.LayerNorm",
}
_HF_TOP = {
    ("embeddings", "word_embeddings"): "bert.embeddings.word_embeddings",
    ("embeddings", "position_embeddings"): "bert.embeddings.position_embeddings",
    ("embeddings", "instruction_embeddings"): "bert.embeddings.instruction_embeddings",
    ("embeddings", "argument_embeddings"): "bert.embeddings.argument_embeddings",
    ("embeddings", "token_type_embeddings"): "bert.embeddings.token_type_embeddings",
    ("embeddings", "LayerNorm"): "bert.embeddings.LayerNorm",
    ("final_LayerNorm",): "bert.encoder.final_LayerNorm",
    ("mlm_transform",): "cls.predictions.transform.dense",
    ("mlm_LayerNorm",): "cls.predictions.transform.LayerNorm",
}
# The modules a model option adds or removes (the rest are in every model).
_HF_ONLY_IF = {
    ("embeddings", "position_embeddings"): lambda cfg: cfg.positions != "instruction",
    ("embeddings", "instruction_embeddings"): lambda cfg: cfg.positions == "instruction",
    ("embeddings", "argument_embeddings"): lambda cfg: cfg.positions == "instruction",
    ("final_LayerNorm",): lambda cfg: cfg.norm == "pre",
}
_MLM_HEAD = (("mlm_transform",), ("mlm_LayerNorm",))
# flax leaf → (torch leaf, whether the array is transposed: Linear stores weight as (out, in)).
_HF_LEAF = {"kernel": ("weight", True), "bias": ("bias", False), "scale": ("weight", False),
            "embedding": ("weight", False)}
# Aliases of tied tensors that HF's state_dict also lists; checked on load, not stored twice.
HF_TIED = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
           "cls.predictions.decoder.bias": "cls.predictions.bias"}
# Non-parameter buffers some transformers versions persist; BertModel's pooler, which the MLM
# objective never trains (BertForMaskedLM has none; a BertForPreTraining checkpoint does).
HF_IGNORED = ("bert.embeddings.position_ids", "bert.embeddings.token_type_ids")
_HF_IGNORED_PREFIXES = ("bert.pooler.", "cls.seq_relationship.")


def check_exportable(cfg: ml_collections.ConfigDict) -> None:
  """Refuses a model no export represents (one line): an option value this version of the
  modeling code does not know (a config.json written by a newer lmscale_jax)."""
  for key, allowed in remote.OPTIONS.items():
    if cfg[key] not in allowed:
      raise HFError(f"model.{key}={cfg[key]!r} cannot be exported: the exported modeling code "
                    f"knows {list(allowed)}")


def check_bert(cfg: ml_collections.ConfigDict) -> None:
  """Refuses a model option transformers' BERT does not represent (one line)."""
  if cfg.norm == "pre":
    raise HFError(
        "model.norm='pre' cannot be exported as BertForMaskedLM: transformers' BERT is post-LN, "
        "and its pre-LN BERT (MegatronBertForMaskedLM) has no LayerNorm after the embeddings, "
        "which this model has; only post-LN runs (model.norm=post) export that way (save_model "
        "exports it with remote code)")
  if cfg.positions == "instruction":
    raise HFError(
        "model.positions='instruction' cannot be exported as BertForMaskedLM: BERT adds a "
        "position table, this model adds instruction and argument embeddings counted from "
        "[NEXT]; only positions=segment or absolute runs export that way (save_model exports it "
        "with remote code)")


def _module_map(cfg, mlm: bool = True) -> dict[tuple[str, ...], str]:
  """Our module path → its torch name, for the modules ``cfg`` has (``mlm``: the MLM head's
  too). BERT's names, and the variants' own where they have more."""
  mapping = {path: name for path, name in _HF_TOP.items()
             if _HF_ONLY_IF.get(path, bool)(cfg) and (mlm or path not in _MLM_HEAD)}
  for i in range(cfg.layers):
    for ours, theirs in _HF_LAYER.items():
      mapping[(f"layer_{i}", ours)] = f"bert.encoder.layer.{i}.{theirs}"
  return mapping


def _renamed(params, mapping) -> dict[str, np.ndarray]:
  sd = {}
  for path, modname in mapping.items():
    node = params
    for p in path:
      node = node[p]
    for leaf, value in node.items():
      name, transpose = _HF_LEAF[leaf]
      a = np.asarray(value, np.float32)
      sd[f"{modname}.{name}"] = np.ascontiguousarray(a.T if transpose else a)
  return sd


def to_hf_state_dict(params, cfg: ml_collections.ConfigDict, *, tied_aliases: bool = True,
                     bert: bool = True, mlm: bool = True) -> dict[str, np.ndarray]:
  """Parameters → ``BertForMaskedLM.state_dict()`` names and layouts (float32 numpy).
  ``tied_aliases=False`` leaves out the decoder's names (what ``save_pretrained`` stores);
  ``bert=False``: ``LmscaleForMaskedLM``'s (any model option; no decoder names); ``mlm=False``:
  the encoder's alone (an MLM head in ``params`` is left out)."""
  if bert:
    check_bert(cfg)
  sd = _renamed(params, _module_map(cfg, mlm))
  if not mlm:
    return sd
  sd["cls.predictions.bias"] = np.asarray(params["mlm_bias"], np.float32)
  if tied_aliases and bert:
    for alias, source in HF_TIED.items():
      sd[alias] = sd[source]
  return sd


def from_hf_state_dict(sd, cfg: ml_collections.ConfigDict, where: str = "HF state dict", *,
                       mlm: bool = True) -> dict:
  """``BertForMaskedLM`` or ``LmscaleForMaskedLM`` state dict (numpy or CPU torch tensors) →
  parameters (float32 numpy); ``mlm=False``: the encoder's alone (no MLM head expected).

  Every parameter must be present with the shape ``cfg`` implies; the decoder must be tied to
  the word embeddings (this model has no separate decoder matrix); unknown keys are an error.
  """
  sd = {k: np.asarray(v, np.float32) for k, v in sd.items()}
  expected = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.key(0)))
  used = set()

  def take(key, shape):
    if key not in sd:
      raise HFError(f"{where} lacks {key!r}")
    if sd[key].shape != tuple(shape):
      raise HFError(f"{where}: {key!r} has shape {sd[key].shape}, the model config implies "
                    f"{tuple(shape)}")
    used.add(key)
    return sd[key]

  params: dict = {}
  for path, modname in _module_map(cfg, mlm).items():
    want = expected
    for p in path:
      want = want[p]
    node = params
    for p in path:
      node = node.setdefault(p, {})
    for leaf, spec in want.items():
      name, transpose = _HF_LEAF[leaf]
      shape = spec.shape[::-1] if transpose else spec.shape
      a = take(f"{modname}.{name}", shape)
      node[leaf] = np.ascontiguousarray(a.T if transpose else a)
  if mlm:
    params["mlm_bias"] = take("cls.predictions.bias", (cfg.vocab_size,))
  for alias, source in HF_TIED.items():
    if mlm and alias in sd:
      if not np.array_equal(sd[alias], sd[source]):
        raise HFError(f"{where}: {alias!r} differs from {source!r}: this model ties them")
      used.add(alias)
  unexpected = sorted(k for k in set(sd) - used - set(HF_IGNORED)
                      if not k.startswith(_HF_IGNORED_PREFIXES))
  if unexpected:
    raise HFError(f"{where} has keys BertForMLM does not map: {unexpected}")
  return params


# --------------------------------------------------------------------------- config
def hf_config(cfg: ml_collections.ConfigDict) -> dict:
  """The ``BertConfig`` (as config.json) of a resolved model config: every field that changes
  the computation (``layer_norm_eps`` and ``max_position_embeddings`` too: left at
  transformers' defaults the logits drift by ~2e-4), plus the dropout and init values."""
  check_bert(cfg)
  return {
      "architectures": [ARCHITECTURE], "model_type": "bert",
      "vocab_size": int(cfg.vocab_size), "hidden_size": int(cfg.hidden),
      "num_hidden_layers": int(cfg.layers), "num_attention_heads": int(cfg.heads),
      "intermediate_size": int(cfg.ffn),
      "hidden_act": "gelu",  # exact (erf) GELU, as model.py
      "hidden_dropout_prob": float(cfg.dropout),
      "attention_probs_dropout_prob": float(cfg.attention_dropout),
      "max_position_embeddings": int(cfg.seq_len), "type_vocab_size": int(cfg.type_vocab_size),
      "initializer_range": float(cfg.initializer_range),
      "layer_norm_eps": float(cfg.layer_norm_eps), "pad_token_id": int(cfg.pad_id),
      "position_embedding_type": "absolute", "tie_word_embeddings": True,
      "is_decoder": False, "add_cross_attention": False, "dtype": "float32",
  }


# config.model key ← BertConfig field, for the keys that fix the parameter shapes or the
# arithmetic of the forward pass.
MODEL_KEYS = {"layers": "num_hidden_layers", "hidden": "hidden_size",
              "heads": "num_attention_heads", "ffn": "intermediate_size",
              "vocab_size": "vocab_size", "seq_len": "max_position_embeddings",
              "type_vocab_size": "type_vocab_size", "layer_norm_eps": "layer_norm_eps"}
# BertConfig values this model has no other option for (field: (what it must be, default)).
_FIXED = {"hidden_act": ("gelu", "gelu"), "position_embedding_type": ("absolute", "absolute"),
          "is_decoder": (False, False), "add_cross_attention": (False, False),
          "tie_word_embeddings": (True, True)}


def read_config(hf_dir: str) -> dict:
  """``HF_DIR/config.json``, checked to be a BERT or an lmscale remote-code export this model
  can take (one line otherwise)."""
  path = os.path.join(hf_dir, CONFIG)
  if not os.path.isdir(hf_dir):
    raise HFError(f"{hf_dir}: not a directory (expected a Hugging Face model directory with "
                  f"{CONFIG} and {WEIGHTS}, e.g. one lmscale export-hf wrote)")
  kind = file_io.not_regular(path)
  if kind:  # a FIFO would block the read forever
    raise HFError(f"{path} is {kind}: expected the model's {CONFIG} file")
  try:
    with open(path) as f:
      config = json.load(f)
  except FileNotFoundError:
    raise HFError(f"{hf_dir} has no {CONFIG}: not a Hugging Face model directory") from None
  except (ValueError, UnicodeDecodeError) as e:
    raise HFError(f"{path}: not valid JSON ({e})") from None
  if not isinstance(config, dict):
    raise HFError(f"{path}: a JSON {type(config).__name__}, expected an object (a model's "
                  f"{CONFIG})")
  kind, archs = config.get("model_type"), config.get("architectures") or [ARCHITECTURE]
  if kind == remote.MODEL_TYPE:
    if problem := remote.config_problem(config):
      raise HFError(f"{path}: {problem} (an lmscale export, model_type {remote.MODEL_TYPE!r})")
  elif kind != "bert" or ARCHITECTURE not in archs:
    raise HFError(f"{path}: model_type={kind!r}, architectures={archs}: only BERT "
                  f"(model_type 'bert', {ARCHITECTURE}) or an lmscale export (model_type "
                  f"{remote.MODEL_TYPE!r}) maps onto this model")
  for field, (want, default) in _FIXED.items():
    if kind == "bert" and config.get(field, default) != want:
      raise HFError(f"{path}: {field}={config[field]!r}; this model only has {want!r}")
  if problem := dir_checks.config_problem(config):  # before any value is used
    raise HFError(f"{path}: {problem} (a Hugging Face model's {CONFIG})")
  return config


def model_keys(hf_dir: str) -> dict:
  """``{config.model key: value}`` that a run starting from ``hf_dir`` must have."""
  config = read_config(hf_dir)
  keys = {k: config[f] for k, f in MODEL_KEYS.items()}
  keys["norm"] = "post"
  if config["model_type"] == remote.MODEL_TYPE:
    keys.update(norm=config["norm"], positions=config["positions"])
  return keys


def is_classifier(config: dict) -> bool:
  """Whether a config.json (:func:`read_config`) is a sequence classifier's (no MLM head)."""
  return remote.CLASSIFIER in (config.get("architectures") or [])


def check_matches_model_config(hf_dir: str, model_config) -> None:
  """``config.init_from``: ``config.model`` has the shape of the HF model (vocab_size and
  seq_len may be 0: the dataset's, compared with the HF model's when training starts;
  positions "auto" becomes the HF model's, :func:`positions_of`)."""
  keys = model_keys(hf_dir)
  for key, value in keys.items():
    ours = model_config[key]
    if (key in ("vocab_size", "seq_len") and ours == 0) or (key, ours) == ("positions", "auto"):
      continue
    if ours != value:
      raise HFError(
          f"init_from={hf_dir}: its {CONFIG} has {MODEL_KEYS.get(key, key)}={value!r} but "
          f"model.{key}={ours!r}; set --config.model.{key}={value} (lmscale import-hf writes "
          "a config with every such key)")
  if "positions" not in keys and model_config.positions == "instruction":
    raise HFError(
        f"init_from={hf_dir} is a BertForMaskedLM (one position table) but "
        "model.positions='instruction' has instruction and argument tables instead; set "
        "--config.model.positions=segment (or auto, which takes the start model's)")


def positions_of(keys: dict) -> str:
  """The ``model.positions`` of the HF model whose :func:`model_keys` are ``keys``: an lmscale
  remote-code export's own; a BertForMaskedLM's one position table is what "segment" loads
  (and "absolute")."""
  return keys.get("positions", "segment")


# --------------------------------------------------------------------------- files
def read_weights(hf_dir: str) -> dict:
  """``HF_DIR/model.safetensors`` as {name: float32 numpy}, or one line saying why not."""
  from safetensors.numpy import load_file

  path = os.path.join(hf_dir, WEIGHTS)
  if not os.path.exists(path):
    other = [n for n in ("pytorch_model.bin", "model.safetensors.index.json", "tf_model.h5")
             if os.path.exists(os.path.join(hf_dir, n))]
    hint = (f" (it has {other[0]}: re-save it with save_pretrained(DIR, "
            "safe_serialization=True) as one file)" if other else "")
    raise HFError(f"{hf_dir} has no {WEIGHTS}{hint}")
  try:
    sd = load_file(path)
  except Exception as e:  # safetensors raises its own SafetensorError on a bad header
    raise HFError(f"{path}: not a readable safetensors file ({e})") from None
  return sd


def load_params(hf_dir: str, cfg: ml_collections.ConfigDict) -> dict:
  """``HF_DIR/model.safetensors`` → parameters for ``cfg`` (float32 numpy): a BERT's or an
  lmscale remote-code export's masked LM."""
  sd = read_weights(hf_dir)
  if is_classifier(read_config(hf_dir)):
    raise HFError(f"{hf_dir} is a sequence classifier ({remote.CLASSIFIER}): it has no MLM "
                  "head; give the masked LM it was fine-tuned from (load it with "
                  "lmscale_jax/model/hf_classifier.py)")
  path = os.path.join(hf_dir, WEIGHTS)
  tied = HF_TIED["cls.predictions.decoder.weight"]
  if tied not in sd and "cls.predictions.decoder.weight" in sd:  # saved under the alias
    sd[tied] = sd["cls.predictions.decoder.weight"]
  return from_hf_state_dict(sd, cfg, where=path)


def save_model(params, cfg: ml_collections.ConfigDict, out_dir: str) -> None:
  """config.json + model.safetensors (float32, the decoder left to the tie) into ``out_dir``:
  a ``BertForMaskedLM``, or where BERT has no such model (:func:`check_bert`) an
  ``LmscaleForMaskedLM`` with its modeling code (``trust_remote_code=True``)."""
  check_exportable(cfg)
  if remote.needs_remote_code(cfg):
    write_files(out_dir, to_hf_state_dict(params, cfg, bert=False), remote.remote_config(cfg))
    remote.write_code(out_dir)
  else:
    write_files(out_dir, to_hf_state_dict(params, cfg, tied_aliases=False), hf_config(cfg))


def write_files(out_dir: str, sd: dict, config: dict) -> None:
  """model.safetensors (``sd``) and config.json (``config``) into ``out_dir``, atomically."""
  from safetensors.numpy import save

  file_io.atomic_write_bytes(os.path.join(out_dir, WEIGHTS),
                             save(sd, metadata={"format": "pt"}))
  file_io.atomic_write_json(os.path.join(out_dir, CONFIG), config)


# --------------------------------------------------------------------------- pretraining from HF
def vocabulary(hf_dir: str) -> dict[str, int]:
  """The HF model's token → id: its tokenizer.json, else a classic BERT vocab.txt."""
  if os.path.lexists(os.path.join(hf_dir, dataset.TOKENIZER)):
    return dir_checks.read_tokenizer(hf_dir).get_vocab(with_added_tokens=True)
  txt = os.path.join(hf_dir, "vocab.txt")
  if os.path.exists(txt):
    with open(txt, encoding="utf-8") as f:
      return {line.rstrip("\n"): i for i, line in enumerate(f)}
  raise HFError(f"{hf_dir} has no tokenizer ({dataset.TOKENIZER} or vocab.txt): its "
                "vocabulary cannot be checked against the dataset's")


def check_same_vocabulary(hf_dir: str, dataset_dir: str) -> None:
  """The dataset's token ids mean what the HF model's mean (one line naming a difference)."""
  ours_path = os.path.join(dataset_dir, dataset.TOKENIZER)
  theirs = vocabulary(hf_dir)
  ours = toklib.load(ours_path).get_vocab(with_added_tokens=True)
  if ours == theirs:
    return
  by_id = {i: t for t, i in theirs.items()}
  diff = next((f"id {i} is {t!r} in the dataset, {by_id.get(i)!r} in {hf_dir}"
               for t, i in sorted(ours.items(), key=lambda x: x[1]) if by_id.get(i) != t),
              "the HF vocabulary has extra tokens")
  raise HFError(f"{hf_dir}'s vocabulary ({len(theirs)} tokens) differs from the dataset's "
                f"({ours_path}, {len(ours)} tokens): {diff}. Prepare the dataset with its "
                f"tokenizer: lmscale prepare binary (or text) --tokenizer {hf_dir}/{dataset.TOKENIZER}")


def init_params(hf_dir: str, model_cfg, meta) -> dict:
  """``config.init_from``: the HF model's parameters for the resolved ``model_cfg`` (float32
  numpy), after checking its shape and vocabulary against this run's model and dataset."""
  check_matches_model_config(hf_dir, model_cfg)
  check_same_vocabulary(hf_dir, meta.path)
  return load_params(hf_dir, model_cfg)


def init_state(hf_dir: str, state, steps, setup):
  """A fresh TrainState with the HF model's parameters, placed as ``steps`` places them (the
  optimizer state of a fresh run does not depend on the parameter values). Every process
  reads the files and builds its own shards."""
  params = init_params(hf_dir, setup.model_cfg, setup.meta)
  placed = jax.tree.map(
      lambda a, sh: jax.make_array_from_callback(a.shape, sh, lambda index: a[index]),
      params, steps.state_sharding.params)
  return state.replace(params=placed)
