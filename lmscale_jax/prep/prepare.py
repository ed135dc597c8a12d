"""Data preparation: corpus → tokenizer → packed uint16 ArrayRecord shards → dataset directory

Three passes, each resumable, over ``OUTPUT/_work/`` (removed when the dataset is complete):
  1. extract (``corpus_extract``, a process pool over input files, ordered): functions/documents
     → normalised text, exact duplicates dropped, in resumable corpus chunks.
  2. tokenizer (here): trained on a sample of ``tokenizer_sample_mb`` of the corpus (or given).
  3. tokenize → pack → shards (``shard_writer``, a process pool over chunks, ordered).
This module holds the output directory's life cycle (the options: ``prep/options.py``), pass 2
and the final
``stats.json``/``metadata.json``.
Every file appears under its final name only once complete (temp file, fsync, rename), and
``metadata.json`` is written last; a split without sequences is an error before anything is
moved into the output. The output directory never contains, lies in or is an input, and
``prepare_manifest.json`` (written before anything else) lists what this tool created there:
``--overwrite`` removes exactly that. A rerun resumes only work of the same options and the same
input files (path, size, mtime: ``params.json``); other input files start it afresh.
Output is byte-identical for any number of workers: pools are ordered and every decision depends
only on the input order.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
import time

from lmscale_jax import errors
from lmscale_jax.errors import PrepareError  # noqa: F401  (cli/args.py catches it from here)
from lmscale_jax.prep import corpus_extract, corpus_layout, shard_writer, worker_pool
from lmscale_jax.prep.options import PrepareOptions, check_options
from lmscale_jax.store import dataset, dir_lock, file_io
from lmscale_jax.store import tokenizer as toklib

WORK = "_work"
LOCK = ".prepare.lock"  # in the output directory, while a preparation writes there


def _inside(path: str, top: str) -> bool:
  return path != top and os.path.commonpath([path, top]) == top


def check_overlap(o: PrepareOptions) -> None:
  """The output directory is cleared and written: it must not hold, lie in or be an input."""
  out = os.path.realpath(o.output)
  named = [("--input", p) for p in o.inputs] + ([("--tokenizer", o.tokenizer)]
                                                if o.tokenizer else [])
  for flag, p in named:
    real = os.path.realpath(p)
    how = ("is" if out == real else "lies inside" if _inside(out, real) else
           "contains" if _inside(real, out) else "")
    if how:
      raise PrepareError(f"--output {o.output!r} {how} the {flag} {p!r}: the dataset directory "
                         "is cleared and written, so it must lie outside every input; choose "
                         "another --output")


# ----------------------------------------------------------------------------- the output dir
# The manifest lists every name this tool created in the output directory: --overwrite removes
# those and nothing else (a README or anything the user put there survives).
MANIFEST = "prepare_manifest.json"
TFDS_FILES = ("dataset_info.json", "features.json")
_SHARD_NAME = re.compile(r"(binary_code|text_corpus)-(train|validation)\.array_record-"
                         r"\d{5}-of-\d{5}")


def _ours_by_name(name: str) -> bool:
  """A name this tool writes (a dataset prepared before manifests existed has no manifest)."""
  return (name in (WORK, MANIFEST, dataset.METADATA, dataset.STATS, dataset.TOKENIZER,
                   toklib.TOKENIZER_CONFIG, toklib.SPECIAL_TOKENS_MAP,
                   *TFDS_FILES) or _SHARD_NAME.fullmatch(name) is not None)


def _manifest(out: str) -> list[str] | None:
  path = os.path.join(out, MANIFEST)
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      names = json.load(f)["files"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise PrepareError(f"{path}: not readable ({e}); remove the dataset's files yourself") \
        from None
  # Plain names only: a manifest is never a way to delete anything outside the directory.
  return [n for n in names if isinstance(n, str) and n not in ("", ".", "..") and "/" not in n]


def _write_manifest(out: str, names) -> None:
  file_io.atomic_write_json(os.path.join(out, MANIFEST),
                            {"tool": "lmscale_jax.prepare", "files": sorted(set(names))})


# The temp file of an atomic write killed half way (file_io.atomic_write_bytes): ".NAME.*.tmp".
_TEMP_NAME = re.compile(r"\.(.+)\.[^.]+\.tmp")


def _foreign(out: str, names: list[str]) -> list[str]:
  """The entries of ``out`` that no preparation wrote."""
  owned = _manifest(out)
  named = (lambda n: n in owned or n == MANIFEST) if owned is not None else _ours_by_name

  def ours(n: str) -> bool:
    m = _TEMP_NAME.fullmatch(n)
    return named(n) or (m is not None and named(m.group(1)))

  return sorted(n for n in names if not ours(n))


def _remove_stale_temps(out: str, ours: set[str]) -> None:
  """The temp files a killed run left half written beside our files (a finished dataset holds
  none: CI runs killed during the writes of stats.json and of the manifest kept one each)."""
  for n in os.listdir(out):
    m = _TEMP_NAME.fullmatch(n)
    if m is not None and (m.group(1) in ours or m.group(1) == MANIFEST):
      os.unlink(os.path.join(out, n))


def _clear_own(out: str, names: list[str]) -> None:
  """--overwrite: removes what earlier preparations wrote, the manifest last."""
  foreign = set(_foreign(out, names))
  if _manifest(out) is None and foreign:
    first = sorted(foreign)[0]
    more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
    raise PrepareError(f"output {out!r} holds {first!r}{more}, which no preparation wrote (it "
                       f"has no {MANIFEST}): --overwrite removes only a dataset's own files; "
                       "choose a new or empty --output")
  for name in sorted(n for n in names if n not in foreign and n != MANIFEST):
    p = os.path.join(out, name)
    shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
  if MANIFEST in names:
    os.unlink(os.path.join(out, MANIFEST))


def _resume_or_restart(o: PrepareOptions, params: dict) -> bool:
  """An unfinished preparation in the work dir: True to resume it; False when it was started
  on other input files (then its work is dropped: nothing of it is valid)."""
  work = os.path.join(o.output, WORK)
  with open(os.path.join(work, "params.json")) as f:
    old = json.load(f)
  if old == params:
    return True
  changed = sorted(k for k in set(old) | set(params) if old.get(k) != params.get(k))
  if changed != ["input_files"]:
    backend = (f" or set LMSCALE_PRETOKENIZER={'compiled' if old.get('pretokenizer') else 'python'}"
               " to resume it" if changed == ["pretokenizer"] else "")
    raise PrepareError(f"output {o.output!r} holds an unfinished preparation with other "
                       f"settings ({', '.join(changed)} differ); pass --overwrite to "
                       f"start over{backend}")
  was, now = old.get("input_files") or {}, params["input_files"]
  print(f"the input files changed since the unfinished preparation in {o.output} started "
        f"({now['count']} files of {now['bytes']:,} bytes, was {was.get('count')} of "
        f"{was.get('bytes', 0):,}): starting it afresh", file=sys.stderr)
  shutil.rmtree(work)
  return False


def _make_output(out: str) -> bool:
  """Creates the output directory if missing; True if this call created it."""
  if os.path.exists(out) and not os.path.isdir(out):
    raise PrepareError(f"output {out!r} exists and is not a directory")
  try:
    os.makedirs(out)
    return True
  except FileExistsError:
    return False
  except OSError as e:
    if errors.disk_full(e):
      raise
    raise PrepareError(f"output {out!r} is not writable: {e.strerror}") from None


@contextlib.contextmanager
def output_lock(out: str, *, shared: bool = False, doing: str = "a single-node preparation"):
  """Holds the output directory (``LOCK``, by ``store/dir_lock``) while a preparation writes
  it: two runs into one --output wrecked each other's ``_work/`` (the second died on the
  first's files; with --overwrite both did, and no dataset was left). Exclusive for a
  single-node run and for a cluster preparation's plan and finish, which make and remove the
  directory's top level; shared for the cluster's other stages, whose array tasks write
  disjoint units side by side by design: they never block each other, while a single-node run
  is refused a directory a cluster run is writing, and the reverse. The directory is created
  here if missing, and removed again if nothing else was written into it (a refused or failed
  run leaves nothing behind)."""
  if shared and not os.path.isdir(out):
    yield  # nothing to share: the stage says its plan is missing
    return
  created, path = _make_output(out), os.path.join(out, LOCK)
  try:
    fd = dir_lock.acquire(path, shared=shared, doing=doing)
  except dir_lock.Busy as e:
    holder = (e.record or {}).get("doing", "another preparation")
    fix = "" if shared else ", or choose another --output"
    raise PrepareError(f"output {out!r} is in use by {holder} ({e.holder}; lock {path}): wait "
                       f"for it to end or stop it{fix}") from None
  except dir_lock.Unusable as e:
    raise PrepareError(f"output {out!r}: cannot {e.step} {path} ({e.strerror}); use a "
                       "writable local or NFSv4 directory") from None
  try:
    yield
  finally:
    dir_lock.release(fd, remove="" if shared else path)  # shared: others may hold it still
    if created:
      with contextlib.suppress(OSError):  # not empty: something was written
        os.rmdir(out)


def open_output(o: PrepareOptions, params: dict) -> bool:
  """Creates/validates the output directory (held by :func:`output_lock`). Returns True when
  resuming an earlier run."""
  out, work = o.output, os.path.join(o.output, WORK)
  if os.path.exists(out) and not os.path.isdir(out):
    raise PrepareError(f"output {out!r} exists and is not a directory")
  # The lock is no file of a dataset (an exclusive holder removes it; a kill leaves it).
  names = [n for n in os.listdir(out) if n != LOCK] if os.path.isdir(out) else []
  if names and o.overwrite:
    _clear_own(out, names)
  elif os.path.exists(os.path.join(work, "params.json")):
    if _resume_or_restart(o, params):
      return True
  elif os.path.exists(os.path.join(out, dataset.METADATA)):
    raise PrepareError(f"output {out!r} already holds a complete dataset; pass --overwrite "
                       "to replace it")
  elif foreign := _foreign(out, names):
    raise PrepareError(f"output {out!r} is not empty: it holds {foreign[0]!r}, which no "
                       "preparation wrote; choose a new or empty --output")
  elif names and names != [MANIFEST]:
    raise PrepareError(f"output {out!r} holds the files of an earlier preparation but no "
                       "dataset; pass --overwrite to replace them")
  try:
    os.makedirs(out, exist_ok=True)
    # The manifest first: whatever happens next, --overwrite knows what is ours.
    _write_manifest(out, (_manifest(out) or []) + [WORK])
    os.makedirs(work, exist_ok=True)
    file_io.atomic_write_json(os.path.join(work, "params.json"), params)
  except OSError as e:
    if errors.disk_full(e):
      raise
    raise PrepareError(f"output {out!r} is not writable: {e.strerror}") from None
  return False


def pretokenizer_params(o: PrepareOptions) -> dict:
  """The compiled backend (prep/elf/_pretokens.c) writes capstone's text, which differs from the
  python backend's on ~0.005% of instructions: a run never resumes with the other one. Its
  absence means the python backend (every run before the compiled one existed). Called in the
  parent, before any task: a bad $LMSCALE_PRETOKENIZER is one line here, not in a worker."""
  if o.kind != "binary":
    return {}
  from lmscale_jax.prep.elf.pretokenize import code_pretokenizer

  pre = code_pretokenizer()
  return {"pretokenizer": f"compiled ({pre.decoder})"} if pre.backend == "compiled" else {}


def input_key(files: list[str]) -> dict:
  """What the reusable work depends on besides the options: each input's path, size, mtime."""
  entries = []
  for p in files:
    st = os.stat(p)
    entries.append([os.path.realpath(p), st.st_size, st.st_mtime_ns])
  digest = hashlib.sha256(json.dumps(entries).encode()).hexdigest()
  return {"count": len(entries), "bytes": sum(e[1] for e in entries), "sha256": digest}


