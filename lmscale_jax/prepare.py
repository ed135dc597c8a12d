"""Data preparation: corpus → tokenizer → packed uint16 ArrayRecord shards → dataset directory.

Three passes, each resumable, over ``OUTPUT/_work/`` (removed when the dataset is complete):
  1. extract (process pool over input files, ordered): functions/documents → normalised text,
     exact duplicates dropped (by digest, first occurrence wins), appended to ``corpus-NNNNN.txt``
     chunks. A chunk is complete when its ``.json`` sidecar exists; a rerun rebuilds the
     duplicate set from complete chunks and continues with the next input file.
  2. tokenizer: trained on the first ``tokenizer_sample_mb`` of the corpus (or the given one).
  3. tokenize (process pool over chunks, ordered) → pack → shards. Shards already finished by an
     earlier run (sidecar present) are not rewritten: the stream is regenerated (it is
     deterministic) and their records skipped.
Every file appears under its final name only once complete (temp file, fsync, rename), and
``metadata.json`` is written last. Output is byte-identical for any number of workers: pools are
ordered and every decision depends only on the input order.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import itertools
import json
import multiprocessing
import os
import shutil
import time
from typing import Iterator

import numpy as np
from tqdm import tqdm

from lmscale_jax import dataset
from lmscale_jax import elf_corpus, text_corpus, tokenizer as toklib
from lmscale_jax.elf_corpus import FileResult, InputError
from lmscale_jax.packing import Packer

WORK = "_work"
TOKENIZE_BATCH = 4096


class PrepareError(UserError, ValueError):
  """Bad arguments, inputs or output directory: one clear message, nothing partial left visible."""


@dataclasses.dataclass
class Options:
  kind: str                       # "binary" | "text"
  inputs: list
  output: str
  seq_len: int = 512
  vocab_size: int = 8192
  tokenizer: str = ""             # a given tokenizer.json; empty = train one
  tokenizer_model: str = "wordpiece"
  tokenizer_sample_mb: int = 64
  lowercase: bool = False
  workers: int = 0                # 0 = os.cpu_count()
  max_input_bytes: int = 0
  packing: str = "greedy"
  shard_size_mb: float = 64
  chunk_mb: float = 32            # corpus chunk size: the resume granularity of pass 1
  val_fraction: float = 0.01
  txt_docs: str = "line"
  text_field: str = "text"
  overwrite: bool = False
  progress: bool = True

  def output_params(self) -> dict:
    """Everything that determines the output bytes (a resume must match them)."""
    skip = {"workers", "overwrite", "progress", "output"}
    d = {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}
    d["inputs"] = [os.path.abspath(p) for p in self.inputs]
    if self.tokenizer:
      d["tokenizer"] = dataset.sha256_file(self.tokenizer)
    return d


# ----------------------------------------------------------------------------- checks
def _check_options(o: Options) -> None:
  if o.kind not in ("binary", "text"):
    raise PrepareError(f"kind {o.kind!r}: expected 'binary' or 'text'")
  if not o.tokenizer:
    try:
      toklib.check_vocab_size(o.vocab_size)
    except toklib.TokenizerError as e:
      raise PrepareError(str(e)) from None
  if o.seq_len < 8 or o.seq_len > 1 << 16:
    raise PrepareError(f"--seq-len {o.seq_len}: expected 8..65536")
  if o.packing not in ("greedy", "none"):
    raise PrepareError(f"--packing {o.packing!r}: expected 'greedy' or 'none'")
  if not 0 <= o.val_fraction < 1:
    raise PrepareError(f"--val-fraction {o.val_fraction}: expected 0 <= f < 1")
  if o.shard_size_mb <= 0 or o.chunk_mb <= 0:
    raise PrepareError(f"--shard-size-mb {o.shard_size_mb} / --chunk-mb {o.chunk_mb}: "
                       "expected > 0")
  if o.txt_docs not in ("line", "blank"):
    raise PrepareError(f"--txt-docs {o.txt_docs!r}: expected 'line' or 'blank'")
  if o.tokenizer and not os.path.isfile(o.tokenizer):
    raise PrepareError(f"--tokenizer {o.tokenizer!r}: no such file")


def _open_output(o: Options) -> bool:
  """Creates/validates the output directory. Returns True when resuming an earlier run."""
  out, work = o.output, os.path.join(o.output, WORK)
  params = o.output_params()
  if os.path.exists(out) and not os.path.isdir(out):
    raise PrepareError(f"output {out!r} exists and is not a directory")
  if os.path.isdir(out) and os.listdir(out):
    if o.overwrite:
      for name in os.listdir(out):
        p = os.path.join(out, name)
        shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
    elif os.path.isdir(work) and os.path.exists(os.path.join(work, "params.json")):
      with open(os.path.join(work, "params.json")) as f:
        old = json.load(f)
      if old != params:
        changed = sorted(k for k in set(old) | set(params) if old.get(k) != params.get(k))
        raise PrepareError(f"output {out!r} holds an unfinished preparation with other "
                           f"settings ({', '.join(changed)} differ); pass --overwrite to "
                           "start over")
      return True
    elif os.path.exists(os.path.join(out, dataset.METADATA)):
      raise PrepareError(f"output {out!r} already holds a complete dataset; pass --overwrite "
                         "to replace it")
    else:
      raise PrepareError(f"output {out!r} is not empty; pass --overwrite to replace its "
                         "contents")
  try:
    os.makedirs(work, exist_ok=True)
    dataset.atomic_write_json(os.path.join(work, "params.json"), params)
  except OSError as e:
    raise PrepareError(f"output {out!r} is not writable: {e.strerror}") from None
  return False


# ----------------------------------------------------------------------------- pass 1
PART_BYTES = 8 << 20  # ELF files larger than this are split over several tasks


def _parts(kind: str, size: int) -> int:
  # Depends only on the file size, so the task list (and the output) is the same for any
  # number of workers; big libraries (libLLVM: 110 MB) no longer serialize the whole pool.
  return 1 if kind != "binary" else max(1, min(64, -(-size // PART_BYTES)))


# The corpus line format between the passes (extraction writes, tokenization reads):
# "<the function's/document's 16-byte digest as 32 hex digits>\t<its text>\n". The text has
# no newline or tab of its own (pretokens are space-separated).
def format_corpus_line(digest: bytes, text: str) -> str:
  return f"{digest.hex()}\t{text}\n"


def parse_corpus_line(line: str) -> tuple[bytes, str]:
  """-> (digest, text): the inverse of :func:`format_corpus_line`."""
  digest_hex, text = line[:-1].split("\t", 1)
  return bytes.fromhex(digest_hex), text


def _extract_worker(args) -> tuple[FileResult, str]:
  """Pool task: one part of an input file → its lines streamed to a temp file (bounded memory)."""
  kind, path, part, parts, tmp, txt_docs, text_field = args
  res = FileResult(path=path, file_bytes=os.path.getsize(path))
  it = (elf_corpus.iter_functions(path, res, part, parts) if kind == "binary"
        else text_corpus.iter_documents(path, res, txt_docs, text_field))
  with open(tmp, "w", encoding="utf-8") as f:
    for digest, text in it:
      f.write(format_corpus_line(digest, text))
  return res, tmp


@contextlib.contextmanager
def _pool(workers: int, initializer=None, initargs=()):
  """An ordered, bounded map over tasks: a process pool, or in-process for one worker.

  At most ``2 × workers`` tasks are in flight, so results (token arrays of whole chunks) never
  pile up in the parent. A worker that dies (killed, out of memory) ends the run with an error
  instead of the endless wait of ``multiprocessing.Pool``.
  """
  if workers <= 1:
    if initializer:
      initializer(*initargs)
    yield map
    return
  # spawn, not fork: the parent may hold threads (tokenizers, tqdm) that fork would copy.
  ctx = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=initializer,
                                              initargs=initargs) as ex:

    def ordered(fn, items):
      pending = collections.deque()
      try:
        for item in items:
          pending.append(ex.submit(fn, item))
          if len(pending) >= 2 * workers:
            yield pending.popleft().result()
        while pending:
          yield pending.popleft().result()
      except concurrent.futures.process.BrokenProcessPool as e:
        raise PrepareError(f"a worker process died ({e}); rerun to resume") from None
      finally:
        for f in pending:
          f.cancel()

    yield ordered


@contextlib.contextmanager
def _input_errors():
  """A bad input found inside a worker (e.g. a malformed .jsonl line) becomes one clear error."""
  try:
    yield
  except InputError as e:
    raise PrepareError(str(e)) from None


def _chunks(work: str) -> list[tuple[str, dict]]:
  out, i = [], 0
  while os.path.exists(side := os.path.join(work, f"corpus-{i:05d}.json")):
    with open(side) as f:
      out.append((os.path.join(work, f"corpus-{i:05d}.txt"), json.load(f)))
    i += 1
  return out


def _empty_stats() -> dict:
  return {"input_files": 0, "input_bytes": 0, "code_bytes": 0, "seen": 0, "kept": 0,
          "deduplicated": 0, "partially_decoded": 0, "files_skipped": {}}


def _extract(o: Options, work: str) -> list[str]:
  """Pass 1. Returns the corpus chunk paths."""
  skipped: dict = {}
  if o.kind == "binary":
    try:
      files = [c.path for c in elf_corpus.list_inputs(o.inputs, o.max_input_bytes, skipped)]
    except InputError as e:
      raise PrepareError(str(e)) from None
    if not files:
      raise PrepareError(f"no ELF files found under {', '.join(o.inputs)}")
  else:
    try:
      files = text_corpus.check_inputs(o.inputs, o.max_input_bytes)
    except InputError as e:
      raise PrepareError(str(e)) from None

  done = _chunks(work)
  seen: set[bytes] = set()
  for path, _ in done:
    with open(path, encoding="utf-8") as f:
      seen.update(parse_corpus_line(line)[0] for line in f)
  stats = done[-1][1]["stats"] if done else _empty_stats()
  if not done:
    for k, v in skipped.items():
      stats["files_skipped"][k] = stats["files_skipped"].get(k, 0) + v
  start = done[-1][1]["next_file"] if done else 0
  if done and done[-1][1].get("last"):
    return [p for p, _ in done]

  index = len(done)
  tmpdir = os.path.join(work, "extract")
  os.makedirs(tmpdir, exist_ok=True)
  chunk_path = os.path.join(work, f"corpus-{index:05d}.txt")
  chunk = open(chunk_path + ".partial", "w", encoding="utf-8")
  sizes = [os.path.getsize(p) for p in files]
  tasks = [(i, (o.kind, files[i], part, _parts(o.kind, sizes[i]),
                 os.path.join(tmpdir, f"{i:06d}-{part:02d}.tsv"), o.txt_docs, o.text_field))
           for i in range(start, len(files)) for part in range(_parts(o.kind, sizes[i]))]
  bar = tqdm(total=sum(sizes), initial=sum(sizes[:start]), unit="B", unit_scale=True,
             desc="extract", disable=not o.progress)

  def close_chunk(next_file: int, last: bool) -> None:
    nonlocal chunk, chunk_path, index
    chunk.flush()
    os.fsync(chunk.fileno())
    chunk.close()
    os.replace(chunk_path + ".partial", chunk_path)
    dataset.atomic_write_json(chunk_path[:-4] + ".json",
                         {"next_file": next_file, "last": last, "stats": stats})
    index += 1
    chunk_path = os.path.join(work, f"corpus-{index:05d}.txt")
    if not last:
      chunk = open(chunk_path + ".partial", "w", encoding="utf-8")

  with _pool(o.workers) as pmap, _input_errors():
    for (i, args), (res, tmp) in zip(tasks, pmap(_extract_worker, [a for _, a in tasks])):
      part, parts = args[2], args[3]
      if part == 0:
        whole = FileResult(path=res.path, file_bytes=res.file_bytes)
      whole.functions += res.functions
      whole.code_bytes += res.code_bytes
      whole.partial += res.partial
      if res.skip and res.skip not in ("no_functions", "no_documents"):
        whole.skip = whole.skip or res.skip  # corrupt / other machine: said by every part
      with open(tmp, encoding="utf-8") as f:
        for line in f:
          digest, _ = parse_corpus_line(line)
          if digest in seen:
            stats["deduplicated"] += 1
            continue
          seen.add(digest)
          stats["kept"] += 1
          chunk.write(line)
      os.unlink(tmp)
      bar.update(res.file_bytes / parts)
      if part + 1 < parts:
        continue
      # The whole file is in: count it once.
      stats["input_files"] += 1
      skip = whole.skip or ("" if whole.functions else
                            "no_functions" if o.kind == "binary" else "no_documents")
      if skip:
        stats["files_skipped"][skip] = stats["files_skipped"].get(skip, 0) + 1
      if whole.functions:
        stats["input_bytes"] += whole.file_bytes
        stats["code_bytes"] += whole.code_bytes
        stats["seen"] += whole.functions
        stats["partially_decoded"] += whole.partial
      if chunk.tell() >= o.chunk_mb * (1 << 20) and i + 1 < len(files):
        close_chunk(i + 1, last=False)
  bar.close()
  close_chunk(len(files), last=True)
  shutil.rmtree(tmpdir, ignore_errors=True)
  if stats["kept"] == 0:
    what = "functions" if o.kind == "binary" else "documents"
    raise PrepareError(f"no {what} found in {', '.join(o.inputs)} "
                       f"(files skipped: {stats['files_skipped'] or 'none'})")
  return [p for p, _ in _chunks(work)]


def _iter_texts(chunks: list[str], limit_bytes: int) -> Iterator[str]:
  """About ``limit_bytes`` of corpus text: every k-th line, so the sample spans all inputs
  (the first bytes alone would be the alphabetically first libraries)."""
  total = sum(os.path.getsize(p) for p in chunks)
  stride = max(1, -(-total // max(1, limit_bytes)))
  i = 0
  for path in chunks:
    with open(path, encoding="utf-8") as f:
      for line in f:
        if i % stride == 0:
          yield parse_corpus_line(line)[1]
        i += 1


# ----------------------------------------------------------------------------- pass 2
def _tokenizer(o: Options, work: str, chunks: list[str]):
  path = os.path.join(work, dataset.TOKENIZER)
  if os.path.exists(path):
    return toklib.load(path)
  try:
    if o.tokenizer:
      tok = toklib.load(o.tokenizer)
    else:
      tok = toklib.train(_iter_texts(chunks, o.tokenizer_sample_mb << 20),
                         vocab_size=o.vocab_size, kind=o.kind, model=o.tokenizer_model,
                         lowercase=o.lowercase)
  except toklib.TokenizerError as e:
    raise PrepareError(str(e)) from None
  dataset.atomic_write_bytes(path, tok.to_str().encode())
  return tok


# ----------------------------------------------------------------------------- pass 3
_worker: dict = {}  # the tokenize worker's tokenizer and packing settings


class _PretokenIds(dict):
  """pretoken → its token ids, filled from the tokenizer on first sight of each pretoken.

  Binary code is already split into whitespace-separated pretokens and its tokenizer is
  WordPiece over those words, so a text's ids are the concatenation of its words' ids. A few
  thousand distinct pretokens make this memo ~10× faster than ``encode_batch`` (which pays for
  added-token matching and an Encoding object per text) with identical output (tested).
  """

  def __init__(self, tok):
    super().__init__()
    self.tok = tok

  def __missing__(self, word: str) -> tuple:
    ids = tuple(self.tok.encode(word, add_special_tokens=False).ids)
    self[word] = ids
    return ids

  def encode(self, text: str) -> np.ndarray:
    return np.fromiter(itertools.chain.from_iterable(map(self.__getitem__, text.split())),
                       np.uint16)


def _init_tokenize_worker(path: str, kind: str, seq_len: int, packing: str,
                          val_fraction: float) -> None:
  global _worker
  from tokenizers import Tokenizer

  tok = Tokenizer.from_file(path)
  if kind == "binary":
    memo = _PretokenIds(tok)
    encode = lambda texts: [memo.encode(t) for t in texts]  # noqa: E731
  else:
    encode = lambda texts: [  # noqa: E731
        np.asarray(e.ids, np.uint16) for e in tok.encode_batch(texts, add_special_tokens=False)]
  special = toklib.validate(tok, path)
  _worker = {"encode": encode, "seq_len": seq_len, "packing": packing,
             "val_fraction": val_fraction, "special": special}


def _tokenize_chunk(path: str) -> dict:
  """Pool task: a corpus chunk → per split, its packed sequences ([n, seq_len] uint16).

  Each chunk is packed on its own (its open sequences are flushed at its end) so packing runs
  in the workers, in parallel; the cost is at most a window of part-filled sequences per chunk.
  """
  w, sp = _worker, _worker["special"]
  packers = {s: Packer(w["seq_len"], sp["[CLS]"], sp["[SEP]"], sp["[PAD]"], w["packing"])
             for s in dataset.SPLITS}
  out = {s: {"seqs": [], "items": 0, "content_tokens": 0} for s in dataset.SPLITS}
  with open(path, encoding="utf-8") as f:
    while batch := [line for _, line in zip(range(TOKENIZE_BATCH), f)]:
      parsed = [parse_corpus_line(line) for line in batch]
      for (digest, _), ids in zip(parsed, w["encode"]([text for _, text in parsed])):
        split = _split_of(digest, w["val_fraction"])
        o = out[split]
        o["items"] += 1
        o["content_tokens"] += len(ids)
        o["seqs"].extend(packers[split].add(ids))
  for split, o in out.items():
    o["seqs"].extend(packers[split].flush())
    o["seqs"] = (np.stack(o["seqs"]) if o["seqs"] else
                 np.zeros((0, w["seq_len"]), np.uint16))
  return out


class _ShardSink:
  """Buffers one split's records into shards of a fixed record count, resumably."""

  def __init__(self, work: str, split: str, records_per_shard: int):
    self.dir = os.path.join(work, "shards")
    os.makedirs(self.dir, exist_ok=True)
    self.split, self.per = split, records_per_shard
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
      info = dataset.write_array_record(path, self.buf)
      dataset.atomic_write_json(side, info)
    self.shards.append(info)
    self.buf = []


