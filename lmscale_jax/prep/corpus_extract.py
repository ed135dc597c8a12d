"""Pass 1 of data preparation: input files → functions/documents as normalised text, exact
duplicates dropped (by digest, first occurrence wins), appended to ``corpus-NNNNN.txt`` chunks
in the work directory. A chunk is complete when its ``.json`` sidecar exists; a rerun rebuilds
the duplicate set from complete chunks and continues with the next input file."""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import os
import shutil
import time
from typing import Iterator

import numpy as np

from lmscale_jax.errors import PrepareError
from lmscale_jax import progress
from lmscale_jax.prep import corpus_layout, packing, text_corpus
from lmscale_jax.prep.elf import elf_corpus
from lmscale_jax.prep.elf.elf_corpus import FileResult, InputError
from lmscale_jax.prep.options import PrepareOptions
from lmscale_jax.store import file_io
from lmscale_jax.store import tokenizer as toklib


@contextlib.contextmanager
def input_errors():
  """A bad input found inside a worker (e.g. a malformed .jsonl line) becomes one clear error."""
  try:
    yield
  except InputError as e:
    raise PrepareError(str(e)) from None


PART_BYTES = 8 << 20  # ELF files larger than this are split over several tasks


def file_parts(kind: str, size: int) -> int:
  # Depends only on the file size, so the task list (and the output) is the same for any
  # number of workers; big libraries (libLLVM: 110 MB) no longer serialize the whole pool.
  return 1 if kind != "binary" else max(1, min(64, -(-size // PART_BYTES)))


# Whole input files smaller than this go to the pool together, consecutive ones until a task
# holds about this many bytes. Most inputs are small (136 of /usr's first 159 ELF files are under
# 256 KB: 1–5 ms tasks), and a spawned worker finishing a task that short often found none
# queued for it yet (the parent's threads that feed it wait for the GIL: up to 5 ms each).
BATCH_BYTES = 1 << 20  # ≤ PART_BYTES: a split file's parts are never batched


def batches(tasks: list[tuple[int, tuple]], sizes) -> list[list[tuple]]:
  """Pass 1's pool tasks from ``tasks`` ((file number, extract_worker's arguments), in input
  order) and ``sizes`` (bytes by file number): consecutive small whole files batched
  (BATCH_BYTES), each larger file a task of its own, and so each part of a split one (larger
  than PART_BYTES). They depend only on the file sizes, as the output does."""
  out, batch, held = [], [], 0
  for i, args in tasks:
    if sizes[i] >= BATCH_BYTES:
      out += [batch] if batch else []
      out.append([args])
      batch, held = [], 0
      continue
    batch.append(args)
    held += sizes[i]
    if held >= BATCH_BYTES:
      out.append(batch)
      batch, held = [], 0
  return out + ([batch] if batch else [])


def extract_files(batch: list[tuple]) -> list[tuple[FileResult, dict]]:
  """Pool task: :func:`extract_worker` for each file (part) of a batch, in order."""
  return [extract_worker(args) for args in batch]


# The corpus line format between the passes (extraction writes, tokenization reads):
# "<the function's/document's 16-byte digest as 32 hex digits>\t<its text>\n". The text has
# no newline or tab of its own (pretokens are space-separated).
def format_corpus_line(digest: bytes, text: str) -> str:
  return f"{digest.hex()}\t{text}\n"


TEXT_AT = 33  # where a line's text starts: after its digest's 32 hex digits and the tab


def parse_corpus_line(line: str) -> tuple[bytes, str]:
  """-> (digest, text): the inverse of :func:`format_corpus_line`."""
  digest_hex, text = line[:-1].split("\t", 1)
  return bytes.fromhex(digest_hex), text


# Function bytes → (digest, bytes decoded) of what this process extracted in this run
# (elf_corpus.iter_functions' ``repeats``); emptied when a run starts (in-process worker).
REPEATS: dict = {}


def extract_worker(args) -> tuple[FileResult, dict]:
  """Pool task: one part of an input file → its lines streamed to a temp file (bounded memory),
  with each line's byte length and digest (the duplicate check's input, done here in the worker
  rather than by parsing every line again in the parent)."""
  kind, path, part, parts, tmp, txt_docs, text_field, functions = args
  t0 = time.perf_counter()
  res = FileResult(path=path, file_bytes=os.path.getsize(path))
  it = (elf_corpus.iter_functions(path, res, part, parts, REPEATS, functions) if kind == "binary"
        else text_corpus.iter_documents(path, res, txt_docs, text_field))
  lengths, digests, repeats = [], [], 0
  with open(tmp, "wb") as f:
    for digest, text in it:
      if text is None:  # a function whose bytes this process already sent in this run
        repeats += 1
        continue
      line = format_corpus_line(digest, text).encode()
      f.write(line)
      lengths.append(len(line))
      digests.append(digest)
  # What iter_functions did not time itself: the lines to the temp file (text input: all of it).
  res.seconds["extract_write"] = time.perf_counter() - t0 - sum(res.seconds.values())
  return res, {"txt": tmp, "lengths": lengths, "digests": b"".join(digests), "repeats": repeats}


def chunks(work: str) -> list[tuple[str, dict]]:
  out, i = [], 0
  while os.path.exists(side := os.path.join(work, f"corpus-{i:05d}.json")):
    with open(side) as f:
      out.append((os.path.join(work, f"corpus-{i:05d}.txt"), json.load(f)))
    i += 1
  return out


def empty_stats() -> dict:
  return {"input_files": 0, "input_bytes": 0, "code_bytes": 0, "seen": 0, "kept": 0,
          "deduplicated": 0, "partially_decoded": 0, "files_skipped": {}}


def list_files(o: PrepareOptions) -> tuple[list[str], dict, list[str]]:
  """The input files pass 1 reads, in order: (files, skip counts, notes for the user)."""
  skipped: dict = {}
  notes: list[str] = []
  try:
    if o.kind == "binary":
      files = [c.path for c in
               elf_corpus.list_inputs(o.inputs, o.max_input_bytes, skipped, notes)]
    else:
      files = text_corpus.check_inputs(o.inputs, o.max_input_bytes, skipped, notes)
  except InputError as e:
    raise PrepareError(str(e)) from None
  if not files:
    raise PrepareError(f"no ELF files found under {', '.join(o.inputs)} "
                       f"(files skipped: {skipped or 'none'})")
  return files, skipped, notes


def _resume(work: str, skipped: dict) -> tuple[list, set, dict, int]:
  """What earlier runs finished: (complete chunks, digests already kept, stats, next file).
  After the last chunk, no digests: pass 3 removes each chunk once its pieces are packed."""
  done = chunks(work)
  seen: set[bytes] = set()
  for path, _ in ([] if done and done[-1][1].get("last") else done):
    with open(path, encoding="utf-8") as f:
      seen.update(parse_corpus_line(line)[0] for line in f)
  stats = done[-1][1]["stats"] if done else empty_stats()
  if not done:
    for k, v in skipped.items():
      stats["files_skipped"][k] = stats["files_skipped"].get(k, 0) + v
  return done, seen, stats, done[-1][1]["next_file"] if done else 0


class _ChunkWriter:
  """``corpus-NNNNN.txt`` files, each written as ``.partial`` and renamed once complete, with
  its ``.json`` (the next input file and the stats so far: where a rerun resumes)."""

  def __init__(self, work: str, index: int, stats: dict):
    self.work, self.index, self.stats = work, index, stats
    self._open()

  def _open(self) -> None:
    self.path = os.path.join(self.work, f"corpus-{self.index:05d}.txt")
    self.file = open(self.path + ".partial", "wb")

  def close(self, next_file: int, last: bool) -> None:
    self.file.flush()
    os.fsync(self.file.fileno())
    self.file.close()
    os.replace(self.path + ".partial", self.path)
    file_io.atomic_write_json(self.path[:-4] + ".json",
                              {"next_file": next_file, "last": last, "stats": self.stats})
    self.index += 1
    if not last:
      self._open()


def add_part(whole: FileResult | None, res: FileResult, part: int) -> FileResult:
  """The file's result so far, with one more part (of a file split over workers) added."""
  if part == 0:
    whole = FileResult(path=res.path, file_bytes=res.file_bytes)
  whole.functions += res.functions
  whole.code_bytes += res.code_bytes
  whole.partial += res.partial
  if res.skip and res.skip not in ("no_functions", "no_documents"):
    whole.skip = whole.skip or res.skip  # corrupt / other machine: said by every part
  return whole


def _dedup(out: dict, seen: set, stats: dict, chunk) -> None:
  """A worker's lines into ``chunk``, each function or document once (first occurrence kept),
  by their digests; when all are new (the common case) by set operations and one file copy."""
  blob = out["digests"]
  digests = [blob[j:j + 16] for j in range(0, len(blob), 16)]
  stats["deduplicated"] += out["repeats"]
  if seen.isdisjoint(digests) and len(set(digests)) == len(digests):
    keep = None
    seen.update(digests)
    kept = len(digests)
  else:
    keep = []
    for d in digests:
      keep.append(d not in seen)
      seen.add(d)
    kept = sum(keep)
  stats["kept"] += kept
  stats["deduplicated"] += len(digests) - kept
  with open(out["txt"], "rb") as f:
    if keep is None:
      shutil.copyfileobj(f, chunk, 1 << 20)
    else:  # the runs of kept lines, by their byte offsets (a loop over lines took 0.2 s of 6)
      data = f.read()
      ends = np.cumsum(np.asarray(out["lengths"], np.int64))
      edges = np.flatnonzero(np.diff(np.concatenate([[0], np.asarray(keep, np.int8), [0]])))
      for a, b in zip(edges[0::2].tolist(), edges[1::2].tolist()):
        chunk.write(data[ends[a] - out["lengths"][a]:ends[b - 1]])
  os.unlink(out["txt"])


def count_file(stats: dict, whole: FileResult, kind: str) -> None:
  """A whole input file's counts (once, after its last part)."""
  stats["input_files"] += 1
  skip = whole.skip or ("" if whole.functions else
                        "no_functions" if kind == "binary" else "no_documents")
  if skip:
    stats["files_skipped"][skip] = stats["files_skipped"].get(skip, 0) + 1
  if whole.functions:
    stats["input_bytes"] += whole.file_bytes
    stats["code_bytes"] += whole.code_bytes
    stats["seen"] += whole.functions
    stats["partially_decoded"] += whole.partial


def extract(o: PrepareOptions, work: str, files: list[str], skipped: dict, seconds: dict,
            pmap) -> list[str]:
  """Pass 1 over ``files`` (from :func:`list_files`) on ``pmap`` (``worker_pool.ordered_map``'s).
  Returns the corpus chunk paths.

  ``seconds`` gets each stage's seconds added: the workers' (summed over workers) and
  ``dedup`` (this process: the duplicate check and the chunk writes)."""
  done, seen, stats, start = _resume(work, skipped)
  if done and done[-1][1].get("last"):
    return [p for p, _ in done]
  REPEATS.clear()  # what an in-process worker of an earlier run remembered is not seen here
  tmpdir = os.path.join(work, "extract")
  os.makedirs(tmpdir, exist_ok=True)
  writer = _ChunkWriter(work, len(done), stats)
  sizes = [os.path.getsize(p) for p in files]
  tasks = [(i, (o.kind, files[i], part, file_parts(o.kind, sizes[i]),
                 os.path.join(tmpdir, f"{i:06d}-{part:02d}.tsv"), o.txt_docs, o.text_field,
                 o.functions))
           for i in range(start, len(files)) for part in range(file_parts(o.kind, sizes[i]))]
  bar = progress.bar(o.progress, total=sum(sizes), initial=sum(sizes[:start]), unit="B",
                     unit_scale=True, desc="extract")
  whole = None
  with input_errors():
    results = progress.clocked_from_first(
        itertools.chain.from_iterable(pmap(extract_files, batches(tasks, sizes))), bar)
    for (i, args), (res, out) in zip(tasks, results):
      t0 = time.perf_counter()
      for stage, s in res.seconds.items():
        seconds[stage] = seconds.get(stage, 0.0) + s
      part, parts = args[2], args[3]
      whole = add_part(whole, res, part)
      _dedup(out, seen, stats, writer.file)
      seconds["dedup"] = seconds.get("dedup", 0.0) + time.perf_counter() - t0
      bar.update(res.file_bytes / parts)
      if part + 1 < parts:
        continue
      count_file(stats, whole, o.kind)
      if writer.file.tell() >= o.chunk_mb * (1 << 20) and i + 1 < len(files):
        writer.close(i + 1, last=False)
  bar.close()
  if stats["kept"] == 0:
    # Before the last chunk is marked complete: an empty extraction must never look finished
    # to a rerun (which would then train a tokenizer on nothing).
    writer.file.close()
    what = "functions" if o.kind == "binary" else "documents"
    raise PrepareError(f"no {what} found in {', '.join(o.inputs)} "
                       f"(files skipped: {stats['files_skipped'] or 'none'})")
  writer.close(len(files), last=True)
  shutil.rmtree(tmpdir, ignore_errors=True)
  return [p for p, _ in chunks(work)]


def iter_texts(chunks: list[str], limit_bytes: int) -> Iterator[str]:
  """About ``limit_bytes`` of corpus text: every k-th line, so the sample spans all inputs
  (the first bytes alone would be the alphabetically first libraries)."""
  stride = corpus_layout.sample_stride(sum(os.path.getsize(p) for p in chunks), limit_bytes)
  i = 0
  for path in chunks:
    with open(path, encoding="utf-8") as f:
      for line in f:
        if i % stride == 0:
          yield parse_corpus_line(line)[1]
        i += 1


def _read_range(path: str, start: int, end: int) -> bytes:
  with open(path, "rb") as f:
    f.seek(start)
    return f.read(end - start)


def count_lines(piece: tuple[str, int, int]) -> int:
  """Pool task: the lines of a piece ``(chunk, start, end)`` of a corpus chunk (whole lines)."""
  # numpy's compare-and-count, not bytes.count: 0.47 ms against 2.24 for 4 MB (measured).
  return int(np.count_nonzero(np.frombuffer(_read_range(*piece), np.uint8) == ord("\n")))


def count_sample(args) -> collections.Counter:
  """Pool task ``(pieces, index of their first line in the corpus, stride)``: the pretoken
  counts (``tokenizer.count_pretokens``) of the pieces' lines in the tokenizer sample of
  :func:`iter_texts`; the counts of consecutive groups of pieces add up to the whole sample's."""
  pieces, first, stride = args

  def texts():
    at = first
    for piece in pieces:
      # split("\n"), not splitlines(): a document's text may hold other line separators
      lines = _read_range(*piece).decode("utf-8").split("\n")[:-1]
      yield from (lines[i][TEXT_AT:] for i in range((-at) % stride, len(lines), stride))
      at += len(lines)

  return toklib.count_pretokens(texts(), packing.token_ids_module())

