"""Building a function index (format: :mod:`index_files`): every named function of each ELF
file, extracted and normalised as preparation does (``prep/elf/elf_functions``), embedded as
``lmscale embed`` embeds it (``inference/function_vectors``), L2-normalised so that a dot
product is the cosine.

Incremental: a binary whose sha256 index.json already holds is skipped. Resumable: index.json is
rewritten after each binary, so a rerun after a crash continues with the binary in flight.
Self-repairing: a rerun checks every shard index.json names (``index_files.damage``) and
rebuilds each missing or damaged one from its binary (an --elf file of its sha256, else the
path index.json recorded), keeping the intact ones. The
index belongs to one model: its identity (``inference/model_identity``) is kept and checked.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from lmscale_jax.errors import UserError
from lmscale_jax.inference import function_vectors, model_identity, trained_model
from lmscale_jax.prep.elf import elf_corpus, elf_functions
from lmscale_jax.search import index_files, vector_search
from lmscale_jax.store import file_io


def check_model(doc: dict, given: dict, index_dir: str) -> None:
  """An index is used only with the model that built it: one line naming both."""
  if not model_identity.same(doc["model"], given):
    raise index_files.IndexFileError(
        f"{os.path.join(index_dir, index_files.INDEX)}: built by "
        f"{model_identity.describe(doc['model'])}, not by the model given, "
        f"{model_identity.describe(given)}; give that model or another index")


def function_sizes(path: str) -> dict[int, int]:
  """address → size in bytes of the sized function symbols (elf_functions reads the same)."""
  from elftools.elf.elffile import ELFFile

  with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
    shdrs = elf_corpus.section_headers(ELFFile(fh), data)
    return {a: int(s) for a, (s, _) in elf_corpus.function_symbols(shdrs, data).items()}


class Skipped(UserError):
  """A file lmscale index passes over, counted under ``reason`` (preparation's name for it:
  ``prep/elf/elf_corpus.input_skip``, ``header_skip``, ``no_functions``, ``corrupt``) unless
  --strict; its message is the one line --strict stops at."""

  def __init__(self, path: str, reason: str, why: str):
    super().__init__(f"{path}: {why}")
    self.path, self.reason = path, reason


# What each reason is, in the words of the line that names a file skipped for it.
_WHY = {"broken_link": "a link to nothing", "not_regular": "not a regular file (a FIFO, device "
        "or socket)", "unreadable": "not readable (permissions)",
        "not_elf": "not an ELF file (the index takes x86-64 ELF binaries)",
        "abi=x32": "an x32 (ELF32) file; the model reads x86-64 ELF64 code",
        "no_functions": "no named x86-64 functions (no function symbol and no .eh_frame entry "
        "of one: data alone, or stripped without unwind tables); the index needs functions"}


def skip(path: str, reason: str, detail: str = "") -> Skipped:
  why = (f"machine {reason.removeprefix('machine=')}; the model reads x86-64 code"
         if reason.startswith("machine=") else _WHY.get(reason) or f"unreadable ELF file "
         f"({detail})")
  return Skipped(path, reason, why)


def check_elf(path: str) -> None:
  """Raises :class:`Skipped` for what preparation skips on a file's first bytes and its ELF
  header (not an ELF file, another machine, …): every input is checked before anything is
  written, so with --strict a wrong file in a list of thousands is one line at the start, not
  after hours of embedding."""
  from elftools.common.exceptions import ELFError
  from elftools.elf.elffile import ELFFile

  reason = elf_corpus.input_skip(path)
  if reason:
    raise skip(path, reason)
  try:
    with open(path, "rb") as fh:
      reason = elf_corpus.header_skip(ELFFile(fh))
  except (ELFError, ValueError, IndexError, KeyError, OSError) as e:
    raise skip(path, "corrupt", file_io.error_reason(e)) from None
  if reason:
    raise skip(path, reason)


def elf_functions_of(path: str) -> list:
  """The named functions of an x86-64 ELF file; none is one line (:class:`Skipped`)."""
  fns = elf_functions.functions(path)
  if not fns:
    raise skip(path, "no_functions")
  return fns


def text_digest(text: str) -> str:
  """A function's normalised text → the hex of preparation's digest of it
  (``elf_corpus.function_digest``, by which prepare finds a function it already holds): two
  functions whose texts are the same have the same vector, and the same digest."""
  return elf_corpus.function_digest(text).hex()


def embed_texts(model, named_texts: list[tuple[str, str]]) -> tuple[np.ndarray, list]:
  """(name, text) pairs → (L2-normalised float32 vectors [n, dim], (ids, cut) per text)."""
  encoded = [trained_model.encode(model, text) for _, text in named_texts]
  inputs = [(name, "", ids, cut) for (name, _), (ids, cut) in zip(named_texts, encoded)]
  vectors = function_vectors.embed(model, inputs)["embeddings"]
  norms = np.linalg.norm(vectors, axis=1, keepdims=True)
  return (vectors / np.maximum(norms, 1e-12)).astype(np.float32), encoded


def binary_shard(model, path: str) -> tuple[np.ndarray, list[dict]]:
  """One binary's vectors and per-function rows."""
  try:
    fns = elf_functions_of(path)
  except Skipped:
    raise
  except elf_functions.NoFunctionsFound as e:  # stripped, and no .eh_frame to find them by
    raise Skipped(path, "no_functions", str(e).removeprefix(f"{path}: ")) from None
  except UserError as e:  # its header passed check_elf; its tables do not parse
    raise Skipped(path, "corrupt", str(e).removeprefix(f"{path}: ")) from None
  sizes = function_sizes(path)
  vectors, encoded = embed_texts(model, [(f.name, f.text) for f in fns])
  rows = [{"name": f.name, "address": f.address, "bytes": sizes.get(f.address, 0),
           "instructions": len(f.instructions), "tokens": len(ids) - 2, "cut": bool(cut),
           index_files.TEXT_DIGEST: text_digest(f.text)}
          for f, (ids, cut) in zip(fns, encoded)]
  return vectors, rows


