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
from typing import Iterable, Iterator

import numpy as np

from lmscale_jax.errors import UserError
from lmscale_jax.store import file_io

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
      with open(mpath) as f:
        raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
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
    if raw["dtype"] != DTYPE:
      raise DatasetError(f"{mpath}: dtype {raw['dtype']!r}, expected {DTYPE!r}")
    if not 0 < raw["vocab_size"] <= MAX_VOCAB:
      raise DatasetError(f"{mpath}: vocab_size {raw['vocab_size']} outside 1..{MAX_VOCAB}")
    missing = [t for t in SPECIAL_TOKENS if t not in raw["special_ids"]]
    if missing:
      raise DatasetError(f"{mpath}: special_ids lacks {missing}")
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
