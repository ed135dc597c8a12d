"""A trained model, for the tools that use one (export, evaluate, fill-mask, embed): from a
training workdir's checkpoint or from a Hugging Face directory, with its tokenizer, and the
three things done with it: MLM logits at given positions, the last hidden layer, and (a
fine-tuned model: finetune/contrastive_run.py) its embeddings, pooled, projected and normalised,
or (a classification fine-tune: finetune/classify_run.py) its class logits, or (a naming
fine-tune: finetune/name_run.py) its name sub-tokens' probabilities.

A workdir needs no dataset: the model's shape is in the run's ``config.json`` (its ``model``
block holds the resolved vocab_size/seq_len); the parameters, and only they, come from its
checkpoint (:func:`abstract_params` is the restore target: no optimizer is built, no Adam
moment read; benchmarks/bench_model_load.py measures what that saves). Only the tokenizer is
read from the run's ``data.path`` (or ``--tokenizer``). Inference runs in float32, as
transformers does. A fine-tuning workdir (its config.json has a ``finetune`` section) keeps its
tokenizer in the workdir and its projection head beside the encoder (``head``), or, a
classification run (``finetune.task="classify"``), its classifier and class names
(``classifier``, the workdir's ``labels.json``), or a naming run (``"name"``) the same head
over its name sub-tokens (``namer``, the workdir's ``name_vocab.json``); an exported one has
``projection.*`` files, an exported naming run is a multi-label classifier
(model/hf_classifier.py: ``namer`` from its ``id2label`` and ``naming_rule``).

A directory is read once, by :mod:`lmscale_jax.inference.model_dir` (every file through
:mod:`lmscale_jax.inference.model_files`); here its weights are loaded and used.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from lmscale_jax.errors import UserError
from lmscale_jax.inference import model_dir, model_files
from lmscale_jax.model import bert as model_lib
from lmscale_jax.model import classifier as classifier_lib
from lmscale_jax.model import contrastive, hf_classifier, hf_convert, name_head
from lmscale_jax.store import dataset
from lmscale_jax.store import tokenizer as toklib


@dataclasses.dataclass
class TrainedModel:
  cfg: ml_collections.ConfigDict   # resolved model config (float32 compute)
  params: dict
  tokenizer: object                # tokenizers.Tokenizer, with tokenizer.with_hf_roles
  source: str                      # the workdir or HF directory
  step: int | None = None          # the checkpoint's step (workdir)
  run_config: ml_collections.ConfigDict | None = None
  head: dict | None = None         # fine-tuned: {"pool", "projection": {"kernel", "bias"}}
  # a classification fine-tune: {"labels": class names, "kernel" [H,C], "bias" [C]}
  classifier: dict | None = None
  # a naming fine-tune: {"tokens": name sub-tokens, "kernel" [H,V], "bias" [V]} (its
  # lmscale export-hf directory: + "rule", the prediction rule its config.json carries)
  namer: dict | None = None

  @property
  def special_ids(self) -> dict:
    return toklib.validate(self.tokenizer, self.source)

  @functools.cached_property
  def words_kept(self) -> int | None:
    """Words of a text that can reach the ids :func:`encode` keeps (``seq_len``), or None: the
    tokenizer is not word-local (``store/tokenizer.word_local``) and reads the whole text."""
    return int(self.cfg.seq_len) if toklib.word_local(self.tokenizer) else None


# --------------------------------------------------------------------------- loading
def abstract_params(run_config, cfg, classes: int = 0):
  """The parameters' shapes as the run's checkpoint holds them (the restore target of
  ``checkpoint.restore_params``), on this process's first device: the model's init under
  ``jax.eval_shape`` (nothing allocated, no optimizer built); for a fine-tuned run
  ``{"bert", "projection"}`` as ``finetune.finetune_state`` builds its state, for a
  classification run ``{"bert", "classifier"}`` (``classes`` outputs). Pretraining's
  parameters do not depend on ``predictions`` (``model.bert.init_params``)."""
  bert = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.key(0)))
  if model_dir.is_classifier(run_config) or model_dir.is_namer(run_config):
    bert = {"bert": bert, "classifier": jax.eval_shape(
        lambda: classifier_lib.init_head(cfg, classes, jax.random.key(0)))}
  elif model_dir.is_finetuned(run_config):
    projection = jax.eval_shape(lambda: contrastive.init_projection(
        cfg, int(run_config.finetune.proj_dim), jax.random.key(0)))
    bert = {"bert": bert, "projection": projection}
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), bert)


def from_dir(read: model_dir.ModelDir, step: int | None = None,
             data: dataset.DatasetMeta | None = None, naming: bool = False) -> TrainedModel:
  """The model of a directory already read (:func:`model_dir.read`): its weights loaded, no
  file read twice. ``step``: a run's checkpoint (the newest by default); ``data``: a dataset
  it is to read, checked against it before any weights are loaded
  (:func:`model_files.check_dataset`); ``naming``: see :func:`from_hf`."""
  if data is not None:
    model_files.check_dataset(read.cfg, data, read.path, same_seq_len=False,
                              record=read.record)
  if read.is_hf:
    return _hf_weights(read, naming)
  return _run_weights(read, step)


def _run_weights(read: model_dir.ModelDir, step: int | None) -> TrainedModel:
  run_config, workdir = read.run_config, read.path
  names = classifier_lib.load_labels(workdir) if model_dir.is_classifier(run_config) else []
  tokens = name_head.load_vocab(workdir)["tokens"] if model_dir.is_namer(run_config) else []
  try:
    step, params = model_files.restore_params(
        workdir, step, abstract_params(run_config, read.cfg, len(names) or len(tokens)))
  except ValueError as e:  # Orbax: a head of another size than the vocabulary says
    if not tokens or "shape" not in str(e):
      raise
    raise name_head.NameVocabError(
        f"{workdir}: its {name_head.VOCAB} has {len(tokens)} tokens, not the size of the "
        "checkpoint's naming head: not the vocabulary this model was trained with (restore "
        "its own name_vocab.json)") from None
  params, head, classes, namer = jax.device_get(params), None, None, None
  if names:
    params, classes = params["bert"], {"labels": names, **params["classifier"]}
  elif tokens:
    params, namer = params["bert"], {"tokens": tokens, **params["classifier"]}
  elif model_dir.is_finetuned(run_config):
    params, head = params["bert"], {"pool": run_config.finetune.pool,
                                    "projection": params["projection"]}
  return TrainedModel(cfg=read.cfg, params=params, tokenizer=read.tokenizer, source=workdir,
                      step=step, run_config=run_config, head=head, classifier=classes,
                      namer=namer)


def _hf_weights(read: model_dir.ModelDir, naming: bool) -> TrainedModel:
  hf_dir, cfg, tok = read.path, read.cfg, read.tokenizer
  if naming and hf_classifier.is_namer(hf_convert.read_config(hf_dir)):
    params, tokens, rule = hf_classifier.load_namer(hf_dir, cfg)
    return TrainedModel(cfg=cfg, params=params["bert"], tokenizer=tok, source=hf_dir,
                        namer={"tokens": tokens, "rule": rule, **params["classifier"]})
  return TrainedModel(cfg=cfg, params=hf_convert.load_params(hf_dir, cfg), tokenizer=tok,
                      source=hf_dir, head=contrastive.load_head(hf_dir, cfg.hidden))


def from_workdir(workdir: str, step: int | None = None, tokenizer_path: str = "",
                 dtype: str | None = "float32",
                 data: dataset.DatasetMeta | None = None) -> TrainedModel:
  """A run's model; ``data``: a dataset it is to read, checked against it before the
  restore."""
  return from_dir(model_dir.read_run(workdir, tokenizer_path, dtype), step, data)


def from_hf(hf_dir: str, data: dataset.DatasetMeta | None = None,
            naming: bool = False) -> TrainedModel:
  """An HF directory's model; ``naming``: a naming export's too (its encoder has no MLM head,
  which every other tool's model runs: for them it stays refused, as a classifier is, by
  ``hf_convert.load_params``)."""
  return from_dir(model_dir.read_hf(hf_dir), data=data, naming=naming)


def architecture(read: model_dir.ModelDir) -> TrainedModel:
  """A directory's model config and tokenizer, no weights (``params`` empty): what a model of
  the same architecture starting from fresh weights needs."""
  return TrainedModel(cfg=read.cfg, params={}, tokenizer=read.tokenizer, source=read.path)


@functools.lru_cache(maxsize=8)
def _init_fn(cfg_json: str):
  cfg = ml_collections.ConfigDict(json.loads(cfg_json))
  return jax.jit(lambda rng: model_lib.init_params(cfg, rng))


def random_init(model: TrainedModel, seed: int) -> TrainedModel:
  """The same architecture and tokenizer with the initial weights pretraining starts from
  (seed ``seed``): eval_similarity.py's random-init row, finetune's ``init.source=random``."""
  params = _init_fn(model.cfg.to_json())(jax.random.key(seed))
  return dataclasses.replace(model, params=jax.device_get(params), source="random-init",
                             step=None, head=None, classifier=None, namer=None)


def load(workdir: str = "", hf: str = "", step: int | None = None,
         tokenizer_path: str = "", data: dataset.DatasetMeta | None = None) -> TrainedModel:
  """``--workdir DIR [--step N] [--tokenizer F]`` or ``--hf DIR``: exactly one (``data``: see
  :func:`from_workdir`)."""
  if bool(workdir) == bool(hf):
    raise UserError("give exactly one of --workdir DIR (a training run) and --hf DIR (a "
                    "Hugging Face model directory)")
  if workdir:
    return from_workdir(workdir, step, tokenizer_path, data=data)
  return from_hf(hf, data)


# --------------------------------------------------------------------------- using it
def encode(model: TrainedModel, text: str) -> tuple[np.ndarray, bool]:
  """``[CLS] text [SEP]`` ids (int32) as training saw them, cut at ``seq_len``; and whether
  they were cut."""
  # Past seq_len words, the rest cannot change the ids kept; and the cut is still seen: seq_len
  # words give at least seq_len ids, plus [CLS] and [SEP].
  ids = model.tokenizer.encode(toklib.leading_words(text, model.words_kept)).ids
  cut = len(ids) > model.cfg.seq_len
  if cut:  # keep the final [SEP]: every training sequence ends a function with one
    ids = ids[:model.cfg.seq_len - 1] + ids[-1:]
  return np.asarray(ids, np.int32), cut


def text_read(model: TrainedModel, text: str) -> str:
  """The part of ``text`` that :func:`encode` keeps: the whole text, or up to the end of the last
  token before the cut (what a baseline must be limited to for a like-for-like comparison)."""
  enc = model.tokenizer.encode(toklib.leading_words(text, model.words_kept))
  if len(enc.ids) <= model.cfg.seq_len:
    return text
  return text[:enc.offsets[model.cfg.seq_len - 2][1]]  # ids[1 : seq_len - 1] are kept


def text_windows(model: TrainedModel, text: str, most: int) -> list[str]:
  """``text`` as up to ``most`` consecutive windows (at least one), each what :func:`encode`
  keeps of the rest, cut back to its last whole instruction (``[NEXT]``) where one fits: a
  function longer than the model's sequence, read whole (what reading all of it buys on
  provenance: docs/similarity.md)."""
  out, sep = [], f" {dataset.NEXT}"
  while text.strip() and len(out) < most:
    window = text_read(model, text)
    cut = window.rfind(sep)
    if len(window) < len(text) and cut > 0:
      window = text[:cut]
    out.append(window)
    text = text[len(window):].lstrip()
    text = text[len(dataset.NEXT):].lstrip() if text.startswith(dataset.NEXT) else text
  return out or [text]


def pad_batch(rows: list[np.ndarray], length: int, pad_id: int) -> np.ndarray:
  out = np.full((len(rows), length), pad_id, np.int32)
  for i, r in enumerate(rows):
    out[i, :len(r)] = r
  return out


@functools.lru_cache(maxsize=8)
def _logits_fn(cfg_json: str):
  model = model_lib.BertForMLM(ml_collections.ConfigDict(json.loads(cfg_json)))
  return jax.jit(lambda p, ids, pos: model.apply({"params": p}, ids, pos, deterministic=True))


def mlm_logits(model: TrainedModel, ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
  """ids [B,S], positions [B,P] → float32 logits [B,P,V]."""
  fn = _logits_fn(model.cfg.to_json())
  return np.asarray(fn(model.params, jnp.asarray(ids), jnp.asarray(positions)))


def _last_hidden_name(cfg) -> str:
  return "final_LayerNorm" if cfg.norm == "pre" else f"layer_{cfg.layers - 1}"


@functools.lru_cache(maxsize=8)
def _hidden_fn(cfg_json: str):
  cfg = ml_collections.ConfigDict(json.loads(cfg_json))
  model, name = model_lib.BertForMLM(cfg), _last_hidden_name(cfg)

  def hidden(params, ids):
    # The encoder output is the last layer's (pre-LN: the final LayerNorm's) return value;
    # flax captures it, so the model needs no second entry point.
    _, state = model.apply({"params": params}, ids, jnp.zeros((ids.shape[0], 1), jnp.int32),
                           deterministic=True, mutable=["intermediates"],
                           capture_intermediates=lambda m, method: m.name == name
                           and method == "__call__")
    return state["intermediates"][name]["__call__"][0].astype(jnp.float32)

  return jax.jit(hidden)


def last_hidden(model: TrainedModel, ids: np.ndarray) -> np.ndarray:
  """ids [B,S] → the encoder's last hidden layer, float32 [B,S,H]."""
  return np.asarray(_hidden_fn(model.cfg.to_json())(model.params, jnp.asarray(ids)))