# ----------------------------------------------------------------------------- pass 2
def _sample_counts(o: PrepareOptions, work: str, chunks: list[str], pmap) -> collections.Counter:
  """The binary tokenizer's pretoken counts of ``iter_texts``' sample, counted in the workers
  (the parent counted them alone: 0.67 s of a two-worker run's ~5 s, measured), one ~4 MB piece
  a task. Per piece, not in a few large groups: pass 3 waits for the last count, and with two
  groups a worker one took 0.40 s while the other's took 0.19 (two workers, 73 MB of code); the
  counts of small tasks cost no more (one process, 97 pieces: 0.72 s against 0.76 in 4 groups;
  a piece's counts are ~400 words since the counting is compiled)."""
  stride = corpus_layout.sample_stride(sum(os.path.getsize(p) for p in chunks),
                                       o.tokenizer_sample_mb << 20)
  ranges = shard_writer.piece_list(work, chunks)  # pass 3's tasks too: listed once
  starts = [0]
  for lines in pmap(corpus_extract.count_lines, ranges):
    starts.append(starts[-1] + lines)
  counts = collections.Counter()
  for c in pmap(corpus_extract.count_sample, [([r], starts[i], stride)
                                              for i, r in enumerate(ranges)]):
    counts.update(c)
  return counts


