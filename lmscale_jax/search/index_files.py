"""The on-disk format of a function index, read and checked as it is read.

  INDEX_DIR/index.json                 format, the model's identity, pool, dim, the binaries
  INDEX_DIR/shards/<sha256>.npz        ``vectors`` float32 [n, dim], L2-normalised
  INDEX_DIR/shards/<sha256>.jsonl      per function: name, address, bytes, instructions, tokens, cut,
                                       text_digest (an index written before it: absent)

A shard is written under a temp name and renamed, then index.json is rewritten atomically: a
binary is in the index only once both its shard files are complete (a crash loses at most the
binary in flight; a shard not named in index.json is ignored and rewritten by the next build).
A shard's bytes depend only on the binary and the model (the .npz carries no time stamp), so an
index built as a Slurm job array (:mod:`index_array`) is byte for byte the one-node index.
Each entry records the sha256 of its two shard files (``npz_sha256``, ``jsonl_sha256``): a
rerun of lmscale index checks them (:func:`damage`) and rebuilds a shard that is missing,
truncated or changed; an entry of an older index without them is checked by reading its shard.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import zipfile

import numpy as np

from lmscale_jax.errors import UserError
from lmscale_jax.store import file_io

FORMAT = "lmscale_jax.search_index/1"
INDEX = "index.json"
SHARDS = "shards"
ROW_KEYS = ("name", "address", "bytes", "instructions", "tokens", "cut")
# A row's digest of its normalised text (index.text_digest): identical texts are found by it
# (query.mark_same_text). Not in ROW_KEYS: the shards of older indexes have none and still load.
TEXT_DIGEST = "text_digest"
SHARD_FILES = {".npz": "npz_sha256", ".jsonl": "jsonl_sha256"}  # a shard's files, their digests


class IndexFileError(UserError, ValueError):
  """A damaged or foreign index directory: the message names the file and what was expected."""


def new(identity: dict, pool: str, dim: int) -> dict:
  return {"format": FORMAT, "model": identity, "pool": pool, "dim": dim, "binaries": []}


def read(index_dir: str) -> dict | None:
  """index.json of ``index_dir``, checked; None where there is none yet."""
  path = os.path.join(index_dir, INDEX)
  if not os.path.exists(path):
    return None
  doc = file_io.read_json(path, "the index's JSON file",
                         "delete the index directory and build it again", IndexFileError)
  _check(doc, path)
  return doc


def _check(doc, path: str) -> None:
  ok = (isinstance(doc, dict) and doc.get("format") == FORMAT and isinstance(doc.get("model"), dict)
        and isinstance(doc.get("dim"), int) and isinstance(doc.get("binaries"), list)
        and all(_entry_ok(b) for b in doc["binaries"]))
  if not ok:
    raise IndexFileError(f"{path}: not an index of format {FORMAT} (format, model, dim and "
                         "binaries with path, sha256, size, functions, shard expected); delete "
                         "the index directory and build it again")


def _entry_ok(b) -> bool:
  """A binary's entry; its shard is ``shards/<its sha256>`` (a reader opens no other file)."""
  return (isinstance(b, dict) and {"path", "sha256", "size", "functions", "shard"} <= set(b)
          and _hex64(b["sha256"]) and b["shard"] == shard_stem(b["sha256"])
          and isinstance(b["functions"], int) and b["functions"] >= 0
          and all(_hex64(b.get(key, "0" * 64)) for key in SHARD_FILES.values()))


def _hex64(value) -> bool:
  return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) is not None


def write(index_dir: str, doc: dict) -> None:
  file_io.atomic_write_json(os.path.join(index_dir, INDEX), doc)


def shard_stem(sha256: str) -> str:
  return f"{SHARDS}/{sha256}"


def clear_partial(index_dir: str, sha256s=None) -> None:
  """Temp files of a shard write a crash interrupted (nothing names them): all of them, or
  (an array task, while other tasks write theirs) those of the binaries ``sha256s``."""
  folder = os.path.join(index_dir, SHARDS)
  mine = None if sha256s is None else tuple(f".{d}." for d in sha256s)
  for name in os.listdir(folder) if os.path.isdir(folder) else ():
    if name.endswith(".tmp") and (mine is None or name.startswith(mine)):
      os.unlink(os.path.join(folder, name))


