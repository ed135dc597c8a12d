"""A model's directory read once: a training run's workdir or a Hugging Face directory → what it
holds, each part checked against the others (:class:`ModelDir`: the resolved model config, the
tokenizer, and for a run its config and ``config.json``'s record). Every user of a model starts
here, once: a tool (``trained_model.load``), a fine-tune's start model (read before any work,
then its weights loaded from what was read: ``finetune/base_run.check_start``), an export.
The weights are :mod:`lmscale_jax.inference.trained_model`'s to load (``from_dir``); the files
themselves are read and checked by :mod:`lmscale_jax.inference.model_files`.
"""

from __future__ import annotations

import dataclasses
import os

import ml_collections

from lmscale_jax.errors import UserError
from lmscale_jax.inference import model_files
from lmscale_jax.model import bert as model_lib
from lmscale_jax.model import hf_dir_checks
from lmscale_jax.store import dataset
from lmscale_jax.store import tokenizer as toklib
from lmscale_jax.train import run_record


@dataclasses.dataclass(frozen=True)
class ModelDir:
  path: str                        # the workdir or HF directory
  cfg: ml_collections.ConfigDict   # the resolved model config (float32 compute unless asked)
  tokenizer: object                # tokenizers.Tokenizer, with tokenizer.with_hf_roles
  run_config: ml_collections.ConfigDict | None = None  # a run's config (None: an HF directory)
  record: dict | None = None       # a run's config.json record

  @property
  def is_hf(self) -> bool:
    return self.run_config is None


def read(path: str, tokenizer_path: str = "", dtype: str | None = "float32") -> ModelDir:
  """A run's workdir or an HF directory, whichever ``path`` is (its config.json says)."""
  if model_files.is_hf_dir(path):
    return read_hf(path, tokenizer_path)
  return read_run(path, tokenizer_path, dtype)


def read_run(workdir: str, tokenizer_path: str = "", dtype: str | None = "float32") -> ModelDir:
  """A run's config, record, tokenizer and resolved model config, checked against each other
  (no dataset needed: the shape is in config.json's ``model`` block)."""
  run_config, record = model_files.read_run(workdir)
  if is_finetuned(run_config):  # its own copy (lmscale_jax/finetune/base_run.py)
    tokenizer_path = tokenizer_path or os.path.join(workdir, dataset.TOKENIZER)
  path = tokenizer_file(run_config, tokenizer_path, record, workdir)
  tok = toklib.with_hf_roles(toklib.load(path))
  cfg = checked_config(workdir, run_config.model, record["model"], tok, path, dtype)
  return ModelDir(path=workdir, cfg=cfg, tokenizer=tok, run_config=run_config, record=record)


def read_hf(hf_dir: str, tokenizer_path: str = "") -> ModelDir:
  """An HF directory's resolved model config and tokenizer, checked against each other."""
  model_config = model_files.hf_model_config(hf_dir)
  tok = toklib.with_hf_roles(hf_dir_checks.read_tokenizer(hf_dir, tokenizer_path))
  cfg = checked_config(hf_dir, model_config, model_config, tok,
                       tokenizer_path or os.path.join(hf_dir, dataset.TOKENIZER))
  return ModelDir(path=hf_dir, cfg=cfg, tokenizer=tok)


def checked_config(where: str, model_config, shape: dict, tok, tokenizer_path: str,
                   dtype: str | None = "float32") -> ml_collections.ConfigDict:
  """The resolved model config of directory ``where`` (:func:`resolve`: ``config.model`` over
  the saved ``shape`` keys), its tokenizer (read from ``tokenizer_path``) checked against it:
  the special tokens, the vocabulary's size. Both kinds of directory end here."""
  cfg = resolve(model_config, shape, toklib.validate(tok, tokenizer_path), dtype=dtype,
                where=where)
  size = tok.get_vocab_size(with_added_tokens=True)
  if size != cfg.vocab_size:
    raise UserError(f"{where}: the tokenizer has {size} tokens, the model's vocabulary "
                    f"{cfg.vocab_size}: not the tokenizer this model was trained with")
  return cfg


def resolve(model_config, shape: dict, special_ids: dict, *, dtype: str | None = "float32",
            where: str = "") -> ml_collections.ConfigDict:
  """``config.model`` + the saved shape keys → the config ``BertForMLM`` takes (their
  positions too, where given: what a run's "auto" became, which this ``meta`` without a
  dataset cannot tell)."""
  meta = dataset.DatasetMeta(path=where, name="", seq_len=int(shape["seq_len"]),
                             vocab_size=int(shape["vocab_size"]), special_ids=special_ids,
                             splits={}, raw={})
  model_config = ml_collections.ConfigDict(model_config.to_dict())
  model_config.vocab_size, model_config.seq_len = 0, 0  # taken from `meta`
  model_config.positions = shape.get("positions", model_config.positions)
  cfg = model_lib.resolve_model_config(model_config, meta)
  if dtype:
    cfg.dtype = dtype
  return cfg


def tokenizer_file(run_config, tokenizer_path: str = "", record: dict | None = None,
                   workdir: str = "") -> str:
  """The run's tokenizer file: ``tokenizer_path``, or the tokenizer.json of the dataset the run
  trained on (its record's absolute path; ``data.path`` as typed may be relative to another
  directory), checked against the run's tokenizer digest where the record has one."""
  path = tokenizer_path or os.path.join(
      ((record or {}).get("dataset") or {}).get("path") or run_config.data.path,
      dataset.TOKENIZER)
  if not os.path.exists(path):
    raise UserError(f"{path}: no such file (the tokenizer of the run's data.path); give "
                    "--tokenizer PATH/tokenizer.json of the dataset it trained on")
  model_files.regular_file(path, "a tokenizer.json file")
  if record is not None:
    run_record.check_tokenizer(record, toklib.digest(path), path, workdir)
  return path


# --------------------------------------------------------------------------- what a run is
def is_finetuned(run_config) -> bool:
  return "finetune" in run_config


def is_classifier(run_config) -> bool:
  """A classification fine-tune's run (config.legacy: an older fine-tune is contrastive)."""
  return is_finetuned(run_config) and run_config.finetune.task == "classify"


def is_namer(run_config) -> bool:
  """A naming fine-tune's run (finetune/name_run.py)."""
  return is_finetuned(run_config) and run_config.finetune.task == "name"
