"""Pass 3 of data preparation: corpus chunks → token ids (a process pool over chunks, ordered)
→ packed sequences → ArrayRecord shards of a fixed record count. Shards already finished by an
earlier run (sidecar present) are not rewritten: the stream is regenerated (it is
deterministic) and their records skipped."""

from __future__ import annotations

import itertools
import json
import os
import time

import numpy as np
from tqdm import tqdm

from lmscale_jax.prep import corpus_extract, worker_pool
from lmscale_jax.prep.options import Options
from lmscale_jax.prep.packing import Packer
from lmscale_jax.store import dataset
from lmscale_jax.store import tokenizer as toklib
from lmscale_jax.store.dataset import NEXT

TOKENIZE_BATCH = 4096

_worker: dict = {}  # the tokenize worker's tokenizer and packing settings


class PretokenIds(dict):
  """pretoken → its token ids, filled from the tokenizer on first sight of each pretoken.

  Binary code is already split into whitespace-separated pretokens and its tokenizer is
  WordPiece over those words, so a text's ids are the concatenation of its words' ids. A few
  thousand distinct pretokens make this memo ~10× faster than ``encode_batch`` (which pays for
  added-token matching and an Encoding object per text) with identical output (tested).
  """

  def __init__(self, tok):
    super().__init__()
    self.tok = tok
    self.instructions = _InstructionIds(self)

  def __missing__(self, word: str) -> tuple:
    ids = tuple(self.tok.encode(word, add_special_tokens=False).ids)
    self[word] = ids
    return ids

  def encode(self, text: str) -> np.ndarray:
    # One lookup per instruction (its words' ids and the separator's, as uint16 bytes) instead
    # of per word: ~5× fewer; one bytes join instead of an iterator over every id (measured:
    # half the stage's time); the separator after the last instruction is cut off.
    ids = np.frombuffer(b"".join(map(self.instructions.__getitem__, text.split(_SEPARATOR))),
                        np.uint16)
    return ids[:len(ids) - self.instructions.separator_len]


_SEPARATOR = f" {NEXT} "


class _InstructionIds(dict):
  """One instruction's text → its words' ids then the separator's (uint16 bytes); bounded (a
  corpus holds millions of distinct instructions, a chunk's repeat)."""

  def __init__(self, words: PretokenIds, size: int = 1 << 18):
    super().__init__()
    self.words, self.size = words, size
    self.separator = words[NEXT]
    self.separator_len = len(self.separator)

  def __missing__(self, instruction: str) -> bytes:
    if len(self) >= self.size:
      self.clear()
    words = self.words
    ids = self[instruction] = np.array([*itertools.chain.from_iterable(
        [words[w] for w in instruction.split()]), *self.separator], np.uint16).tobytes()
    return ids


def _init_tokenize_worker(path: str, kind: str, seq_len: int, packing: str,
                          val_fraction: float) -> None:
  global _worker
  from tokenizers import Tokenizer

  tok = Tokenizer.from_file(path)
  if kind == "binary":
    memo = PretokenIds(tok)
    encode = lambda texts: [memo.encode(t) for t in texts]  # noqa: E731
  else:
    encode = lambda texts: [  # noqa: E731
        np.asarray(e.ids, np.uint16) for e in tok.encode_batch(texts, add_special_tokens=False)]
  special = toklib.validate(tok, path)
  _worker = {"encode": encode, "seq_len": seq_len, "packing": packing,
             "val_fraction": val_fraction, "special": special}


# Pass 3's task: about this many bytes of a corpus chunk, ending at a line end. Measured: with
# whole 32 MB chunks as the tasks, two workers tokenized this machine's corpus no faster than
# one (2.63 vs 2.55 s: one chunk held most of it).
PIECE_BYTES = 4 << 20


def pieces(chunks: list[str], piece_bytes: int = PIECE_BYTES) -> list[tuple[str, int, int]]:
  """(chunk, start, end) byte ranges of about ``piece_bytes`` covering every chunk, each
  ending at a line end. They depend only on the chunks' bytes, so the output is the same for
  any number of workers."""
  out = []
  for path in chunks:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      start = 0
      while start < size:
        f.seek(min(start + piece_bytes, size))
        f.readline()  # on to the end of the line the boundary falls in
        end = min(f.tell(), size)
        out.append((path, start, end))
        start = end
  return out


def _piece_lines(path: str, start: int, end: int):
  """The corpus lines of one piece, in batches of TOKENIZE_BATCH."""
  with open(path, "rb") as f:
    f.seek(start)
    # split("\n"), not splitlines(): a document's text may hold other line separators
    lines = [line + "\n" for line in f.read(end - start).decode("utf-8").split("\n")[:-1]]
  for i in range(0, len(lines), TOKENIZE_BATCH):
    yield lines[i:i + TOKENIZE_BATCH]


