"""Pass 3 in the workers: each piece's packed sequences to disk, then each shard cut from them.

A piece (``shard_writer.pieces``: ~4 MB of corpus lines) is tokenized and packed by a worker,
which writes ``pieces/NNNNNN-<split>.npy`` and, last, ``NNNNNN.json`` (its counts: the marker a
rerun trusts). Once every piece is done, the shards of a fixed record count are cut from the
pieces in order by prefix sums, so each shard is one worker's task too. The parent only hands
out tasks: it used to encode and write every record itself (12.7 µs a record, ~27 MB/s of
input whatever the cores). Single-node preparation and the cluster stages (``cluster_stages``)
share this; the cost is the uncompressed sequences on disk until their shards are written
(``shard_writer`` removes them then, the cluster's ``finish`` at the end).
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from lmscale_jax.prep import tokenize_pack
from lmscale_jax.store import dataset, file_io

PIECES, SHARDS = "pieces", "shards"


def piece_base(work: str, index: int) -> str:
  return os.path.join(work, PIECES, f"{index:06d}")


def sequences_file(base: str, split: str) -> str:
  """A piece's packed sequences of one split."""
  return f"{base}-{split}.npy"


def save_npy(path: str, array: np.ndarray) -> None:
  tmp = f"{path}.{os.getpid()}.partial"
  with open(tmp, "wb") as f:
    np.save(f, array)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def done_piece(base: str) -> dict | None:
  """The counts of a piece an earlier run (or another task) finished, else None."""
  try:
    with open(base + ".json") as f:
      return json.load(f)
  except FileNotFoundError:
    return None


def pack_piece(task) -> dict:
  """Pool task ``(base, read, args, init)``: the lines ``read(*args)`` yields (in batches),
  tokenized and packed (``tokenize_pack.tokenize_lines``, in a worker set up for ``init``),
  written under ``base``. Returns the piece's counts per split and this run's seconds."""
  base, read, args, init = task
  info = done_piece(base)
  if info is not None:
    return {**info, "seconds": {}}
  tokenize_pack.ensure_worker(init)
  out, seconds = tokenize_pack.tokenize_lines(read(*args))
  special = tokenize_pack.special_ids()
  counts = {}
  for split, r in out.items():
    seqs = r["seqs"]
    save_npy(sequences_file(base, split), seqs)
    counts[split] = {"items": r["items"], "content_tokens": r["content_tokens"],
                     "sequences": len(seqs),
                     "tokens": int(np.count_nonzero(seqs != special["[PAD]"])),
                     "unk": int(np.count_nonzero(seqs == special["[UNK]"]))}
  info = {"splits": counts, "seconds": seconds}
  file_io.atomic_write_json(base + ".json", info)
  return info


def records_per_shard(seq_len: int, shard_size_mb: float) -> int:
  return max(1, int(shard_size_mb * (1 << 20))
             // (len(dataset.record_prefix(seq_len)) + 2 * seq_len))


def shard_tasks(work: str, counts: list[dict], per: int, compression: str) -> list[tuple]:
  """Every shard of every split as a task of :func:`write_shard`: its path and the
  (piece base, first record, end record) ranges it takes, ``per`` records each but the last."""
  tasks = []
  for split in dataset.SPLITS:
    ranges, filled = [], 0
    for index, c in enumerate(counts):
      n, at = c["splits"][split]["sequences"], 0
      while at < n:
        take = min(n - at, per - filled)
        ranges.append((piece_base(work, index), at, at + take))
        at, filled = at + take, filled + take
        if filled == per:
          tasks.append((split, ranges))
          ranges, filled = [], 0
    if ranges:
      tasks.append((split, ranges))
  out, number = [], {s: 0 for s in dataset.SPLITS}
  for split, ranges in tasks:
    base = os.path.join(work, SHARDS, f"{split}-{number[split]:05d}")
    out.append((split, base, ranges, compression))
    number[split] += 1
  return out


def read_last_by(tasks: list[tuple]) -> dict[int, list[str]]:
  """The pieces' sequence files each shard of ``tasks`` (:func:`shard_tasks`') is the last to
  read: once it and every shard before it are written, nothing reads them again."""
  last = {}
  for k, (split, _, ranges, _) in enumerate(tasks):
    for piece, _, _ in ranges:
      last[sequences_file(piece, split)] = k
  out: dict[int, list[str]] = {}
  for path, k in last.items():
    out.setdefault(k, []).append(path)
  return out


def done_shard(base: str, records: int) -> dict | None:
  """The sidecar of a shard an earlier run finished, if it is the one this run writes."""
  try:
    with open(base + ".json") as f:
      info = json.load(f)
  except FileNotFoundError:
    return None
  path = base + ".array_record"
  if info["records"] != records or not os.path.exists(path) or \
      os.path.getsize(path) != info["bytes"]:
    return None
  return info


def write_shard(task) -> dict:
  """Pool task: one shard from its ranges of the pieces' sequences; its sidecar last. Returns
  the sidecar's info, with ``seconds`` only when written in this run."""
  split, base, ranges, compression = task
  info = done_shard(base, sum(hi - lo for _, lo, hi in ranges))
  if info is not None:
    return {k: v for k, v in info.items() if k != "seconds"}  # this run wrote nothing

  def records():
    for piece, lo, hi in ranges:
      yield from dataset.encode_records(np.load(sequences_file(piece, split), mmap_mode="r")[lo:hi])

  t0 = time.perf_counter()
  os.makedirs(os.path.dirname(base), exist_ok=True)
  info = dataset.write_array_record(base + ".array_record", records(), compression)
  info["seconds"] = time.perf_counter() - t0  # the sidecar's too: a cluster's finish adds them
  file_io.atomic_write_json(base + ".json", info)
  return info


def result(counts: list[dict], tasks: list[tuple], infos: list[dict], special: dict,
           vocab_size: int, seconds: dict) -> dict:
  """What ``prepare._finalize`` takes: the shards per split, the stats per split, seconds."""
  st = {s: {"sequences": 0, "tokens": 0, "content_tokens": 0, "unk": 0, "items": 0}
        for s in dataset.SPLITS}
  for c in counts:
    for split, r in c["splits"].items():
      for k, v in r.items():
        st[split][k] += v
  splits = {s: [] for s in dataset.SPLITS}
  for (split, *_), info in zip(tasks, infos):
    splits[split].append(info)
  return {"splits": splits, "special": special, "stats": st, "vocab_size": vocab_size,
          "seconds": seconds}


def add_seconds(total: dict, seconds: dict) -> None:
  for k, v in seconds.items():
    total[k] = total.get(k, 0.0) + v