def _tokenizer(o: PrepareOptions, work: str, chunks: list[str], pmap):
  path = os.path.join(work, dataset.TOKENIZER)
  if os.path.exists(path):
    return toklib.load(path)
  try:
    if o.tokenizer:
      tok = toklib.load(o.tokenizer)
    elif o.kind == "binary":
      tok = toklib.from_pretoken_counts(_sample_counts(o, work, chunks, pmap), o.vocab_size)
    else:
      tok = toklib.train(corpus_extract.iter_texts(chunks, o.tokenizer_sample_mb << 20),
                         vocab_size=o.vocab_size, kind=o.kind, model=o.tokenizer_model,
                         lowercase=o.lowercase)
      check_trained_size(o, tok)
  except toklib.TokenizerError as e:
    raise PrepareError(str(e)) from None
  file_io.atomic_write_bytes(path, tok.to_str().encode())
  return tok


def check_trained_size(o: PrepareOptions, tok) -> None:
  """A trained text tokenizer holds at least the special tokens and its initial alphabet (the
  corpus's characters as WordPiece pieces; BPE's 256 bytes), whatever --vocab-size asks:
  --vocab-size 7 made a 55-token vocabulary without a word."""
  size = tok.get_vocab_size(with_added_tokens=True)
  if size > o.vocab_size:
    raise PrepareError(f"--vocab-size {o.vocab_size}: a {o.tokenizer_model} tokenizer of this "
                       f"corpus has at least {size} tokens ({len(dataset.SPECIAL_TOKENS)} special "
                       "tokens and its alphabet); rerun with --vocab-size "
                       f"{size} or more and --overwrite")


