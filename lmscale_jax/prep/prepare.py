"""Data preparation: corpus → tokenizer → packed uint16 ArrayRecord shards → dataset directory

Three passes, each resumable, over ``OUTPUT/_work/`` (removed when the dataset is complete):
  1. extract (``corpus_extract``, a process pool over input files, ordered): functions/documents
     → normalised text, exact duplicates dropped, in resumable corpus chunks.
  2. tokenizer (here): trained on a sample of ``tokenizer_sample_mb`` of the corpus (or given).
  3. tokenize → pack → shards (``shard_writer``, a process pool over chunks, ordered).
This module holds pass 2 and the final ``stats.json``/``metadata.json`` (the options:
``prep/options.py``; the output directory's life cycle — what is ours, its lock, resume or
restart — ``prep/output_dir.py``).
Every file appears under its final name only once complete (temp file, fsync, rename), and
``metadata.json`` is written last; the finished dataset is built in ``_work/new/`` and swapped
into the output at the end (``prep/dataset_swap.py``), so a dataset already there stays
complete until the new one is; a split without sequences is an error before anything is moved
into the output. A rerun resumes only work of the same options and the same input files
(path, size, mtime: ``params.json``); other input files start it afresh.
Output is byte-identical for any number of workers: pools are ordered and every decision depends
only on the input order.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time

from lmscale_jax import errors
from lmscale_jax.errors import PrepareError  # noqa: F401  (cli/args.py catches it from here)
from lmscale_jax.prep import (corpus_extract, corpus_layout, dataset_swap, output_dir, shard_writer,
                              worker_pool)
from lmscale_jax.prep.options import PrepareOptions, check_options
from lmscale_jax.store import dataset, file_io
from lmscale_jax.store import tokenizer as toklib

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
      warn_small_vocabulary(o, tok)
    else:
      tok = toklib.train(corpus_extract.iter_texts(chunks, o.tokenizer_sample_mb << 20),
                         vocab_size=o.vocab_size, kind=o.kind, model=o.tokenizer_model,
                         lowercase=o.lowercase)
      check_trained_size(o, tok)
      warn_small_vocabulary(o, tok)
  except toklib.TokenizerError as e:
    raise PrepareError(str(e)) from None
  file_io.atomic_write_bytes(path, tok.to_str().encode())
  return tok


def warn_small_vocabulary(o: PrepareOptions, tok) -> None:
  """One line on stderr where the trained vocabulary is smaller than --vocab-size asked for
  (--vocab-size 4096 silently gave 563): the dataset and every model trained on it have the
  smaller size. Binary code's vocabulary is every instruction word seen twice, so it is all
  the corpus has (1,058 tokens from 24 MB of libraries, 1,208 from 64 MB); text's trainer stops
  for a small corpus. The default is a ceiling, not a request: nothing to say."""
  size = tok.get_vocab_size(with_added_tokens=True)
  if size >= o.vocab_size or not o.vocab_size_given:
    return
  why = ("every instruction word the corpus has twice or more, and every character, is one "
         "already: a larger --vocab-size adds nothing" if o.kind == "binary" else
         "too few distinct pieces in its tokenizer sample, up to --tokenizer-sample-mb "
         f"{o.tokenizer_sample_mb}: a small corpus")
  print(f"warning: --vocab-size {o.vocab_size}: the corpus gave only {size} tokens ({why}); "
        f"the dataset's vocab_size is {size}", file=sys.stderr, flush=True)


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
      output_dir.remove_work(o.output, work)
      kept = (f"; the dataset already in {o.output} is kept as it was"
              if os.path.exists(os.path.join(o.output, dataset.METADATA)) else "")
      raise PrepareError(f"split {split!r} would have 0 sequences ({st[split]['items']} of "
                         f"{items} {unit} with --val-fraction {o.val_fraction:g}): give more "
                         f"input or a {other} --val-fraction; nothing was written to "
                         f"{o.output} (the work files were removed){kept}")


def _move_into_place(o: PrepareOptions, work: str, new: str, name: str, result: dict) -> dict:
  """The shards and tokenizer files under their final names in ``new``."""
  splits = {}
  for split, shards in result["splits"].items():
    infos = []
    for i, info in enumerate(shards):
      final = dataset.shard_filename(name, split, i, len(shards))
      src = os.path.join(work, "shards", f"{split}-{i:05d}.array_record")
      if os.path.exists(src):  # absent if an interrupted finalize already moved it
        os.replace(src, os.path.join(new, final))
      infos.append({"file": final, **info})
    splits[split] = infos
  # With the roles and files transformers' AutoTokenizer needs (tokenizer.with_hf_roles).
  toklib.write_hf_files(toklib.load(os.path.join(work, dataset.TOKENIZER)), new,
                        model_max_length=o.seq_len)
  return splits


def finalize(o: PrepareOptions, work: str, result: dict, extract_stats: dict, t0: float,
              workers: int) -> dict:
  """The dataset's files, built complete in ``_work/new`` and then swapped into the output
  (``prep/dataset_swap.py``: a dataset already there stays until this one is complete)."""
  name = "binary_code" if o.kind == "binary" else "text_corpus"
  _check_splits(o, work, result)
  new = dataset_swap.new_dir(work)
  splits = _move_into_place(o, work, new, name, result)

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
  file_io.atomic_write_json(os.path.join(new, dataset.STATS), stats)
  dataset.finalize(new, name=name, seq_len=o.seq_len, vocab_size=stats["vocab_size"],
                   special_ids=result["special"], splits=splits,
                   extra={"kind": o.kind, "packing": o.packing, "tokens": tokens})
  dataset_swap.swap_in(o.output, work)  # whatever else TFDS wrote in new/ is ours too
  return stats


def _no_space(o: PrepareOptions, full: errors.DiskFull) -> str:
  where = os.path.dirname(full.filename) if full.filename else o.output
  try:
    free = f"{shutil.disk_usage(where).free:,} bytes free"
  except OSError:
    free = "free space unknown"
  both = (f"; --overwrite keeps the dataset already in {o.output} until the new one is "
          "complete, so both need room" if o.overwrite else "")
  return (f"no space left on the device of {where} ({free}): free space or choose another "
          f"--output, then rerun the same command to resume{both}")


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


def _open_run(o: PrepareOptions) -> tuple[list[str], dict] | None:
  """The input files (and those skipped), the output directory created or resumed; None when
  this very run (its settings and input files) was killed during its final swap, which is
  completed here: the dataset is done."""
  files, skipped, notes = corpus_extract.list_files(o)
  for note in notes:
    print(note, file=sys.stderr)
  params = o.output_params()
  params["input_files"] = input_key(files)
  params.update(pretokenizer_params(o))
  if dataset_swap.complete_interrupted(o.output) == params:
    return None
  if output_dir.open_output(o, params) and o.progress:
    print(f"resuming the unfinished preparation in {o.output}")
  return files, skipped


def _prepare(o: PrepareOptions) -> dict:
  t0 = time.time()
  check_options(o)
  output_dir.check_overlap(o)
  workers = worker_pool.usable_workers(o.workers)
  o = dataclasses.replace(o, workers=workers)
  work = os.path.join(o.output, output_dir.WORK)
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
  with output_dir.output_lock(o.output):
    with worker_pool.ordered_map(o.workers, preload=preload,
                                 imports_here=("tensorflow_datasets",)) as pmap:
      if (opened := _open_run(o)) is None:
        with open(os.path.join(o.output, dataset.STATS)) as f:
          return json.load(f)
      files, skipped = opened
      chunks = corpus_extract.extract(o, work, files, skipped, stages, pmap)
      extract_stats = corpus_extract.chunks(work)[-1][1]["stats"]
      t = time.time()
      tok = _tokenizer(o, work, chunks, pmap)
      stages["tokenizer"] = time.time() - t
      result = shard_writer.write_shards(o, work, chunks, tok, pmap)
    stages.update(result["seconds"])
    result["stage_seconds"] = {k: round(v, 3) for k, v in stages.items()}
    return finalize(o, work, result, extract_stats, t0, workers)
