"""A trained model, for the tools that use one (export, evaluate, fill-mask, embed): from a
training workdir's checkpoint or from a Hugging Face directory, with its tokenizer, and the
three things done with it: MLM logits at given positions, the last hidden layer, and (a
fine-tuned model: lmscale_jax/finetune/trainer.py) its embeddings, pooled, projected and normalised.

A workdir needs no dataset: the model's shape is in the run's ``config.json`` (its ``model``
block holds the resolved vocab_size/seq_len), the parameters come from
``checkpoint.restore_params``; only the tokenizer is read from the run's ``data.path``
(or ``--tokenizer``). Inference runs in float32, as transformers does. A fine-tuning workdir
(its config.json has a ``finetune`` section) keeps its tokenizer in the workdir and its
projection head beside the encoder (``head``); an exported one has ``projection.*`` files.

The run's files are checked as they are read (:func:`read_run`, :func:`metrics_rows`,
:func:`restore_params`), and a model against the dataset it is to read before any weights are
restored (:func:`check_dataset`): each problem is one :class:`UserError` line naming the file
and what was expected, the one rule every tool gets from here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from lmscale_jax.config import defaults as config_defaults
from lmscale_jax.config import legacy
from lmscale_jax.errors import UserError
from lmscale_jax.model import bert as model_lib
from lmscale_jax.model import contrastive, hf_convert
from lmscale_jax.store import dataset, file_io
from lmscale_jax.store import tokenizer as toklib
from lmscale_jax.train import checkpoint as ckpt_lib
from lmscale_jax.train import finetune_state
from lmscale_jax.train import steps as steps_lib
from lmscale_jax.train import workdir as workdir_lib


@dataclasses.dataclass
class TrainedModel:
  cfg: ml_collections.ConfigDict   # resolved model config (float32 compute)
  params: dict
  tokenizer: object                # tokenizers.Tokenizer, with tokenizer.with_hf_roles
  source: str                      # the workdir or HF directory
  step: int | None = None          # the checkpoint's step (workdir)
  run_config: ml_collections.ConfigDict | None = None
  head: dict | None = None         # fine-tuned: {"pool", "projection": {"kernel", "bias"}}

  @property
  def special_ids(self) -> dict:
    return toklib.validate(self.tokenizer, self.source)


# --------------------------------------------------------------------------- loading
# The run's files the tools read, each checked as it is read: a damaged one (a truncated
# config.json, a metrics.jsonl that is a directory, a checkpoints file) is one line naming the
# file and what was expected there, never a traceback from deep in a reader.
RUN_CONFIG, METRICS = "config.json", "metrics.jsonl"
# config.json's "model": the resolved shape keys (train.workdir.SHAPE_KEYS) that readers use.
_SHAPE_INTS = ("vocab_size", "seq_len", "layers", "hidden", "heads", "ffn")


def regular_file(path: str, what: str) -> str:
  """``path``, once it is known to be a regular file (a FIFO would block its reader)."""
  if kind := file_io.not_regular(path):
    raise UserError(f"{path} is {kind}: expected {what}")
  return path


def read_json(path: str, what: str):
  """A JSON file a run wrote, parsed; unreadable or invalid JSON is one line."""
  try:
    with open(regular_file(path, what)) as f:
      return json.load(f)
  except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
    raise UserError(f"{path}: not valid JSON ({e}; cut short?): expected {what}") from None
  except OSError as e:
    raise UserError(f"{path}: cannot read it ({e.strerror or e}): expected {what}") from None


def _json_kind(value) -> str:
  return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
          type(None): "null"}.get(type(value), "a number")


def _check_run_config(path: str, saved) -> None:
  """``config.json`` as training writes it (workdir.save_config): {"config": {…, "model",
  "data", "train"}, "model": {the resolved shape keys}}."""
  what = ("a training run's config ({\"config\": …, \"model\": …}, as lmscale_jax.main "
          "writes it)")
  if not isinstance(saved, dict):
    raise UserError(f"{path}: {_json_kind(saved)}, expected {what}")
  if not {"config", "model"} <= set(saved):
    hint = " (a Hugging Face model directory: give it as --hf DIR)" if "model_type" in saved \
        else ""
    raise UserError(f"{path} is not a training run's config (no 'config' and 'model' "
                    f"entries){hint}")
  sections = {"config": saved["config"], "model": saved["model"]}
  if isinstance(saved["config"], dict):
    sections.update({f"config.{k}": saved["config"].get(k) for k in ("model", "data", "train")})
  for key, value in sections.items():
    if not isinstance(value, dict):
      raise UserError(f"{path}: {key!r} is {_json_kind(value)}, expected an object")
  for key in _SHAPE_INTS:
    value = saved["model"].get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
      raise UserError(f"{path}: model.{key} is {value!r}, expected a positive integer (the "
                      "run's resolved model shape)")


def run_file(workdir: str) -> dict:
  """``workdir/config.json`` as training wrote it, checked (:func:`_check_run_config`)."""
  path = os.path.join(workdir, RUN_CONFIG)
  if not os.path.isdir(workdir):
    raise UserError(f"--workdir {workdir}: no such directory")
  if not os.path.exists(path):
    raise UserError(f"{workdir} has no config.json: not a training workdir (give the "
                    "--workdir a run of python -m lmscale_jax.main wrote)")
  saved = read_json(path, "a training run's config (JSON)")
  _check_run_config(path, saved)
  return saved


def read_run(workdir: str) -> tuple[ml_collections.ConfigDict, dict]:
  """``workdir/config.json`` → (the run's config, the whole record: its ``"model"`` holds the
  resolved shape keys, its ``"dataset"`` what the run is bound to), checked."""
  saved = run_file(workdir)
  return ml_collections.ConfigDict(legacy.complete(saved["config"])), saved


def check_dataset(shape, meta: dataset.DatasetMeta, source: str, *, same_seq_len: bool = True,
                  record: dict | None = None) -> None:
  """A model (``shape``: config.json's "model", or a resolved config) and a dataset it is to
  read, before any weights are restored: the same vocabulary (token ids of another tokenizer
  mean other tokens), for evaluation the same sequence length (the position table), and for a
  run (``record``: its config.json) the tokenizer it was trained with, by digest
  (``workdir.check_tokenizer``: one of the same size tokenizes differently)."""
  keys = ("vocab_size", "seq_len") if same_seq_len else ("vocab_size",)
  for key in keys:
    have, want = int(getattr(meta, key)), int(shape[key])
    if have != want:
      raise UserError(
          f"{meta.path}: {key} {have}, the model's ({source}) {want}: not a dataset this model "
          "can read; give the dataset it was trained on, or one prepared with its tokenizer "
          f"(tools/prepare_*.py --tokenizer)" + (f" and --seq-len {shape['seq_len']}"
                                                 if key == "seq_len" else ""))
  if record is not None:
    path = os.path.join(meta.path, dataset.TOKENIZER)
    workdir_lib.check_tokenizer(record, toklib.digest(regular_file(path, "a tokenizer.json "
                                                                   "file")),
                                f"dataset {meta.path}", source)


def restore_params(workdir: str, step: int | None, abstract_state) -> tuple[int, object]:
  """``checkpoint.restore_params`` once ``workdir/checkpoints`` is known to be a directory.
  Orbax's warnings that the read-only manager it was asked for is read-only are left out: a
  tool's stderr is its own lines (one, when it fails)."""
  root = os.path.join(workdir, "checkpoints")
  if os.path.exists(root) and not os.path.isdir(root):
    raise UserError(f"{root} is {file_io.not_regular(root) or 'a file'}: expected the directory "
                    "of the run's checkpoints (restore it, or give the --workdir of a run)")
  verbosity = logging.get_verbosity()
  logging.set_verbosity(logging.ERROR)
  try:
    return ckpt_lib.restore_params(workdir, step, abstract_state)
  finally:
    logging.set_verbosity(verbosity)


_METRIC_KEYS = ("loss", "mlm_accuracy", "accuracy", "learning_rate", "eval_loss",
                "eval_mlm_accuracy")


def _metrics_row(path: str, n: int, line: bytes) -> dict:
  """Line ``n`` of metrics.jsonl: an object with an integer step and numbers (null: not
  finite, as training writes them) for the metrics the tools show."""
  try:
    row = json.loads(line)
  except (ValueError, UnicodeDecodeError):
    row = None
  if not _good_row(row):
    raise UserError(f"{path}: line {n} is {line[:60].decode(errors='replace')!r}: expected one "
                    "JSON object per line, with an integer 'step' and numbers (null: "
                    "non-finite); repair or remove that line")
  return row


def _good_row(row) -> bool:
  if not isinstance(row, dict) or type(row.get("step")) is not int:  # bool is no step
    return False
  return all(row.get(k) is None or type(row[k]) in (int, float) for k in _METRIC_KEYS)


def metrics_rows(workdir: str) -> list[dict]:
  """``workdir/metrics.jsonl``'s rows, checked (:func:`_metrics_row`); none if there is no
  file. A last line without its newline that is not JSON is a write cut by a kill: left out,
  as training leaves it out when it resumes (train.metrics); a bad line anywhere else is one
  error."""
  path = os.path.join(workdir, METRICS)
  if not os.path.lexists(path):
    return []
  try:
    with open(regular_file(path, "the run's metrics (JSON lines)"), "rb") as f:
      lines = f.read().split(b"\n")
  except OSError as e:
    raise UserError(f"{path}: cannot read it ({e.strerror or e})") from None
  if not _is_json(lines[-1]):
    lines[-1] = b""  # cut by a kill (b"" already after a final newline)
  return [_metrics_row(path, n, line) for n, line in enumerate(lines, 1) if line.strip()]


def _is_json(line: bytes) -> bool:
  try:
    json.loads(line)
    return True
  except (ValueError, UnicodeDecodeError):
    return False


def resolve(model_config, shape: dict, special_ids: dict, *, dtype: str | None = "float32",
            where: str = "") -> ml_collections.ConfigDict:
  """``config.model`` + the saved shape keys → the config ``BertForMLM`` takes."""
  meta = dataset.DatasetMeta(path=where, name="", seq_len=int(shape["seq_len"]),
                             vocab_size=int(shape["vocab_size"]), special_ids=special_ids,
                             splits={}, raw={})
  model_config = ml_collections.ConfigDict(model_config.to_dict())
  model_config.vocab_size, model_config.seq_len = 0, 0  # taken from `meta`
  cfg = model_lib.resolve_model_config(model_config, meta)
  if dtype:
    cfg.dtype = dtype
  return cfg


def run_tokenizer(run_config, tokenizer_path: str = "", record: dict | None = None,
                  workdir: str = ""):
  """The run's tokenizer: ``tokenizer_path``, or the tokenizer.json of the dataset the run
  trained on (its record's absolute path; ``data.path`` as typed may be relative to another
  directory), checked against the run's tokenizer digest where the record has one."""
  path = tokenizer_path or os.path.join(
      ((record or {}).get("dataset") or {}).get("path") or run_config.data.path,
      dataset.TOKENIZER)
  if not os.path.exists(path):
    raise UserError(f"{path}: no such file (the tokenizer of the run's data.path); give "
                    "--tokenizer PATH/tokenizer.json of the dataset it trained on")
  regular_file(path, "a tokenizer.json file")
  if record is not None:
    workdir_lib.check_tokenizer(record, toklib.digest(path), path, workdir)
  return toklib.with_hf_roles(toklib.load(path))


def _check_vocab(tok, cfg, where: str) -> None:
  size = tok.get_vocab_size(with_added_tokens=True)
  if size != cfg.vocab_size:
    raise UserError(f"{where}: the tokenizer has {size} tokens, the model's vocabulary "
                    f"{cfg.vocab_size}: not the tokenizer this model was trained with")


def abstract_state(run_config, cfg):
  """The run's TrainState shapes (Orbax's restore target), as training builds them."""
  return steps_lib.build_steps(run_config, cfg, 1).abstract_state


def is_finetuned(run_config) -> bool:
  return "finetune" in run_config


def workdir_shape(workdir: str, tokenizer_path: str, dtype: str | None):
  """(run config, resolved model config, tokenizer, config.json's record) of a run, checked
  against each other."""
  run_config, record = read_run(workdir)
  if is_finetuned(run_config):  # its own copy (lmscale_jax/finetune/trainer.py)
    tokenizer_path = tokenizer_path or os.path.join(workdir, dataset.TOKENIZER)
  tok = run_tokenizer(run_config, tokenizer_path, record, workdir)
  cfg = resolve(run_config.model, record["model"], toklib.validate(tok, "tokenizer"),
                dtype=dtype, where=workdir)
  _check_vocab(tok, cfg, workdir)
  return run_config, cfg, tok, record


def from_workdir(workdir: str, step: int | None = None, tokenizer_path: str = "",
                 dtype: str | None = "float32",
                 data: dataset.DatasetMeta | None = None) -> TrainedModel:
  """A run's model; ``data``: a dataset it is to read, checked against it before the
  restore (:func:`check_dataset`)."""
  run_config, cfg, tok, record = workdir_shape(workdir, tokenizer_path, dtype)
  if data is not None:
    check_dataset(cfg, data, workdir, same_seq_len=False, record=record)
  head = None
  if is_finetuned(run_config):
    step, params = restore_params(
        workdir, step, finetune_state.abstract_state(run_config, cfg))
    params = jax.device_get(params)
    params, head = params["bert"], {"pool": run_config.finetune.pool,
                                    "projection": params["projection"]}
  else:
    step, params = restore_params(workdir, step, abstract_state(run_config, cfg))
  return TrainedModel(cfg=cfg, params=jax.device_get(params), tokenizer=tok, source=workdir,
                      step=step, run_config=run_config, head=head)


def check_hf_files(hf_dir: str) -> None:
  """The files of an HF directory that are read, where present, are regular files (a FIFO
  would block its reader), and its config.json a JSON object; what is in them is
  hf_convert's and contrastive's to check."""
  for name in (hf_convert.CONFIG, hf_convert.WEIGHTS, dataset.TOKENIZER,
               contrastive.HEAD_WEIGHTS, contrastive.HEAD_CONFIG):
    path = os.path.join(hf_dir, name)
    if kind := file_io.not_regular(path):
      raise UserError(f"{path} is {kind}: expected the model directory's {name} file")
  path = os.path.join(hf_dir, hf_convert.CONFIG)
  if os.path.exists(path) and not isinstance(config := read_json(path, "a JSON object"), dict):
    raise UserError(f"{path}: {_json_kind(config)}, expected a Hugging Face model's config "
                    "(a JSON object)")


def hf_model_config(hf_dir: str) -> ml_collections.ConfigDict:
  """A ``config.model`` for an HF directory: its shape keys over the shared defaults."""
  check_hf_files(hf_dir)
  model_config = config_defaults.get_base_config().model
  hf = hf_convert.read_config(hf_dir)
  for key, value in hf_convert.model_keys(hf_dir).items():
    model_config[key] = value
  model_config.dropout = float(hf.get("hidden_dropout_prob", model_config.dropout))
  model_config.attention_dropout = float(hf.get("attention_probs_dropout_prob", 0.0))
  model_config.initializer_range = float(hf.get("initializer_range", 0.02))
  return model_config


def _hf_shape(hf_dir: str, tokenizer_path: str = ""):
  """(resolved model config, tokenizer) of an HF directory, checked against each other."""
  model_config = hf_model_config(hf_dir)
  path = tokenizer_path or os.path.join(hf_dir, dataset.TOKENIZER)
  if not os.path.exists(path):
    raise UserError(f"{hf_dir} has no {dataset.TOKENIZER} (export with lmscale export-hf, "
                    "or save the tokenizer with save_pretrained)")
  tok = toklib.with_hf_roles(toklib.load(regular_file(path, "a tokenizer.json file")))
  cfg = resolve(model_config, model_config, toklib.validate(tok, path), where=hf_dir)
  _check_vocab(tok, cfg, hf_dir)
  return cfg, tok


def from_hf(hf_dir: str, data: dataset.DatasetMeta | None = None) -> TrainedModel:
  cfg, tok = _hf_shape(hf_dir)
  if data is not None:
    check_dataset(cfg, data, hf_dir, same_seq_len=False)
  return TrainedModel(cfg=cfg, params=hf_convert.load_params(hf_dir, cfg), tokenizer=tok,
                      source=hf_dir, head=contrastive.load_head(hf_dir, cfg.hidden))


def architecture(path: str, tokenizer_path: str = "") -> TrainedModel:
  """A run's or an HF directory's model config and tokenizer, no weights (``params`` empty):
  what a model of the same architecture starting from fresh weights needs."""
  config = regular_file(os.path.join(path, hf_convert.CONFIG), "a run's or a model's config")
  try:
    with open(config) as f:
      is_hf = "model_type" in json.load(f)
  except (OSError, ValueError, TypeError):  # the readers below say what is wrong
    is_hf = False
  if is_hf:
    cfg, tok = _hf_shape(path, tokenizer_path)
  else:
    _, cfg, tok, _ = workdir_shape(path, tokenizer_path, "float32")
  return TrainedModel(cfg=cfg, params={}, tokenizer=tok, source=path)


@functools.lru_cache(maxsize=8)
def _init_fn(cfg_json: str):
  cfg = ml_collections.ConfigDict(json.loads(cfg_json))
  return jax.jit(lambda rng: model_lib.init_params(cfg, rng))


def random_init(model: TrainedModel, seed: int) -> TrainedModel:
  """The same architecture and tokenizer with the initial weights pretraining starts from
  (seed ``seed``): eval_similarity.py's random-init row, finetune's ``init.source=random``."""
  params = _init_fn(model.cfg.to_json())(jax.random.key(seed))
  return dataclasses.replace(model, params=jax.device_get(params), source="random-init",
                             step=None, head=None)


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
  ids = model.tokenizer.encode(text).ids
  cut = len(ids) > model.cfg.seq_len
  if cut:  # keep the final [SEP]: every training sequence ends a function with one
    ids = ids[:model.cfg.seq_len - 1] + ids[-1:]
  return np.asarray(ids, np.int32), cut


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
  return "final_LayerNorm" if cfg.pre_ln else f"layer_{cfg.layers - 1}"


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