def add_binary(model, index_dir: str, path: str, digest: str) -> dict:
  """Embeds one binary into its shard files → its index.json entry (the one place an entry is
  made: a one-node build and an array task write the same)."""
  vectors, rows = binary_shard(model, path)
  stem = index_files.shard_stem(digest)
  digests = index_files.write_shard(index_dir, stem, vectors, rows)
  return {"path": os.path.abspath(path), "sha256": digest, "size": os.path.getsize(path),
          "functions": len(rows), "shard": stem, **digests}


def model_dim(model) -> int:
  return int(model.head["projection"]["kernel"].shape[-1]) if model.head else model.cfg.hidden


def open_index(index_dir: str, model) -> dict:
  """index.json for ``model``: the existing one (checked: the same model; its shards are
  checked by :func:`damaged`), or a new one (not yet written)."""
  ident = model_identity.identity(model)
  doc = index_files.read(index_dir)
  if doc is None:
    return index_files.new(ident, function_vectors.resolve_pool(model, None), model_dim(model))
  check_model(doc, ident, index_dir)
  return doc


def damaged(index_dir: str, doc: dict) -> list[tuple[int, str]]:
  """(position in index.json, what is wrong) of each binary whose shard is missing or
  damaged (every shard file hashed, at the ~290 MB/s of sha256 measured for the inputs:
  about 10 s for 1M functions at dim 768, small beside embedding them)."""
  found = [(j, index_files.damage(index_dir, b, doc["dim"])) for j, b in
           enumerate(doc["binaries"])]
  return [(j, why) for j, why in found if why]


def checked(elf_paths: list[str], skipped: list | None = None) -> list[str | None]:
  """The sha256 of each of ``elf_paths``, None for a file skipped: every input is checked
  (:func:`check_elf`) first; a file that fails is appended to ``skipped`` once (as preparation
  counts files: a link and its target are one file), or, ``skipped`` None (--strict), raised."""
  shas: list[str | None] = []
  passed: set[str] = set()  # the real paths of the files skipped
  for path in elf_paths:
    real = os.path.realpath(path)
    if real in passed:  # said once, for its first path
      shas.append(None)
      continue
    try:
      check_elf(path)
      shas.append(file_io.sha256_file(path))
    except Skipped as e:
      if skipped is None:
        raise
      passed.add(real)
      skipped.append(e)
      shas.append(None)
  return shas


def first_of_each(shas: list[str | None]) -> dict[str, int]:
  """sha256 → the position of the first of :func:`checked`'s ``shas`` with it."""
  first: dict[str, int] = {}
  for i, digest in enumerate(shas):
    if digest is not None:
      first.setdefault(digest, i)
  return first


def to_add(elf_paths: list[str], doc: dict, first: dict) -> list[tuple[int, str]]:
  """(position in ``elf_paths``, sha256) of the binaries to embed, in order: the first path of
  each sha256 (``first``: :func:`first_of_each`) that ``doc`` does not hold yet."""
  have = {b["sha256"] for b in doc["binaries"]}
  return [(i, digest) for digest, i in first.items() if digest not in have]


def counts(skipped: list[Skipped]) -> dict[str, int]:
  """{reason: files}, as preparation's files_skipped counts them."""
  out: dict[str, int] = {}
  for e in skipped:
    out[e.reason] = out.get(e.reason, 0) + 1
  return dict(sorted(out.items()))


def tell_skipped(e: Skipped, say) -> None:
  say(f"skipped {e} (files_skipped.{e.reason})")


def embedded_or_skipped(model, index_dir: str, path: str, digest: str, skipped: list | None,
                        say) -> dict | None:
  """:func:`add_binary`'s entry, or None where the file is skipped (no functions, tables that
  do not parse: found only as it is read), appended to ``skipped`` (None: raised)."""
  try:
    return add_binary(model, index_dir, path, digest)
  except Skipped as e:
    if skipped is None:
      raise
    skipped.append(e)
    tell_skipped(e, say)
    return None


