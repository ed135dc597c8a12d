"""The dataset directory: the on-disk contract between data preparation and training.

A dataset directory holds
  * ``{name}-{split}.array_record-{i:05d}-of-{n:05d}`` shards (ArrayRecord, ``group_size:1`` so
    every record is randomly addressable). One record = one training sequence of ``seq_len``
    uint16 token ids, stored as a serialized ``tf.train.Example`` with one bytes feature
    ``input_ids`` (TFDS ``Tensor(dtype=uint16, encoding=BYTES)``), so TFDS reads it too;
  * ``tokenizer.json`` (Hugging Face ``tokenizers``);
  * ``metadata.json`` (this module's :class:`DatasetMeta`): written last, its presence means the
    dataset is complete;
  * ``stats.json`` (what preparation saw and produced);
  * ``dataset_info.json`` / ``features.json`` (TFDS), for ``tfds.builder_from_directory``.

Attention masks are not stored: they are ``input_ids != pad_id``, and the functions of a
packed record are its ``[CLS] … [SEP]`` spans (format 2: every packed piece has its own [CLS];
format 1, which still loads, had one leading [CLS] per record: ``has_cls_per_segment``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from typing import Iterable, Iterator

import numpy as np

from lmscale_jax.errors import UserError
from lmscale_jax.store import file_io, user_text

FORMAT = "lmscale_jax.dataset/2"  # 2: a [CLS] before every packed piece (packing.Packer)
FORMAT_1 = "lmscale_jax.dataset/1"  # records identical for --packing none; still loads
FEATURE = "input_ids"
DTYPE = "uint16"
MAX_VOCAB = 65535  # ids must fit uint16
NEXT = "[NEXT]"  # between the instructions of a function (prep/elf/pretokenize.py)
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", NEXT)
SPLITS = ("train", "validation")
FILE_FORMAT = "array_record"
FILENAME_TEMPLATE = "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}"
METADATA = "metadata.json"
STATS = "stats.json"
TOKENIZER = "tokenizer.json"


class DatasetError(UserError, ValueError):
  """A dataset directory or one of its files is missing, malformed or inconsistent."""


# --------------------------------------------------------------------------- records
@functools.lru_cache(maxsize=None)
def record_prefix(seq_len: int) -> bytes:
  """Serialized ``tf.train.Example`` bytes that precede the raw uint16 payload.

  An Example with a single bytes feature serializes as a fixed header followed by the payload,
  so we encode/decode by concatenation/slicing instead of building a protobuf per record (the
  loader's hot path). ``tests/test_prepare.py`` reads our shards back with TFDS's own reader.
  """
  payload = 2 * seq_len

  def varint(n: int) -> bytes:
    out = bytearray()
    while True:
      b = n & 0x7F
      n >>= 7
      out.append(b | (0x80 if n else 0))
      if not n:
        return bytes(out)

  def field(tag: int, body_len: int) -> bytes:  # length-delimited field header
    return bytes([tag]) + varint(body_len)

  key = FEATURE.encode()
  bytes_list = field(0x0A, payload)                         # BytesList.value
  feature = field(0x0A, len(bytes_list) + payload)          # Feature.bytes_list
  entry_key = field(0x0A, len(key)) + key                   # map entry key
  entry_val = field(0x12, len(feature) + len(bytes_list) + payload)
  entry_len = len(entry_key) + len(entry_val) + len(feature) + len(bytes_list) + payload
  features = field(0x0A, entry_len)                          # Features.feature (map entry)
  example = field(0x0A, len(features) + entry_len)           # Example.features
  return example + features + entry_key + entry_val + feature + bytes_list


def encode_record(ids: np.ndarray) -> bytes:
  ids = np.asarray(ids)
  if ids.ndim != 1:
    raise DatasetError(f"a record is one sequence; got shape {ids.shape}")
  return record_prefix(ids.shape[0]) + ids.astype("<u2", copy=False).tobytes()


def encode_records(seqs: np.ndarray) -> Iterator[bytes]:
  """:func:`encode_record` of each row of ``seqs`` ([n, seq_len]): one conversion of the whole
  array, then slices (per row, a numpy view and a tobytes were ~40% of a shard's write time
  besides the compression)."""
  seqs = np.asarray(seqs)
  if seqs.ndim != 2:
    raise DatasetError(f"records are rows of a [n, seq_len] array; got shape {seqs.shape}")
  prefix, step = record_prefix(seqs.shape[1]), 2 * seqs.shape[1]
  data = seqs.astype("<u2", copy=False).tobytes()
  for at in range(0, len(data), step):
    yield prefix + data[at:at + step]


def decode_record(record: bytes, seq_len: int, where: str = "record") -> np.ndarray:
  """Raw record bytes -> (seq_len,) uint16 array; a malformed record raises DatasetError."""
  prefix = record_prefix(seq_len)
  if len(record) != len(prefix) + 2 * seq_len or not record.startswith(prefix):
    raise DatasetError(
        f"{where}: malformed record ({len(record)} bytes; expected a {seq_len}-token "
        f"'{FEATURE}' example of {len(prefix) + 2 * seq_len} bytes): the shard is corrupt or was "
        "written with another seq_len")
  return np.frombuffer(record, dtype="<u2", offset=len(prefix))


# A shard's per-record compression -> ArrayRecord's writer options. Every record is its own
# chunk (group_size:1: random access); readers find the codec in each chunk, so any choice
# reads back without being told. zstd is ArrayRecord's default (written as before: the same
# bytes as datasets prepared before the option existed).
COMPRESSIONS = {"zstd": "group_size:1", "snappy": "group_size:1,snappy",
                "none": "group_size:1,uncompressed"}


def write_array_record(path: str, records: Iterable[bytes], compression: str = "zstd") -> dict:
  """Writes records to ``path`` atomically; returns {records, bytes, sha256}."""
  from array_record.python import array_record_module

  d = os.path.dirname(os.path.abspath(path))
  tmp = os.path.join(d, "." + os.path.basename(path) + ".partial")
  n = 0
  writer = array_record_module.ArrayRecordWriter(tmp, COMPRESSIONS[compression])
  try:
    for rec in records:
      writer.write(rec)
      n += 1
  finally:
    writer.close()
  with open(tmp, "rb+") as f:
    os.fsync(f.fileno())
  info = {"records": n, "bytes": os.path.getsize(tmp), "sha256": file_io.sha256_file(tmp)}
  os.replace(tmp, path)
  file_io.fsync_dir(d)
  return info


def shard_filename(name: str, split: str, index: int, count: int) -> str:
  return f"{name}-{split}.{FILE_FORMAT}-{index:05d}-of-{count:05d}"


def tfds_features(seq_len: int):
  import tensorflow_datasets as tfds

  return tfds.features.FeaturesDict({
      FEATURE: tfds.features.Tensor(
          shape=(seq_len,), dtype=np.uint16, encoding=tfds.features.Encoding.BYTES),
  })


def write_tfds_metadata(directory: str, name: str, seq_len: int, splits: dict) -> None:
  """TFDS's dataset_info.json/features.json so ``tfds.builder_from_directory`` reads the shards."""
  import tensorflow_datasets as tfds

  infos = []
  for split, info in splits.items():
    if not info["shards"]:  # TFDS has no notion of an empty split; metadata.json keeps it
      continue
    infos.append(tfds.core.SplitInfo(
        name=split,
        shard_lengths=[s["records"] for s in info["shards"]],
        num_bytes=sum(s["bytes"] for s in info["shards"]),
        filename_template=tfds.core.ShardedFileTemplate(
            data_dir=directory, template=FILENAME_TEMPLATE, dataset_name=name, split=split,
            filetype_suffix=FILE_FORMAT)))
  tfds.folder_dataset.write_metadata(
      data_dir=directory, features=tfds_features(seq_len), split_infos=infos,
      filename_template=FILENAME_TEMPLATE, check_data=False)


# --------------------------------------------------------------------------- metadata
# metadata.json's fields, each checked for type and range once, where it is parsed
# (:func:`check_fields`): a hand-edited or damaged value is one line naming file and key, not a
# traceback later ("splits": []) or a wrong answer ("records": -1 passed --verify).
MAX_SEQ_LEN = 1 << 20  # far above what lmscale prepare makes (1 << 16): a sanity bound
PACKINGS = ("greedy", "none")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _shown(value) -> str:
  if isinstance(value, (dict, list)):
    return f"a JSON {'object' if isinstance(value, dict) else 'array'}"
  return json.dumps(value)[:60]


def _wrong(mpath: str, key: str, value, expected: str) -> DatasetError:
  return DatasetError(f"{mpath}: {key} is {_shown(value)}; expected {expected} (a damaged or "
                      "hand-edited metadata.json: re-prepare the dataset)")


def _int(mpath: str, key: str, value, lo: int, hi: int | None = None) -> int:
  """``value`` when it is an integer (not a bool) in lo..hi."""
  if not isinstance(value, int) or isinstance(value, bool) or value < lo or (
      hi is not None and value > hi):
    raise _wrong(mpath, key, value, f"an integer in {lo}..{hi}" if hi is not None
                 else f"an integer >= {lo}")
  return value


def _object(mpath: str, key: str, value) -> dict:
  if not isinstance(value, dict):
    raise _wrong(mpath, key, value, "a JSON object")
  return value


def _shard(mpath: str, key: str, shard) -> int:
  """One shard entry checked; its record count."""
  _object(mpath, key, shard)
  name = shard.get("file")
  if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name:
    raise _wrong(mpath, f"{key}.file", name, "a file name in the dataset directory")
  if not isinstance(shard.get("sha256"), str) or not _SHA256.fullmatch(shard["sha256"]):
    raise _wrong(mpath, f"{key}.sha256", shard.get("sha256"), "64 lowercase hex digits")
  _int(mpath, f"{key}.bytes", shard.get("bytes"), 0)
  return _int(mpath, f"{key}.records", shard.get("records"), 0)


def _split(mpath: str, key: str, info) -> None:
  _object(mpath, key, info)
  shards = info.get("shards")
  if not isinstance(shards, list):
    raise _wrong(mpath, f"{key}.shards", shards, "a JSON array of shard entries")
  total = sum(_shard(mpath, f"{key}.shards[{i}]", s) for i, s in enumerate(shards))
  if _int(mpath, f"{key}.records", info.get("records"), 0) != total:
    raise _wrong(mpath, f"{key}.records", info["records"], f"{total}, the sum of its shards' "
                 "records")


def check_fields(raw: dict, mpath: str) -> None:
  """Every field of metadata.json that is read, by type and range (``raw``: a JSON object
  holding the required keys); the first wrong one is a DatasetError naming it."""
  if raw["dtype"] != DTYPE:
    raise _wrong(mpath, "dtype", raw["dtype"], json.dumps(DTYPE))
  if not isinstance(raw["name"], str) or not raw["name"]:
    raise _wrong(mpath, "name", raw["name"], "a non-empty string")
  _int(mpath, "seq_len", raw["seq_len"], 1, MAX_SEQ_LEN)
  vocab = _int(mpath, "vocab_size", raw["vocab_size"], 1, MAX_VOCAB)
  ids = _object(mpath, "special_ids", raw["special_ids"])
  missing = [t for t in SPECIAL_TOKENS if t not in ids]
  if missing:
    raise DatasetError(f"{mpath}: special_ids lacks {missing}")
  for token, i in ids.items():
    _int(mpath, f"special_ids.{token}", i, 0, vocab - 1)
  if "kind" in raw and not isinstance(raw["kind"], str):  # any name; "binary": instructions
    raise _wrong(mpath, "kind", raw["kind"], 'a string ("binary" or "text")')
  if "packing" in raw and raw["packing"] not in PACKINGS:
    raise _wrong(mpath, "packing", raw["packing"], " or ".join(map(json.dumps, PACKINGS)))
  for split, info in _object(mpath, "splits", raw["splits"]).items():
    _split(mpath, f"splits.{split}", info)


@dataclasses.dataclass(frozen=True)
class DatasetMeta:
  """Parsed, validated ``metadata.json``."""

  path: str
  name: str
  seq_len: int
  vocab_size: int
  special_ids: dict
  splits: dict  # split -> {"records": int, "shards": [{"file", "records", "bytes", "sha256"}]}
  raw: dict

  @property
  def pad_id(self) -> int:
    return self.special_ids["[PAD]"]

  @property
  def metadata_path(self) -> str:
    return os.path.join(self.path, METADATA)

  @property
  def has_cls_per_segment(self) -> bool:
    """Every function/document of a record starts with its own [CLS] (what
    ``model.packed_attention="segment"`` needs): format 2, or a format-1 dataset of one piece
    per record (``--packing none``)."""
    return self.raw.get("format", FORMAT) == FORMAT or self.raw.get("packing") == "none"

  @property
  def has_instructions(self) -> bool:
    """Its records are instruction text with ``[NEXT]`` between instructions (what
    ``model.positions="instruction"`` needs): a binary-code dataset (``"kind"``; datasets from
    before the key name their shards ``binary_code-…``). Synthetic metadata counts as one."""
    kind = self.raw.get("kind")
    if kind is None and self.splits:
      files = [s["file"] for info in self.splits.values() for s in info.get("shards", [])]
      kind = "binary" if all(str(f).startswith("binary_code") for f in files) else "text"
    return kind in (None, "binary")

  @classmethod
  def load(cls, path: str) -> "DatasetMeta":
    if os.path.exists(path) and not os.path.isdir(path):
      raise DatasetError(f"data.path {path!r} is a file; expected a dataset directory (the one "
                         "holding metadata.json and the shards, made by lmscale prepare binary "
                         "or lmscale prepare text)")
    if not os.path.isdir(path):
      raise DatasetError(f"dataset directory {path!r} does not exist (prepare one with "
                         "lmscale prepare binary or lmscale prepare text)")
    mpath = os.path.join(path, METADATA)
    if not os.path.exists(mpath):
      raise DatasetError(f"{mpath}: missing; {path!r} is not a complete lmscale_jax dataset "
                         "(an interrupted preparation? rerun it to finish)")
    if kind := file_io.not_regular(mpath):
      raise DatasetError(f"{mpath} is {kind}: expected the dataset's metadata file (JSON)")
    try:
      with open(mpath, "rb") as f:
        raw = user_text.parse_json(f.read(), mpath)
    except user_text.TextError as e:  # not UTF-8, a lone surrogate, nested past the parser
      raise DatasetError(str(e)) from None
    except (OSError, ValueError) as e:
      raise DatasetError(f"{mpath}: not readable JSON: {e}") from e
    if not isinstance(raw, dict):
      raise DatasetError(f"{mpath}: a JSON {type(raw).__name__}, expected an object")
    if raw.get("format") not in (FORMAT, FORMAT_1):
      raise DatasetError(f"{mpath}: format {raw.get('format')!r}, expected {FORMAT!r} (or "
                         f"{FORMAT_1!r}); re-prepare it with lmscale prepare binary or "
                         "lmscale prepare text")
    for key in ("name", "seq_len", "vocab_size", "special_ids", "splits", "dtype"):
      if key not in raw:
        raise DatasetError(f"{mpath}: missing key {key!r}")
    check_fields(raw, mpath)
    return cls(path=path, name=raw["name"], seq_len=int(raw["seq_len"]),
               vocab_size=int(raw["vocab_size"]), special_ids=dict(raw["special_ids"]),
               splits=raw["splits"], raw=raw)

  @classmethod
  def synthetic(cls, seq_len: int, vocab_size: int) -> "DatasetMeta":
    """Metadata for runs without a dataset (benchmarks and tools on synthetic batches)."""
    return cls(path="<synthetic>", name="synthetic", seq_len=int(seq_len),
               vocab_size=int(vocab_size),
               special_ids={t: i for i, t in enumerate(SPECIAL_TOKENS)}, splits={}, raw={})

  def shard_paths(self, split: str) -> list[str]:
    if split not in self.splits:
      raise DatasetError(f"{self.path}: no split {split!r}; it has {sorted(self.splits)}")
    shards = self.splits[split]["shards"]
    if not shards:
      raise DatasetError(f"{self.path}: split {split!r} has zero shards (too little data for "
                         "it at preparation time)")
    return [os.path.join(self.path, s["file"]) for s in shards]

  def num_records(self, split: str) -> int:
    return sum(s["records"] for s in self.splits[split]["shards"])

  def verify(self, checksums: bool = True) -> list[str]:
    """Re-checks every shard's presence, record count and (optionally) sha256.

    Returns a list of problems, empty when the dataset is intact.
    """
    problems = [self.shard_problem(s, checksums)
                for info in self.splits.values() for s in info["shards"]]
    return [p for p in problems if p]

  def shard_problem(self, shard: dict, checksums: bool = True) -> str | None:
    """What is wrong with one shard entry of ``metadata.json`` on disk (size, sha256, record
    count), or None."""
    from array_record.python import array_record_module

    p = os.path.join(self.path, shard["file"])
    if kind := file_io.not_regular(p):
      return f"{p} is {kind}, not a shard file"
    try:
      size = os.path.getsize(p)
    except OSError as e:
      return f"{p}: missing or unreadable ({e.strerror or e})"
    if size != shard["bytes"]:
      return f"{p}: size {size} bytes, expected {shard['bytes']} (metadata.json)"
    if checksums:
      digest = file_io.sha256_file(p, chunk=8 << 20)
      if digest != shard["sha256"]:
        return f"{p}: sha256 {digest}, expected {shard['sha256']} (metadata.json)"
    try:
      r = array_record_module.ArrayRecordReader(p)
      n = r.num_records()
      r.close()
    except Exception as e:  # array_record raises plain RuntimeError on corrupt footers
      return f"{p}: unreadable ArrayRecord file: {file_io.error_reason(e)}"
    if n != shard["records"]:
      return f"{p}: {n} records, expected {shard['records']} (metadata.json)"
    return None


def finalize(directory: str, *, name: str, seq_len: int, vocab_size: int, special_ids: dict,
             splits: dict, extra: dict | None = None) -> DatasetMeta:
  """Writes TFDS metadata, then ``metadata.json`` last (atomically): the dataset is complete.

  ``splits``: split -> list of shard infos ``{"file", "records", "bytes", "sha256"}``; the files
  must already be in ``directory`` under their final names.
  """
  if vocab_size > MAX_VOCAB:
    raise DatasetError(f"vocab_size {vocab_size} > {MAX_VOCAB}: ids would not fit uint16")
  split_meta = {s: {"records": sum(x["records"] for x in shards), "shards": list(shards)}
                for s, shards in splits.items()}
  write_tfds_metadata(directory, name, seq_len, split_meta)
  meta = {"format": FORMAT, "name": name, "seq_len": seq_len, "vocab_size": vocab_size,
          "dtype": DTYPE, "feature": FEATURE, "record_encoding": "tf.train.Example bytes",
          "special_ids": special_ids, "splits": split_meta, **(extra or {})}
  file_io.atomic_write_json(os.path.join(directory, METADATA), meta)
  return DatasetMeta.load(directory)
