"""What a Hugging Face model directory must hold before any of its weights are read: each
config.json field the model is built from of the type and range it takes
(:func:`config_problem`), and a tokenizer.json that is a Hugging Face tokenizer with the special
tokens the model needs (``store.tokenizer.load``) and, in an export, the very tokenizer it was
exported with (:func:`read_tokenizer`): ``lmscale export-hf`` writes the tokenizer's digest
(``store.tokenizer.digest``, the one that binds a run to its dataset) into
``lmscale_export.json`` (:func:`stamp_tokenizer`), because another tokenizer of the same size
gives every id another token and nothing else would notice. A side file, not a config.json
field: transformers' ``save_pretrained`` would carry a config field into a directory whose
tokenizer it re-serialises; a directory without the file (an export written before it, or
another BERT) loads as before.

One owner for these rules: ``hf_convert.read_config`` and :func:`read_tokenizer`, which every
reader of an HF directory goes through (the model tools, import-hf, ``init_from``, finetune
--init-hf), call them; each problem is one :class:`HFError` line naming the file, the field
and what was expected.
"""

from __future__ import annotations

import json
import math
import os
import re

from lmscale_jax.errors import UserError
from lmscale_jax.store import dataset, file_io
from lmscale_jax.store import tokenizer as toklib

EXPORT_RECORD = "lmscale_export.json"
_SHA256 = re.compile(r"[0-9a-f]{64}")


class HFError(UserError, ValueError):
  """An HF model directory, or a model option, that the BERT mapping cannot take."""


# --------------------------------------------------------------------------- config.json
def _count(v) -> bool:
  return type(v) is int and v > 0  # bool is an int, and no count


def _positive(v) -> bool:
  return type(v) in (int, float) and math.isfinite(v) and v > 0


def _probability(v) -> bool:
  return type(v) in (int, float) and 0 <= v < 1


def _scale(v) -> bool:
  return type(v) in (int, float) and math.isfinite(v) and v >= 0


_COUNT, _POSITIVE = (_count, "a positive integer"), (_positive, "a positive number")
# The fields the model's shape and arithmetic come from (hf_convert.MODEL_KEYS' sources):
# each must be there.
REQUIRED = {"num_hidden_layers": _COUNT, "hidden_size": _COUNT, "num_attention_heads": _COUNT,
            "intermediate_size": _COUNT, "vocab_size": _COUNT,
            "max_position_embeddings": _COUNT, "type_vocab_size": _COUNT,
            "layer_norm_eps": _POSITIVE}
# Read where present (inference/model_files.hf_model_config), a default otherwise.
OPTIONAL = {"hidden_dropout_prob": (_probability, "a number in [0, 1)"),
            "attention_probs_dropout_prob": (_probability, "a number in [0, 1)"),
            "initializer_range": (_scale, "a number >= 0")}


def config_problem(config: dict) -> str | None:
  """What makes a config.json's model fields unusable (a phrase naming the field, its value
  and what was expected), or None."""
  for field, (good, expected) in REQUIRED.items():
    if field not in config:
      return f"{field} is missing: expected {expected}"
    if not good(config[field]):
      return f"{field}={config[field]!r}: expected {expected}"
  for field, (good, expected) in OPTIONAL.items():
    if field in config and not good(config[field]):
      return f"{field}={config[field]!r}: expected {expected}"
  if config["hidden_size"] % config["num_attention_heads"]:
    return (f"hidden_size={config['hidden_size']} is not divisible by num_attention_heads="
            f"{config['num_attention_heads']}: expected each head to get hidden_size/heads "
            "features")
  return None


# --------------------------------------------------------------------------- tokenizer.json
def stamp_tokenizer(out_dir: str) -> None:
  """``out_dir/lmscale_export.json``: the digest of the ``tokenizer.json`` just written
  there, which binds the exported weights to it (written atomically)."""
  sha = toklib.digest(os.path.join(out_dir, dataset.TOKENIZER))
  file_io.atomic_write_json(os.path.join(out_dir, EXPORT_RECORD),
                            {"tokenizer_sha256": sha, "written_by": "lmscale export-hf"})


def _exported_digest(hf_dir: str) -> str | None:
  """The tokenizer digest ``hf_dir``'s export record holds; None without one."""
  path = os.path.join(hf_dir, EXPORT_RECORD)
  if not os.path.lexists(path):
    return None
  expected = (f"expected a JSON object whose tokenizer_sha256 is 64 hex digits, as lmscale "
              f"export-hf writes it (re-export, or remove {EXPORT_RECORD} to load the "
              "directory unchecked)")
  if kind := file_io.not_regular(path):  # a FIFO would block the read
    raise HFError(f"{path} is {kind}: {expected}")
  try:
    with open(path, "rb") as f:
      record = json.loads(f.read())
  except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
    raise HFError(f"{path}: cannot read it ({e}): {expected}") from None
  sha = record.get("tokenizer_sha256") if isinstance(record, dict) else None
  if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
    raise HFError(f"{path}: tokenizer_sha256={sha!r}: {expected}")
  return sha


def check_exported_tokenizer(hf_dir: str) -> None:
  """``hf_dir/tokenizer.json`` is the one its export record names (nothing to check
  without a record)."""
  want = _exported_digest(hf_dir)
  if want is None:
    return
  path = os.path.join(hf_dir, dataset.TOKENIZER)
  have = toklib.digest(path)
  if have != want:
    raise HFError(
        f"{path}: not the tokenizer {hf_dir} was exported with (sha256 {have[:12]}…, "
        f"{EXPORT_RECORD} names {want[:12]}…): another tokenizer gives the model's token ids "
        f"other tokens. Put back the {dataset.TOKENIZER} exported with it (rerun lmscale "
        "export-hf)")


def read_tokenizer(hf_dir: str, path: str = ""):
  """``hf_dir``'s tokenizer (``path``: one given instead of its own tokenizer.json), checked:
  a Hugging Face tokenizer with the special tokens (``store.tokenizer.load``) and, its own,
  the one it was exported with (:func:`check_exported_tokenizer`)."""
  own = os.path.join(hf_dir, dataset.TOKENIZER)
  if not os.path.lexists(path or own):
    raise HFError(f"{hf_dir} has no {dataset.TOKENIZER} (export with lmscale export-hf, or "
                  "save the tokenizer with save_pretrained)")
  if not path or os.path.abspath(path) == os.path.abspath(own):
    check_exported_tokenizer(hf_dir)
  return toklib.load(path or own)