def repair_source(binary: dict, elf_paths: list[str], first: dict[str, int], why: str) -> str:
  """The file a damaged shard is rebuilt from: an input of its sha256, else the path
  index.json recorded if it still has that sha256; neither is one line, before any writing."""
  if binary["sha256"] in first:
    return elf_paths[first[binary["sha256"]]]
  path = binary["path"]
  if os.path.isfile(path) and file_io.sha256_file(path) == binary["sha256"]:
    return path
  state = "changed" if os.path.exists(path) else "gone"
  raise UserError(f"{why}, and its binary {path} is {state}: give that binary (sha256 "
                  f"{binary['sha256'][:12]}…) with --elf to rebuild the shard")


def build(model, elf_paths: list[str], index_dir: str, say=print, strict: bool = False) -> dict:
  """Rebuilds the damaged shards of the index at ``index_dir`` (created if needed), then adds
  the binaries of ``elf_paths`` not yet in it. Returns {"added": [paths], "rebuilt": [paths],
  "skipped": [paths already indexed], "functions": functions embedded, "files_skipped":
  {reason: files}, "skipped_files": {path: reason}}. A file preparation would skip (not x86-64
  ELF, no named function, …) is skipped and counted, or with ``strict`` refused: before
  anything is written where its header shows it, else (no function) there, the binaries before
  it kept (the error says how many)."""
  doc = open_index(index_dir, model)
  passed: list[Skipped] | None = None if strict else []
  shas = checked(elf_paths, passed)  # every input checked before anything is written
  for e in passed or ():
    tell_skipped(e, say)
  first = first_of_each(shas)
  repairs = [(j, repair_source(doc["binaries"][j], elf_paths, first, why), why)
             for j, why in damaged(index_dir, doc)]
  todo = to_add(elf_paths, doc, first)
  os.makedirs(index_dir, exist_ok=True)
  index_files.clear_partial(index_dir)
  rebuilt = [repair(model, index_dir, doc, j, path, why, say) for j, path, why in repairs]
  added, count = [], 0
  for i, digest in todo:
    entry = kept_so_far(lambda: embedded_or_skipped(model, index_dir, elf_paths[i], digest,
                                                    passed, say), added, index_dir)
    if entry is None:
      shas = [None if d == digest else d for d in shas]  # its other paths: skipped with it
      continue
    doc["binaries"].append(entry)
    index_files.write(index_dir, doc)  # the binary is in the index from here on
    added.append(i)
    count += entry["functions"]
    say(f"indexed {entry['functions']} functions of {elf_paths[i]}")
  done = set(added) | {first.get(doc["binaries"][j]["sha256"]) for j, _, _ in repairs}
  return {"added": [elf_paths[i] for i in added], "functions": count, "rebuilt": rebuilt,
          "skipped": [p for i, p in enumerate(elf_paths) if i not in done and shas[i]],
          "files_skipped": counts(passed or []),
          "skipped_files": {e.path: e.reason for e in passed or ()}}


def repair(model, index_dir: str, doc: dict, j: int, path: str, why: str, say) -> str:
  """Re-embeds binary ``j`` of ``doc`` from ``path`` into its shard (the same name) and
  rewrites index.json with its new entry (the same but for its path and, where the vectors
  came out other bits, their digests) → ``path``."""
  old = doc["binaries"][j]
  doc["binaries"][j] = add_binary(model, index_dir, path, old["sha256"])
  index_files.write(index_dir, doc)
  say(f"rebuilt {old['shard']} from {path}: {why}")
  return path


def kept_so_far(step, added: list, index_dir: str):
  """``step()``; its one-line error says what was kept: nothing is lost by a bad binary."""
  try:
    return step()
  except UserError as e:
    if not added:
      raise
    raise UserError(f"{e} ({len(added)} binaries before it are in {index_dir}; rerun without it "
                    "to add the rest)") from None


def prepare_search(index_dir: str, say=print) -> None:
  """The approximate-search graph (search/vector_search.py) built and kept now where the index
  is over vector_search's exact size: lmscale index (or its array's finish) pays for it once,
  so a later lmscale search finds it instead of searching exactly."""
  doc = index_files.read(index_dir)
  functions = sum(b["functions"] for b in doc["binaries"]) if doc else 0
  if functions <= vector_search.EXACT_MAX:
    return
  vectors = np.concatenate([index_files.read_shard(index_dir, b, doc["dim"])[0]
                            for b in doc["binaries"]])
  searcher = vector_search.Searcher(vectors, exact_max=vector_search.EXACT_MAX,
                                    cache_dir=index_dir, build=True)
  if searcher.approximate:
    say(f"{index_dir}: search graph of {functions} functions kept (recall@10 "
        f"{searcher.recall:.3f} on its own rows)")
  else:  # a graph short of the target is kept but not used (vector_search.Searcher._use)
    say(f"{index_dir}: search graph of {functions} functions reached recall@10 "
        f"{searcher.graph_recall:.3f} < {searcher.recall_target}; lmscale search stays exact")