# ----------------------------------------------------------------------------- finalize
def _check_splits(o: PrepareOptions, work: str, result: dict) -> None:
  """A split without sequences is no dataset: say which one and what to change, before
  anything is moved into the output (nothing there may look complete). The work files go: no
  rerun could use them (another --val-fraction or input starts afresh), and "nothing was
  written" was said while they stayed."""
  unit = "functions" if o.kind == "binary" else "documents"
  st = result["stats"]
  items = sum(v["items"] for v in st.values())
  for split in dataset.SPLITS:
    if st[split]["sequences"] == 0:
      other = "smaller" if split == "train" else "larger"
      _remove_work(o.output, work)
      raise PrepareError(f"split {split!r} would have 0 sequences ({st[split]['items']} of "
                         f"{items} {unit} with --val-fraction {o.val_fraction:g}): give more "
                         f"input or a {other} --val-fraction; nothing was written to "
                         f"{o.output} (the work files were removed)")


def _remove_work(out: str, work: str) -> None:
  """``work`` and its name in the manifest (the manifest too, if it named nothing else)."""
  shutil.rmtree(work, ignore_errors=True)
  names = [n for n in _manifest(out) or [] if n != WORK]
  if names:
    _write_manifest(out, names)
  elif os.path.exists(os.path.join(out, MANIFEST)):
    os.unlink(os.path.join(out, MANIFEST))


def _move_into_place(o: PrepareOptions, work: str, name: str, result: dict) -> dict:
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
  # With the roles and files transformers' AutoTokenizer needs (tokenizer.with_hf_roles).
  toklib.write_hf_files(toklib.load(os.path.join(work, dataset.TOKENIZER)), o.output,
                        model_max_length=o.seq_len)
  return splits


