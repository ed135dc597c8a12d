"""The files a trained model is read from, each checked as it is read: a training run's
workdir (``config.json``, ``metrics.jsonl``, the parameters of a checkpoint) and a Hugging Face
model directory (its config and weight files); and a model against the dataset it is to read,
before any weights are restored (:func:`check_dataset`). Each problem is one
:class:`UserError` line naming the file and what was expected, never a traceback from deep in
a reader: the one rule every tool gets from here. What is done with the model is
:mod:`lmscale_jax.inference.trained_model`.

A workdir's ``config.json`` has one reader, ``train.run_record.load_record`` (the resume rules
read it too); the parameters come from ``train.checkpoint.restore_params``, which reads only
them (not the optimizer state: benchmarks/bench_model_load.py).
"""

from __future__ import annotations

import json
import os

import ml_collections
from absl import logging

from lmscale_jax.config import defaults as config_defaults
from lmscale_jax.errors import UserError
from lmscale_jax.model import contrastive, hf_convert
from lmscale_jax.store import dataset, file_io
from lmscale_jax.store import tokenizer as toklib
from lmscale_jax.train import checkpoint as ckpt_lib
from lmscale_jax.train import checkpoint_binding
from lmscale_jax.train import run_record
from lmscale_jax.train import workdir as workdir_lib

RUN_CONFIG, METRICS = workdir_lib.RUN_CONFIG, "metrics.jsonl"


def regular_file(path: str, what: str) -> str:
  """``path``, once it is known to be a regular file (a FIFO would block its reader)."""
  if kind := file_io.not_regular(path):
    raise UserError(f"{path} is {kind}: expected {what}")
  return path


def read_json(path: str, what: str):
  """A JSON file of a model directory, parsed; unreadable or invalid JSON is one line."""
  try:
    with open(regular_file(path, what)) as f:
      return json.load(f)
  except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
    raise UserError(f"{path}: not valid JSON ({e}; cut short?): expected {what}") from None
  except OSError as e:
    raise UserError(f"{path}: cannot read it ({e.strerror or e}): expected {what}") from None


# --------------------------------------------------------------------------- a run's workdir
def run_file(workdir: str) -> dict:
  """``workdir/config.json`` as training wrote it, checked (``workdir.load_record``)."""
  if not os.path.isdir(workdir):
    raise UserError(f"--workdir {workdir}: no such directory")
  path = os.path.join(workdir, RUN_CONFIG)
  if not os.path.lexists(path):
    raise UserError(f"{workdir} has no config.json: not a training workdir (give the "
                    "--workdir a run of lmscale train wrote)")
  return run_record.load_record(path)


def read_run(workdir: str) -> tuple[ml_collections.ConfigDict, dict]:
  """``workdir/config.json`` → (the run's config, the whole record: its ``"model"`` holds the
  resolved shape keys, its ``"dataset"`` what the run is bound to), checked."""
  saved = run_file(workdir)
  return ml_collections.ConfigDict(saved["config"]), saved  # completed by load_record


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
          f"(lmscale prepare binary or text --tokenizer)" + (f" and --seq-len {shape['seq_len']}"
                                                 if key == "seq_len" else ""))
  if record is not None:
    path = os.path.join(meta.path, dataset.TOKENIZER)
    run_record.check_tokenizer(record, toklib.digest(regular_file(path, "a tokenizer.json "
                                                                  "file")),
                               f"dataset {meta.path}", source)


def restore_params(workdir: str, step: int | None, abstract_params) -> tuple[int, object]:
  """``checkpoint.restore_params`` (the parameters only) once ``workdir/checkpoints`` is known
  to be a directory, of a checkpoint this run wrote (``checkpoint_binding``: its own record
  against the run's config.json, a small file read again here so that no caller can skip the
  check). Orbax's warnings that the read-only manager it was asked for is read-only are left
  out: a tool's stderr is its own lines (one, when it fails)."""
  record = run_file(workdir)
  root = os.path.join(workdir, "checkpoints")
  if os.path.exists(root) and not os.path.isdir(root):
    raise UserError(f"{root} is {file_io.not_regular(root) or 'a file'}: expected the directory "
                    "of the run's checkpoints (restore it, or give the --workdir of a run)")
  verbosity = logging.get_verbosity()
  logging.set_verbosity(logging.ERROR)
  try:
    return ckpt_lib.restore_params(
        workdir, step, abstract_params,
        check=lambda chosen: checkpoint_binding.check_checkpoint_run(workdir, chosen, record))
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


# --------------------------------------------------------------------------- an HF directory
def is_hf_dir(path: str) -> bool:
  """Whether ``path``'s config.json is a Hugging Face model's (it has ``model_type``) rather
  than a training run's; a missing or damaged one is the run reader's to name."""
  config = regular_file(os.path.join(path, hf_convert.CONFIG), "a run's or a model's config")
  try:
    with open(config) as f:
      return "model_type" in json.load(f)
  except (OSError, ValueError, TypeError):
    return False


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
    raise UserError(f"{path}: {run_record.json_kind(config)}, expected a Hugging Face model's "
                    "config (a JSON object)")


def hf_model_config(hf_dir: str) -> ml_collections.ConfigDict:
  """A ``config.model`` for an HF directory: its shape keys over the shared defaults (an
  lmscale remote-code export's norm, positions and packed_attention too)."""
  check_hf_files(hf_dir)
  model_config = config_defaults.get_base_config().model
  hf = hf_convert.read_config(hf_dir)
  keys = hf_convert.model_keys(hf_dir)
  for key, value in keys.items():
    model_config[key] = value
  model_config.positions = hf_convert.positions_of(keys)  # not the default's "auto"
  if "packed_attention" in hf:  # read_config checked it (remote-code exports have it)
    model_config.packed_attention = hf["packed_attention"]
  model_config.dropout = float(hf.get("hidden_dropout_prob", model_config.dropout))
  model_config.attention_dropout = float(hf.get("attention_probs_dropout_prob", 0.0))
  model_config.initializer_range = float(hf.get("initializer_range", 0.02))
  return model_config
