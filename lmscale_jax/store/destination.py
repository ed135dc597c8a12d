"""Where a command may write a directory of dataset files: the rule ``lmscale prepare``
(``prep/output_dir.py``) and ``lmscale stage`` (``input/staging.py``) share, in one place so that
the two can never disagree about what is the user's.

1. Apart from its inputs (:func:`overlap`): the directory is not, does not contain and does not
   lie inside any input. Written into its source's parent, a directory inside the source or a
   directory of ELF inputs, the files mixed with the inputs (and ``--overwrite`` there removed
   inputs).
2. Never over someone else's (:func:`occupant`): a non-empty directory that is not the command's
   own is refused, naming what it holds: a file no lmscale tool wrote there, another dataset
   (``metadata.json``), or another run's unfinished work. ``stage`` onto another dataset
   replaced its shards, ``tokenizer.json`` and ``metadata.json`` and said "4 kept". The
   command's own: a preparation's unfinished work of the same settings, or with ``--overwrite``
   the names its manifest lists (``prep/output_dir.py``); a staging's earlier copy of the same
   dataset (:func:`staged_copy_of`). Files beside its own that the command does not write (a
   README) are left alone.

What an lmscale tool wrote there (:func:`foreign` is the rest): the names a preparation's
``prepare_manifest.json`` lists (or, in a dataset prepared before manifests existed, the names a
preparation writes), a staging's ``staging.json`` and the files it records, both tools' locks,
and the temp files of those names (an atomic write's ``.NAME.*.tmp``, a copy's
``.NAME.staging``). :func:`identity` tells one dataset from another by content
(``metadata.json``, which lists every shard's sha256, and ``tokenizer.json``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Callable, NamedTuple, Sequence

from lmscale_jax.store import dataset, file_io
from lmscale_jax.store import tokenizer as toklib

# A preparation's names (prep/output_dir.py, prep/prepare.py).
MANIFEST = "prepare_manifest.json"
WORK = "_work"
PREPARE_LOCK = ".prepare.lock"
TFDS_FILES = ("dataset_info.json", "features.json")
_SHARD_NAME = re.compile(r"(binary_code|text_corpus)-(train|validation)\.array_record-"
                         r"\d{5}-of-\d{5}")
# A staging's names (input/staging.py, input/file_copy.py).
STAGE_STATE = "staging.json"
STAGE_LOCK = ".stage.lock"
STAGE_TEMP_SUFFIX = ".staging"  # a copy in progress: ``.{name}.staging`` beside its final name
# Locks mean nothing about a directory's content: a kill leaves them, the next holder reuses them.
LOCKS = (PREPARE_LOCK, STAGE_LOCK)
# The temp file of an atomic write killed half way (file_io.atomic_write_bytes): ".NAME.*.tmp".
_TEMP_NAME = re.compile(r"\.(.+)\.[^.]+\.tmp")


def _inside(path: str, top: str) -> bool:
  return path != top and os.path.commonpath([path, top]) == top


def overlap(out: str, inputs: Sequence[str]) -> tuple[str, str] | None:
  """``(how, input)`` when the directory ``out`` "is the same directory as", "lies inside" or
  "contains" one of ``inputs`` (symbolic links resolved), else None."""
  real_out = os.path.realpath(out)
  for path in inputs:
    real = os.path.realpath(path)
    how = ("is the same directory as" if real_out == real else
           "lies inside" if _inside(real_out, real) else
           "contains" if _inside(real, real_out) else "")
    if how:
      return how, path
  return None


def entries(out: str) -> list[str]:
  """The names in ``out`` that say something about its content: all but the locks (none when
  ``out`` is missing)."""
  if not os.path.isdir(out):
    return []
  return sorted(n for n in os.listdir(out) if n not in LOCKS)


# --------------------------------------------------------------------------- what a tool wrote
def manifest(out: str) -> list[str] | None:
  """The names ``out/prepare_manifest.json`` lists (None without one). An unreadable one is a
  :class:`dataset.DatasetError`: it cannot say what is ours, so nothing is removed."""
  path = os.path.join(out, MANIFEST)
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      names = json.load(f)["files"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise dataset.DatasetError(f"{path}: not readable ({e}); remove the dataset's files "
                               "yourself") from None
  # Plain names only: a manifest is never a way to delete anything outside the directory.
  return [n for n in names if isinstance(n, str) and n not in ("", ".", "..") and "/" not in n]


def write_manifest(out: str, names) -> None:
  file_io.atomic_write_json(os.path.join(out, MANIFEST),
                            {"tool": "lmscale_jax.prepare", "files": sorted(set(names))})


def _prepared_by_name(name: str) -> bool:
  """A name a preparation writes (a dataset prepared before manifests has no manifest)."""
  return (name in (WORK, MANIFEST, dataset.METADATA, dataset.STATS, *toklib.HF_FILES,
                   *TFDS_FILES) or _SHARD_NAME.fullmatch(name) is not None)


def prepared(out: str) -> Callable[[str], bool]:
  """Whether a name in ``out`` is one a preparation wrote there (the names ``--overwrite`` may
  remove): its manifest's, or without a manifest the names a preparation writes."""
  owned = manifest(out)
  return _prepared_by_name if owned is None else (lambda n: n in owned or n == MANIFEST)