def npz_bytes(vectors: np.ndarray) -> bytes:
  """``np.savez(vectors=…)``'s file, reproducible: np.savez stamps its member with the current
  time, so two builds of one binary would differ in two bytes."""
  buf = io.BytesIO()
  with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
    member = zipfile.ZipInfo("vectors.npy", date_time=(1980, 1, 1, 0, 0, 0))
    with z.open(member, "w", force_zip64=True) as f:
      np.lib.format.write_array(f, np.ascontiguousarray(vectors, np.float32), allow_pickle=False)
  return buf.getvalue()


def write_shard(index_dir: str, stem: str, vectors: np.ndarray, rows: list[dict]) -> dict:
  """Writes a shard's two files → their digests, for its index.json entry."""
  os.makedirs(os.path.join(index_dir, SHARDS), exist_ok=True)
  text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
  digests = {}
  for ext, data in ((".npz", npz_bytes(vectors)), (".jsonl", text.encode())):
    file_io.atomic_write_bytes(os.path.join(index_dir, stem + ext), data)
    digests[SHARD_FILES[ext]] = hashlib.sha256(data).hexdigest()
  return digests


def read_shard(index_dir: str, binary: dict, dim: int) -> tuple[np.ndarray, list[dict]]:
  """(vectors [n, dim], rows) of one binary's shard, checked against index.json's entry."""
  n = binary["functions"]
  path = os.path.join(index_dir, binary["shard"] + ".npz")
  try:
    with np.load(path) as z:
      vectors = z["vectors"]
  except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
    raise IndexFileError(f"{path}: unreadable shard ({file_io.error_reason(e)}); "
                         f"{rebuild(index_dir, binary)}") from None
  if vectors.dtype != np.float32 or vectors.shape != (n, dim):
    raise IndexFileError(f"{path}: vectors {vectors.dtype} {list(vectors.shape)}, index.json "
                         f"expects float32 [{n}, {dim}]; {rebuild(index_dir, binary)}")
  return vectors, _read_rows(index_dir, binary)


def rebuild(index_dir: str, binary: dict) -> str:
  """The fix of a damaged shard: a rerun of lmscale index rebuilds it (index.build)."""
  return (f"rerun lmscale index --output {index_dir} (it rebuilds the damaged shard from "
          f"{binary['path']}, or from an --elf file of the same sha256)")


def damage(index_dir: str, binary: dict, dim: int) -> str:
  """What is wrong with a binary's shard files ("" where they are intact): a file missing or
  not the bytes index.json recorded; an entry without digests (an older index): its shard as
  :func:`read_shard` reads it."""
  for ext, key in SHARD_FILES.items():
    path = os.path.join(index_dir, binary["shard"] + ext)
    if not os.path.isfile(path):
      return f"{path} is missing"
    try:
      if key in binary and file_io.sha256_file(path) != binary[key]:
        return f"{path} is not the file index.json recorded (another sha256)"
    except OSError as e:
      return f"{path}: unreadable ({file_io.error_reason(e)})"
  if all(key in binary for key in SHARD_FILES.values()):
    return ""
  try:
    read_shard(index_dir, binary, dim)
  except IndexFileError as e:  # what is wrong, without the advice
    return str(e).removesuffix(f"; {rebuild(index_dir, binary)}")
  return ""


def check_present(index_dir: str, doc: dict) -> None:
  """Every shard file ``doc`` names exists (a stat each: what an array's finish checks of the
  entries it merges, so it never extends an index with holes; a rerun checks more,
  :func:`damage`; the contents are checked as read)."""
  for b in doc["binaries"]:
    for ext in (".npz", ".jsonl"):
      path = os.path.join(index_dir, b["shard"] + ext)
      if not os.path.isfile(path):
        raise IndexFileError(f"{path}: missing (index.json names it); {rebuild(index_dir, b)}")


def _read_rows(index_dir: str, binary: dict) -> list[dict]:
  path = os.path.join(index_dir, binary["shard"] + ".jsonl")
  try:
    with open(path) as f:
      rows = [json.loads(line) for line in f]
  except (OSError, ValueError) as e:
    raise IndexFileError(f"{path}: unreadable shard metadata ({file_io.error_reason(e)}); "
                         f"{rebuild(index_dir, binary)}") from None
  if len(rows) != binary["functions"] or not all(
      isinstance(r, dict) and set(ROW_KEYS) <= set(r) for r in rows):
    raise IndexFileError(f"{path}: {len(rows)} rows, index.json expects {binary['functions']} "
                         f"each with {', '.join(ROW_KEYS)}; {rebuild(index_dir, binary)}")
  return rows