def _split_of(digest: bytes, val_fraction: float) -> str:
  # digest-derived, so a function/document always lands in the same split on every run.
  key = int.from_bytes(digest[:8], "big")
  return "validation" if (key % 1_000_000) < val_fraction * 1_000_000 else "train"


def _write_shards(o: Options, work: str, chunks: list[str], tok) -> dict:
  special = toklib.validate(tok, "tokenizer")
  per = max(1, int(o.shard_size_mb * (1 << 20))
            // (len(dataset.record_prefix(o.seq_len)) + 2 * o.seq_len))
  sinks = {s: _ShardSink(work, s, per) for s in dataset.SPLITS}
  st = {s: {"sequences": 0, "tokens": 0, "content_tokens": 0, "unk": 0, "items": 0}
        for s in dataset.SPLITS}
  pad, unk = special["[PAD]"], special["[UNK]"]
  bar = tqdm(total=len(chunks), unit="chunk", desc="tokenize+pack", disable=not o.progress)
  init = (os.path.join(work, dataset.TOKENIZER), o.kind, o.seq_len, o.packing, o.val_fraction)
  with _pool(o.workers, _init_tokenize_worker, init) as pmap:
    for out in pmap(_tokenize_chunk, chunks):
      for split, r in out.items():
        s, seqs = st[split], r["seqs"]
        s["items"] += r["items"]
        s["content_tokens"] += r["content_tokens"]
        s["sequences"] += len(seqs)
        s["tokens"] += int(np.count_nonzero(seqs != pad))
        s["unk"] += int(np.count_nonzero(seqs == unk))
        for seq in seqs:
          sinks[split].add(seq)
      bar.update(1)
  bar.close()
  for split in dataset.SPLITS:
    sinks[split].flush()
  return {"splits": {s: sinks[s].shards for s in dataset.SPLITS}, "special": special, "stats": st,
          "vocab_size": tok.get_vocab_size(with_added_tokens=True)}


# ----------------------------------------------------------------------------- finalize
def _finalize(o: Options, work: str, result: dict, extract_stats: dict, t0: float,
              workers: int) -> dict:
  name = "binary_code" if o.kind == "binary" else "text_corpus"
  splits = {}
  for split, shards in result["splits"].items():
    infos = []
    for i, info in enumerate(shards):
      final = dataset.shard_filename(name, split, i, len(shards))
      src = os.path.join(work, "shards", f"{split}-{i:05d}.array_record")
      if os.path.exists(src):  # absent if an interrupted finalize already moved it
        os.replace(src, os.path.join(o.output, final))
      infos.append({"file": final, **info})
    splits[split] = infos
  shutil.copyfile(os.path.join(work, dataset.TOKENIZER), os.path.join(o.output, dataset.TOKENIZER))

  st, wall = result["stats"], time.time() - t0
  seqs = sum(s["sequences"] for s in st.values())
  tokens = sum(s["tokens"] for s in st.values())
  out_bytes = sum(x["bytes"] for v in splits.values() for x in v)
  unit = "functions" if o.kind == "binary" else "documents"
  measured = extract_stats["code_bytes"] if o.kind == "binary" else extract_stats["input_bytes"]
  val = st["validation"]
  stats = {
      "kind": o.kind, "packing": o.packing, "seq_len": o.seq_len,
      "vocab_size": result["vocab_size"],
      "input_files": extract_stats["input_files"],
      "input_bytes": extract_stats["input_bytes"],
      "output_bytes": out_bytes,
      "reduction_pct": round(100 * (1 - out_bytes / max(1, extract_stats["input_bytes"])), 3),
      f"{unit}_seen": extract_stats["seen"],
      f"{unit}_kept": extract_stats["kept"],
      f"{unit}_deduplicated": extract_stats["deduplicated"],
      f"{unit}_per_split": {s: v["items"] for s, v in st.items()},
      "sequences": {s: v["sequences"] for s, v in st.items()},
      "tokens": tokens,
      "content_tokens": sum(s["content_tokens"] for s in st.values()),
      "pad_fraction": round(1 - tokens / max(1, seqs * o.seq_len), 6),
      "unk_rate_validation": round(val["unk"] / max(1, val["content_tokens"]), 6),
      "unk_rate_train": round(st["train"]["unk"] / max(1, st["train"]["content_tokens"]), 6),
      "files_skipped": extract_stats["files_skipped"],
      "wall_seconds": round(wall, 2),
      "stage_seconds": result["stage_seconds"],  # of this run (a resume skips finished work)
      "workers": workers,
      "mb_per_s_per_core": round(measured / 1e6 / wall / workers, 3),
  }
  if o.kind == "binary":
    stats["code_bytes"] = extract_stats["code_bytes"]
    stats["functions_partially_decoded"] = extract_stats["partially_decoded"]
  dataset.atomic_write_json(os.path.join(o.output, dataset.STATS), stats)
  dataset.finalize(o.output, name=name, seq_len=o.seq_len, vocab_size=stats["vocab_size"],
              special_ids=result["special"], splits=splits,
              extra={"kind": o.kind, "packing": o.packing, "tokens": tokens})
  shutil.rmtree(work)
  return stats


def prepare(o: Options) -> dict:
  """Runs (or resumes) a preparation; returns the stats written to stats.json."""
  t0 = time.time()
  _check_options(o)
  workers = o.workers or os.cpu_count() or 1
  o = dataclasses.replace(o, workers=workers)
  resumed = _open_output(o)
  work = os.path.join(o.output, WORK)
  if resumed and o.progress:
    print(f"resuming the unfinished preparation in {o.output}")
  stages = {}
  t = time.time()
  chunks = _extract(o, work)
  extract_stats = _chunks(work)[-1][1]["stats"]
  stages["extract"], t = round(time.time() - t, 2), time.time()
  tok = _tokenizer(o, work, chunks)
  stages["tokenizer"], t = round(time.time() - t, 2), time.time()
  result = _write_shards(o, work, chunks, tok)
  stages["tokenize_pack_write"] = round(time.time() - t, 2)
  result["stage_seconds"] = stages
  return _finalize(o, work, result, extract_stats, t0, workers)