def _stage_record(out: str) -> dict:
  """``out/staging.json`` ({} when missing or unreadable)."""
  try:
    with open(os.path.join(out, STAGE_STATE)) as f:
      record = json.load(f)
  except (OSError, ValueError):
    return {}
  return record if isinstance(record, dict) else {}


def _staged(out: str) -> Callable[[str], bool]:
  """Whether a name in ``out`` is one a staging wrote there: its state file and the files that
  file records as copied or verified."""
  recorded = _stage_record(out).get("verified")
  recorded = set(recorded) if isinstance(recorded, dict) else set()
  return lambda n: n == STAGE_STATE or n in recorded


def temp_of(name: str) -> str | None:
  """The final name a temp file stands for (``.stats.json.k3j.tmp`` → ``stats.json``), or None
  when ``name`` is no temp file."""
  if (m := _TEMP_NAME.fullmatch(name)) is not None:
    return m.group(1)
  if name.startswith(".") and name.endswith(STAGE_TEMP_SUFFIX) and len(name) > 9:
    return name[1:-len(STAGE_TEMP_SUFFIX)]
  return None


def foreign(out: str, names: Sequence[str], *, tools: str = "any") -> list[str]:
  """The entries of ``out`` that no lmscale tool wrote (``tools="prepare"``: that no
  preparation wrote, the ones ``prepare --overwrite`` must keep)."""
  known = [prepared(out)] + ([_staged(out)] if tools == "any" else [])
  return sorted(n for n in names if not any(ours(temp_of(n) or n) or ours(n) for ours in known))


# --------------------------------------------------------------------------- whose directory
def identity(directory: str) -> str | None:
  """The dataset ``directory`` holds, by content (None without ``metadata.json``): the sha256
  of its ``metadata.json`` (which lists every shard's) and of its ``tokenizer.json``."""
  meta = os.path.join(directory, dataset.METADATA)
  if not os.path.isfile(meta):
    return None
  tok = os.path.join(directory, dataset.TOKENIZER)
  digests = [file_io.sha256_file(meta),
             file_io.sha256_file(tok) if os.path.isfile(tok) else hashlib.sha256().hexdigest()]
  return ":".join(digests)


def staged_copy_of(out: str, names: Sequence[str], digest: str) -> bool:
  """Whether ``out`` (holding ``names``) is ``lmscale stage``'s own destination for the dataset
  whose :func:`identity` is ``digest``: its ``staging.json`` names that digest, or it holds that
  very dataset (staged before digests were recorded, or copied by hand: verified, repaired), or
  it holds an unfinished staging (``staging.json`` and no ``metadata.json``: partial copies
  nothing reads, restaged, e.g. after the source was re-prepared mid-copy). A complete other
  dataset is never its own."""
  held = identity(out)
  if held is not None:
    return held == digest or _stage_record(out).get("source_digest") == digest
  return STAGE_STATE in names


class Occupant(NamedTuple):
  """What makes a non-empty directory someone else's: ``kind`` ("foreign", "dataset",
  "preparation" or "staging") and the entry that shows it."""

  kind: str
  name: str


def occupant(out: str, names: Sequence[str]) -> Occupant | None:
  """Why the command may not write into ``out`` (holding ``names``, from :func:`entries`) when
  it is not the command's own; None when it holds nothing (or only a manifest naming nothing
  there: what a refused or failed preparation leaves). A dataset comes first (the user's
  README beside it is no reason to call the whole directory foreign), then a file no lmscale
  tool wrote."""
  if dataset.METADATA in names:
    return Occupant("dataset", dataset.METADATA)
  if alien := foreign(out, names):
    return Occupant("foreign", alien[0])
  if STAGE_STATE in names:
    return Occupant("staging", STAGE_STATE)
  rest = [n for n in names if n != MANIFEST]
  return Occupant("preparation", rest[0]) if rest else None


def copy_refusal(src: str, dest: str, digest: str) -> str | None:
  """Why ``lmscale stage`` may not copy the dataset ``src`` (content ``digest``) into ``dest``,
  in words, or None: ``dest`` overlaps the source, or is non-empty and not its own
  (:func:`staged_copy_of`)."""
  if hit := overlap(dest, [src]):
    return (f"destination {dest} {hit[0]} the source {src}: a staged copy must lie apart from "
            "its source (not in it, not around it); choose another DEST")
  names = entries(dest)
  held = None if not names or staged_copy_of(dest, names, digest) else occupant(dest, names)
  if held is None:
    return None
  what = {"dataset": f"another dataset (its {dataset.METADATA} or {dataset.TOKENIZER} differs "
                     f"from those of {src}): staging never replaces a dataset",
          "foreign": f"{held.name!r}, which no lmscale tool wrote"}
  return (f"destination {dest} holds "
          + what.get(held.kind, f"the files of an unfinished preparation ({held.name}) but no "
                                "dataset")
          + "; choose a new or empty DEST (or remove what is there, if it is no longer needed)")