def finalize(o: PrepareOptions, work: str, result: dict, extract_stats: dict, t0: float,
              workers: int) -> dict:
  name = "binary_code" if o.kind == "binary" else "text_corpus"
  _check_splits(o, work, result)
  before = set(os.listdir(o.output))
  ours = set(_manifest(o.output) or []) | {WORK, *toklib.HF_FILES, dataset.STATS,
                                           dataset.METADATA, *TFDS_FILES}
  ours |= {dataset.shard_filename(name, s, i, len(v))
           for s, v in result["splits"].items() for i in range(len(v))}
  _write_manifest(o.output, ours)  # before the files appear
  splits = _move_into_place(o, work, name, result)

  st, wall = result["stats"], time.time() - t0
  seqs = sum(s["sequences"] for s in st.values())
  tokens = sum(s["tokens"] for s in st.values())
  out_bytes = sum(x["bytes"] for v in splits.values() for x in v)
  unit = "functions" if o.kind == "binary" else "documents"
  measured = extract_stats["code_bytes"] if o.kind == "binary" else extract_stats["input_bytes"]
  val = st["validation"]
  stats = {
      "kind": o.kind, "packing": o.packing, "compression": o.compression, "seq_len": o.seq_len,
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
    stats["pretokenizer"] = pretokenizer_params(o).get("pretokenizer", "python (iced-x86)")
    stats["code_bytes"] = extract_stats["code_bytes"]
    stats["functions_partially_decoded"] = extract_stats["partially_decoded"]
  file_io.atomic_write_json(os.path.join(o.output, dataset.STATS), stats)
  dataset.finalize(o.output, name=name, seq_len=o.seq_len, vocab_size=stats["vocab_size"],
              special_ids=result["special"], splits=splits,
              extra={"kind": o.kind, "packing": o.packing, "tokens": tokens})
  _remove_stale_temps(o.output, ours)
  # Whatever else TFDS wrote is ours too.
  _write_manifest(o.output, ours | (set(os.listdir(o.output)) - before))
  shutil.rmtree(work)
  return stats


def _no_space(o: PrepareOptions, full: errors.DiskFull) -> str:
  where = os.path.dirname(full.filename) if full.filename else o.output
  try:
    free = f"{shutil.disk_usage(where).free:,} bytes free"
  except OSError:
    free = "free space unknown"
  return (f"no space left on the device of {where} ({free}): free space or choose another "
          "--output, then rerun the same command to resume")


def prepare(o: PrepareOptions) -> dict:
  """Runs (or resumes) a preparation; returns the stats written to stats.json."""
  try:
    return _prepare(o)
  except (OSError, RuntimeError, ValueError) as e:
    full = errors.disk_full(e)  # also the ArrayRecord writer's RuntimeError with the errno text
    if full is None:
      raise
    raise PrepareError(_no_space(o, full)) from None


# What the pool's tasks import and the libraries they load on first use: imported by each
# worker as it starts (0.2–0.3 s, measured), while this process imports TFDS.
WORKER_MODULES = {
    "common": ("lmscale_jax.prep.corpus_extract", "lmscale_jax.prep.packed_pieces",
               "tokenizers", "array_record.python.array_record_module"),
    "binary": ("elftools.elf.elffile", "capstone"),
}


def _open_run(o: PrepareOptions) -> tuple[list[str], dict]:
  """The input files (and those skipped), the output directory created or resumed."""
  files, skipped, notes = corpus_extract.list_files(o)
  for note in notes:
    print(note, file=sys.stderr)
  params = o.output_params()
  params["input_files"] = input_key(files)
  params.update(pretokenizer_params(o))
  if open_output(o, params) and o.progress:
    print(f"resuming the unfinished preparation in {o.output}")
  return files, skipped


def _prepare(o: PrepareOptions) -> dict:
  t0 = time.time()
  check_options(o)
  check_overlap(o)
  workers = worker_pool.usable_workers(o.workers)
  o = dataclasses.replace(o, workers=workers)
  work = os.path.join(o.output, WORK)
  # stage_seconds: each stage's seconds of work, in pass order; a worker stage is summed over
  # the workers (so with N busy workers the stages add up to ~N × the pass's wall time).
  stages = {"elf_parse": 0.0, "decode_pretokenize": 0.0, "extract_write": 0.0, "dedup": 0.0}
  # One process pool for every pass (spawning one per pass cost each its workers' start-up),
  # started before the inputs are listed: its workers start meanwhile (the listing and the
  # output directory were 0.06 s of a 3.3 s run, the other core idle).
  preload = WORKER_MODULES["common"] + WORKER_MODULES.get(o.kind, ())
  # finalize's TFDS: imported (~0.3 s) while the pool's workers start and take pass 1's first
  # tasks (ordered_map's imports_here), not at the end where it was serial (2 workers, 8 runs
  # each: 3.49 s mean against 3.58). In a thread during pass 3 it slowed this process's own
  # tasks more (the GIL; 2 workers, 6 runs each: 3.13 s mean against 3.01); in a process of its
  # own it cost the cores what it saved (3.55 s against 3.44, 8 runs each). The output's lock
  # before the pool: a refused run starts no process.
  with output_lock(o.output):
    with worker_pool.ordered_map(o.workers, preload=preload,
                                 imports_here=("tensorflow_datasets",)) as pmap:
      files, skipped = _open_run(o)
      chunks = corpus_extract.extract(o, work, files, skipped, stages, pmap)
      extract_stats = corpus_extract.chunks(work)[-1][1]["stats"]
      t = time.time()
      tok = _tokenizer(o, work, chunks, pmap)
      stages["tokenizer"] = time.time() - t
      result = shard_writer.write_shards(o, work, chunks, tok, pmap)
    stages.update(result["seconds"])
    result["stage_seconds"] = {k: round(v, 3) for k, v in stages.items()}
    return finalize(o, work, result, extract_stats, t0, workers)