def embeddings(model: TrainedModel, ids: np.ndarray) -> np.ndarray:
  """ids [B,S] → a fine-tuned model's embeddings (its pooling, projection head and L2
  normalisation: lmscale_jax/model/contrastive.py), float32 [B,D]."""
  if model.head is None:
    raise UserError(f"{model.source} has no projection head: not a fine-tuned model "
                    "(lmscale finetune makes one)")
  return contrastive.embed(model.cfg, model.params, model.head, ids)


def classifier_params(model: TrainedModel) -> dict:
  """A classification fine-tune's parameters as its run trains them, ``{"bert", "classifier":
  {"kernel", "bias"}}`` (what ``model.hf_classifier.save_classifier`` exports)."""
  if model.classifier is None:
    raise UserError(f"{model.source} has no classifier: not a classification fine-tune "
                    "(lmscale finetune --task classify makes one)")
  return {"bert": model.params,
          "classifier": {k: model.classifier[k] for k in ("kernel", "bias")}}


def class_logits(model: TrainedModel, ids: np.ndarray) -> np.ndarray:
  """ids [B,S] → a classification fine-tune's logits, float32 [B,C] (class ``i``:
  ``model.classifier["labels"][i]``)."""
  return classifier_lib.logits(model.cfg, classifier_params(model), ids)


def namer_params(model: TrainedModel) -> dict:
  """A naming fine-tune's parameters as its run trains them, ``{"bert", "classifier":
  {"kernel", "bias"}}`` (the classifier's tree: model/name_head.py)."""
  if model.namer is None:
    raise UserError(f"{model.source} has no naming head: not a naming fine-tune (lmscale "
                    "finetune --task name makes one)")
  return {"bert": model.params,
          "classifier": {k: model.namer[k] for k in ("kernel", "bias")}}


def name_probs(model: TrainedModel, ids: np.ndarray) -> np.ndarray:
  """ids [B,S] → a naming fine-tune's probability of each name sub-token, float32 [B,V]
  (token ``i``: ``model.namer["tokens"][i]``)."""
  return name_head.sigmoid(classifier_lib.logits(model.cfg, namer_params(model), ids)
                           ).astype(np.float32)