def _tokenize_piece(piece: tuple[str, int, int]) -> dict:
  """Pool task: a piece of a corpus chunk (:func:`pieces`) → per split, its packed sequences
  ([n, seq_len] uint16).

  Each piece is packed on its own (its open sequences are flushed at its end) so packing runs
  in the workers, in parallel; the cost is at most a window of part-filled sequences per piece.
  """
  w, sp = _worker, _worker["special"]
  packers = {s: Packer(w["seq_len"], sp["[CLS]"], sp["[SEP]"], sp["[PAD]"], w["packing"])
             for s in dataset.SPLITS}
  out = {s: {"seqs": [], "items": 0, "content_tokens": 0} for s in dataset.SPLITS}
  seconds = {"tokenize": 0.0, "pack": 0.0}
  for batch in _piece_lines(*piece):
    t0 = time.perf_counter()
    parsed = [corpus_extract.parse_corpus_line(line) for line in batch]
    encoded = w["encode"]([text for _, text in parsed])
    t1 = time.perf_counter()
    for (digest, _), ids in zip(parsed, encoded):
      split = _split_of(digest, w["val_fraction"])
      o = out[split]
      o["items"] += 1
      o["content_tokens"] += len(ids)
      o["seqs"].extend(packers[split].add(ids))
    seconds["tokenize"] += t1 - t0
    seconds["pack"] += time.perf_counter() - t1
  t0 = time.perf_counter()
  for split, o in out.items():
    o["seqs"].extend(packers[split].flush())
    o["seqs"] = (np.stack(o["seqs"]) if o["seqs"] else
                 np.zeros((0, w["seq_len"]), np.uint16))
  seconds["pack"] += time.perf_counter() - t0
  return out, seconds


class _ShardSink:
  """Buffers one split's records into shards of a fixed record count, resumably."""

  def __init__(self, work: str, split: str, records_per_shard: int, compression: str):
    self.dir = os.path.join(work, "shards")
    os.makedirs(self.dir, exist_ok=True)
    self.split, self.per, self.compression = split, records_per_shard, compression
    self.buf: list[bytes] = []
    self.shards: list[dict] = []

  def _paths(self, i: int) -> tuple[str, str]:
    base = os.path.join(self.dir, f"{self.split}-{i:05d}")
    return base + ".array_record", base + ".json"

  def add(self, seq: np.ndarray) -> None:
    self.buf.append(dataset.encode_record(seq))
    if len(self.buf) == self.per:
      self.flush()

  def flush(self) -> None:
    if not self.buf:
      return
    path, side = self._paths(len(self.shards))
    info = None
    if os.path.exists(side):
      with open(side) as f:
        info = json.load(f)
      if info["records"] != len(self.buf) or not os.path.exists(path) or \
          os.path.getsize(path) != info["bytes"]:
        info = None  # not what this run produces: rewrite it
    if info is None:
      info = dataset.write_array_record(path, self.buf, self.compression)
      dataset.atomic_write_json(side, info)
    self.shards.append(info)
    self.buf = []


def _split_of(digest: bytes, val_fraction: float) -> str:
  # digest-derived, so a function/document always lands in the same split on every run.
  key = int.from_bytes(digest[:8], "big")
  return "validation" if (key % 1_000_000) < val_fraction * 1_000_000 else "train"


def write_shards(o: Options, work: str, chunks: list[str], tok) -> dict:
  """Pass 3. The result's ``seconds``: ``tokenize`` and ``pack`` (summed over the workers) and
  ``write`` (this process: records into shards)."""
  special = toklib.validate(tok, "tokenizer")
  per = max(1, int(o.shard_size_mb * (1 << 20))
            // (len(dataset.record_prefix(o.seq_len)) + 2 * o.seq_len))
  sinks = {s: _ShardSink(work, s, per, o.compression) for s in dataset.SPLITS}
  st = {s: {"sequences": 0, "tokens": 0, "content_tokens": 0, "unk": 0, "items": 0}
        for s in dataset.SPLITS}
  pad, unk = special["[PAD]"], special["[UNK]"]
  seconds = {"tokenize": 0.0, "pack": 0.0, "write": 0.0}
  tasks = pieces(chunks, PIECE_BYTES)
  bar = tqdm(total=len(tasks), unit="piece", desc="tokenize+pack", disable=not o.progress)
  init = (os.path.join(work, dataset.TOKENIZER), o.kind, o.seq_len, o.packing, o.val_fraction)
  with worker_pool.ordered_map(o.workers, _init_tokenize_worker, init) as pmap:
    for out, worker_seconds in pmap(_tokenize_piece, tasks):
      t0 = time.perf_counter()
      for stage, sec in worker_seconds.items():
        seconds[stage] += sec
      for split, r in out.items():
        s, seqs = st[split], r["seqs"]
        s["items"] += r["items"]
        s["content_tokens"] += r["content_tokens"]
        s["sequences"] += len(seqs)
        s["tokens"] += int(np.count_nonzero(seqs != pad))
        s["unk"] += int(np.count_nonzero(seqs == unk))
        for seq in seqs:
          sinks[split].add(seq)
      seconds["write"] += time.perf_counter() - t0
      bar.update(1)
  bar.close()
  t0 = time.perf_counter()
  for split in dataset.SPLITS:
    sinks[split].flush()
  seconds["write"] += time.perf_counter() - t0
  return {"splits": {s: sinks[s].shards for s in dataset.SPLITS}, "special": special, "stats": st,
          "vocab_size": tok.get_vocab_size(with_added_tokens=True), "seconds": seconds}
