"""Data preparation as stages of Slurm job arrays (``lmscale prepare cluster``,
``launch/prepare.sbatch``): the same output, byte for byte, as ``prepare.prepare`` on one node.

  plan     one task: checks, lists the inputs, fixes the extraction tasks and their slices
  extract  array over slices: each input part → its functions' lines (the process pool inside),
           with each line's digest into one of ``buckets`` hash partitions
  dedup    array over buckets: the first occurrence (in input order) of each digest wins
  layout   one task: the kept lines' chunks and pieces (``corpus_layout``), the extraction
           stats, ONE tokenizer from the slices' pretoken counts, merged
  pack     array over pieces: tokenize + pack (``packed_pieces.pack_piece``)
  shards   array over shards: cut from the pieces by prefix sums (``packed_pieces.write_shard``)
  finish   one task: the tokenizer files, stats.json, metadata.json (``prepare.finalize``),
           swapped into the output (``dataset_swap``: plan's --overwrite keeps the old
           dataset usable until here)

An array task takes a contiguous share of its stage's units (slices, buckets, pieces, shards),
so every array can have any size. A unit is done when its marker exists (written last, by atomic
rename); a rerun of any stage redoes only units without one, and a stage whose inputs are not all
done says which and stops. Everything lives in ``OUTPUT/_work`` (``output_dir.WORK``), which
single-node runs refuse to resume (``params.json`` says ``engine: slurm-array``).
"""

from __future__ import annotations

import collections
import functools
import os
import time

import numpy as np

from lmscale_jax.errors import PrepareError
from lmscale_jax.prep import (corpus_extract, corpus_layout, dataset_swap, packed_pieces, packing,
                              prepare, shard_writer, tokenize_pack, worker_pool)
from lmscale_jax.prep.cluster_extract import (held, load_plan, missing, read_json, save_npy,
                                              share, slice_file, work_dir, work_path)
from lmscale_jax.prep.elf.elf_corpus import FileResult
from lmscale_jax.prep.options import PrepareOptions
from lmscale_jax.store import dataset, file_io
from lmscale_jax.store import tokenizer as toklib

STAGES = ("plan", "extract", "dedup", "layout", "pack", "shards", "finish")
LAYOUT = "layout.json"


# ----------------------------------------------------------------------------- layout
def _keep_masks(work: str, p: dict, lengths: list[np.ndarray]) -> list[np.ndarray]:
  """Each slice's lines, True where kept: every bucket's dropped (slice, line) pairs unset."""
  keep = [np.ones(len(x), bool) for x in lengths]
  for b in range(p["buckets"]):
    dropped = np.load(work_path(work, "dedup", f"{b:05d}.npy"))
    where = dropped >> 32
    for k in np.unique(where).tolist():
      keep[k][dropped[where == k] & 0xFFFFFFFF] = False
  return keep


def _extract_stats(p: dict, o: PrepareOptions, slice_results: list[list[dict]], keep, lengths):
  """The stats single-node pass 1 keeps, and each input file's kept lines and bytes."""
  stats = corpus_extract.empty_stats()
  for reason, n in p["skipped"].items():
    stats["files_skipped"][reason] = stats["files_skipped"].get(reason, 0) + n
  file_lines, file_bytes = np.zeros(len(p["files"]), np.int64), np.zeros(len(p["files"]), np.int64)
  whole = None
  for k, results in enumerate(slice_results):
    at = 0
    for t, r in enumerate(results, p["slices"][k][0]):
      r = dict(r)
      lines, repeats = r.pop("lines"), r.pop("repeats")
      i, part, parts = p["tasks"][t]
      kept = keep[k][at:at + lines]
      n_kept = int(kept.sum())
      file_lines[i] += n_kept
      file_bytes[i] += int(lengths[k][at:at + lines][kept].sum())
      at += lines
      stats["kept"] += n_kept
      stats["deduplicated"] += repeats + lines - n_kept
      whole = corpus_extract.add_part(whole, FileResult(**r), part)
      if part + 1 == parts:
        corpus_extract.count_file(stats, whole, o.kind)
  return stats, file_lines, file_bytes


def layout(output: str, workers: int) -> dict:
  with held(output, "layout"):
    return _layout(output, workers)


def _layout(output: str, workers: int) -> dict:
  p, o = load_plan(output)
  work = work_dir(output)
  if os.path.exists(work_path(work, LAYOUT)):
    print("layout: done already")
    return read_json(work_path(work, LAYOUT))
  t0 = time.time()
  missing("layout", [work_path(work, "dedup", f"{b:05d}.npy") for b in range(p["buckets"])],
          "dedup")
  slices = range(len(p["slices"]))
  sides = [read_json(slice_file(work, k, ".json")) for k in slices]
  results = [side["tasks"] for side in sides]
  lengths = [np.load(slice_file(work, k, ".len.npy")) for k in slices]
  keep = _keep_masks(work, p, lengths)
  for k in slices:
    save_npy(slice_file(work, k, ".keep.npy"), keep[k])
  stats, file_lines, file_bytes = _extract_stats(p, o, results, keep, lengths)
  if stats["kept"] == 0:
    what = "functions" if o.kind == "binary" else "documents"
    raise PrepareError(f"no {what} found in {', '.join(o.inputs)} "
                       f"(files skipped: {stats['files_skipped'] or 'none'})")
  kept_lengths = np.concatenate([x[m] for x, m in zip(lengths, keep)]).astype(np.int64)
  ends = np.cumsum(kept_lengths)
  pieces = []
  for start, end in corpus_layout.chunk_lines(file_lines, file_bytes, o.chunk_mb * (1 << 20)):
    base = int(ends[start - 1]) if start else 0
    at = start
    for n in corpus_layout.piece_lines(ends[start:end] - base, shard_writer.PIECE_BYTES):
      pieces.append((at, start + n))
      at = start + n
  kept_at = np.concatenate([[0], np.cumsum([int(m.sum()) for m in keep])]).tolist()
  t = time.time()
  _tokenizer(work, o, kept_at, int(ends[-1]), workers)
  seconds = {s: sum(r["seconds"].get(s, 0.0) for rs in results for r in rs)
             for s in ("elf_parse", "decode_pretokenize", "extract_write", "dedup")}
  seconds["tokenizer"] = time.time() - t
  out = {"pieces": pieces, "kept_at": kept_at, "extract_stats": stats, "seconds": seconds,
         "extract_workers": max(side["workers"] for side in sides)}
  file_io.atomic_write_json(work_path(work, LAYOUT), out)
  print(f"layout: {stats['kept']:,} lines kept, {len(pieces)} pieces, in {time.time() - t0:.1f} s")
  return out


def _sampled_texts(work: str, k: int, kept_at: list[int], stride: int) -> list[str]:
  """The tokenizer sample's lines of slice ``k``: global kept line index ≡ 0 (mod stride)."""
  first = (-kept_at[k]) % stride
  return [corpus_extract.parse_corpus_line(line)[1]
          for line in _kept_lines(work, kept_at, kept_at[k] + first, kept_at[k + 1], stride)]


def _count_slice(args) -> collections.Counter:
  return toklib.count_pretokens(_sampled_texts(*args), packing.token_ids_module())


def _tokenizer(work: str, o: PrepareOptions, kept_at: list[int], total: int, workers: int) -> None:
  path = work_path(work, dataset.TOKENIZER)
  stride = corpus_layout.sample_stride(total, o.tokenizer_sample_mb << 20)
  try:
    if o.tokenizer:
      tok = toklib.load(o.tokenizer)
    elif o.kind == "binary":  # each slice's counts (in the pool), merged: one tokenizer
      counts = collections.Counter()
      with worker_pool.ordered_map(workers) as pmap:
        for c in pmap(_count_slice, [(work, k, kept_at, stride)
                                     for k in range(len(kept_at) - 1)]):
          counts.update(c)
      tok = toklib.from_pretoken_counts(counts, o.vocab_size)
      prepare.warn_small_vocabulary(o, tok)
    else:
      texts = (t for k in range(len(kept_at) - 1) for t in _sampled_texts(work, k, kept_at, stride))
      tok = toklib.train(texts, vocab_size=o.vocab_size, kind=o.kind, model=o.tokenizer_model,
                         lowercase=o.lowercase)
      prepare.check_trained_size(o, tok)
      prepare.warn_small_vocabulary(o, tok)
  except toklib.TokenizerError as e:
    raise PrepareError(str(e)) from None
  file_io.atomic_write_bytes(path, tok.to_str().encode())


# ----------------------------------------------------------------------------- reading lines
@functools.lru_cache(maxsize=8)
def _slice_index(work: str, k: int) -> tuple[np.ndarray, np.ndarray]:
  """Slice ``k``'s kept lines: their byte offsets in its text file, and lengths."""
  lengths = np.load(slice_file(work, k, ".len.npy")).astype(np.int64)
  keep = np.load(slice_file(work, k, ".keep.npy"))
  starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
  return starts[keep], lengths[keep]


def _kept_lines(work: str, kept_at: list[int], g0: int, g1: int, step: int = 1):
  """The kept lines with global index in ``range(g0, g1, step)``, in order."""
  for k in range(len(kept_at) - 1):
    lo, hi = max(g0, kept_at[k]), min(g1, kept_at[k + 1])
    if lo >= hi:
      continue
    lo += (g0 - lo) % step
    starts, lengths = _slice_index(work, k)
    idx = np.arange(lo - kept_at[k], hi - kept_at[k], step)
    if not len(idx):
      continue
    with open(slice_file(work, k, ".txt"), "rb") as f:
      if step == 1:  # one read for the whole range (a piece)
        f.seek(int(starts[idx[0]]))
        buf = f.read(int(starts[idx[-1]] + lengths[idx[-1]] - starts[idx[0]]))
        base = int(starts[idx[0]])
        for s, n in zip((starts[idx] - base).tolist(), lengths[idx].tolist()):
          yield buf[s:s + n].decode("utf-8")
      else:
        for s, n in zip(starts[idx].tolist(), lengths[idx].tolist()):
          f.seek(s)
          yield f.read(n).decode("utf-8")


@functools.lru_cache(maxsize=4)
def _kept_at(work: str) -> list[int]:
  return read_json(work_path(work, LAYOUT))["kept_at"]


def _piece_batches(work: str, g0: int, g1: int):
  """Pool task input: a piece's lines in batches of ``tokenize_pack.TOKENIZE_BATCH``."""
  batch = []
  for line in _kept_lines(work, _kept_at(work), g0, g1):
    batch.append(line)
    if len(batch) == tokenize_pack.TOKENIZE_BATCH:
      yield batch
      batch = []
  if batch:
    yield batch


# ----------------------------------------------------------------------------- pack, shards
def _load_layout(output: str, stage: str) -> tuple[dict, PrepareOptions, dict]:
  p, o = load_plan(output)
  path = work_path(work_dir(output), LAYOUT)
  missing(stage, [path], "layout")
  return p, o, read_json(path)


def pack(output: str, task: int, tasks: int, workers: int) -> None:
  with held(output, "pack"):
    _pack(output, task, tasks, workers)


def _pack(output: str, task: int, tasks: int, workers: int) -> None:
  _, o, lay = _load_layout(output, "pack")
  work = work_dir(output)
  mine = share(len(lay["pieces"]), task, tasks)
  os.makedirs(work_path(work, packed_pieces.PIECES), exist_ok=True)
  init = (work_path(work, dataset.TOKENIZER), o.kind, o.seq_len, o.packing, o.val_fraction)
  if not mine:
    print(f"pack: task {task} of {tasks} has no piece ({len(lay['pieces'])} in all)")
    return
  todo = [(packed_pieces.piece_base(work, i), _piece_batches, (work, *lay["pieces"][i]), init)
          for i in mine]
  t0 = time.time()
  with worker_pool.ordered_map(workers) as pmap:
    done = sum(1 for info in pmap(packed_pieces.pack_piece, todo) if info["seconds"])
  print(f"pack: pieces {mine.start}..{mine.stop - 1}: {done} packed, {len(todo) - done} done "
        f"already, in {time.time() - t0:.1f} s")


def _piece_counts(output: str, stage: str) -> tuple[dict, PrepareOptions, dict, list[dict]]:
  p, o, lay = _load_layout(output, stage)
  work = work_dir(output)
  bases = [packed_pieces.piece_base(work, i) for i in range(len(lay["pieces"]))]
  missing(stage, [b + ".json" for b in bases], "pack")
  return p, o, lay, [packed_pieces.done_piece(b) for b in bases]


def _shard_tasks(output: str, o: PrepareOptions, counts: list[dict]) -> list[tuple]:
  return packed_pieces.shard_tasks(work_dir(output), counts,
                                   packed_pieces.records_per_shard(o.seq_len, o.shard_size_mb),
                                   o.compression)


def shards(output: str, task: int, tasks: int, workers: int) -> None:
  with held(output, "shards"):
    _shards(output, task, tasks, workers)


def _shards(output: str, task: int, tasks: int, workers: int) -> None:
  _, o, _, counts = _piece_counts(output, "shards")
  all_tasks = _shard_tasks(output, o, counts)
  mine = share(len(all_tasks), task, tasks)
  if not mine:
    print(f"shards: task {task} of {tasks} has no shard ({len(all_tasks)} in all)")
    return
  t0 = time.time()
  with worker_pool.ordered_map(workers) as pmap:
    done = sum(1 for info in pmap(packed_pieces.write_shard, [all_tasks[i] for i in mine])
               if "seconds" in info)
  print(f"shards: {mine.start}..{mine.stop - 1}: {done} written, {len(mine) - done} done "
        f"already, in {time.time() - t0:.1f} s")


def finish(output: str) -> dict:
  with held(output, "finish"):
    # A finish killed during its swap (prep/dataset_swap.py): completed, whatever of _work/
    # (the plan included) its removal had taken.
    if dataset_swap.complete_interrupted(output) is not None:
      return read_json(os.path.join(output, dataset.STATS))
    return _finish(output)


def _finish(output: str) -> dict:
  p, o, lay, counts = _piece_counts(output, "finish")
  work = work_dir(output)
  tasks = _shard_tasks(output, o, counts)
  missing("finish", [base + ".json" for _, base, _, _ in tasks], "shards")
  infos = [read_json(base + ".json") for _, base, _, _ in tasks]
  seconds = dict(lay["seconds"])
  for c in counts:
    packed_pieces.add_seconds(seconds, c["seconds"])
  for info in infos:  # every shards task's, whichever run of the array wrote it
    packed_pieces.add_seconds(seconds, {"write": info.pop("seconds", 0.0)})
  tok = toklib.load(work_path(work, dataset.TOKENIZER))
  result = packed_pieces.result(counts, tasks, infos, toklib.validate(tok, "tokenizer"),
                                tok.get_vocab_size(with_added_tokens=True), seconds)
  result["stage_seconds"] = {k: round(v, 3) for k, v in seconds.items()}
  return prepare.finalize(o, work, result, lay["extract_stats"], p["started"],
                           lay["extract_workers"])


def status(output: str) -> list[str]:
  """One line per stage: how many of its units are done."""
  p, _ = load_plan(output)
  work = work_dir(output)
  lines = [f"plan: {len(p['files'])} input files, {len(p['tasks'])} extraction tasks in "
           f"{len(p['slices'])} slices, {p['buckets']} buckets"]
  n = sum(os.path.exists(slice_file(work, k, ".json")) for k in range(len(p["slices"])))
  lines.append(f"extract: {n} of {len(p['slices'])} slices done")
  n = sum(os.path.exists(work_path(work, "dedup", f"{b:05d}.npy"))
          for b in range(p["buckets"]))
  lines.append(f"dedup: {n} of {p['buckets']} buckets done")
  if not os.path.exists(work_path(work, LAYOUT)):
    lines.append("layout: not done")
    return lines
  lay = read_json(work_path(work, LAYOUT))
  bases = [packed_pieces.piece_base(work, i) for i in range(len(lay["pieces"]))]
  n = sum(os.path.exists(b + ".json") for b in bases)
  lines += ["layout: done", f"pack: {n} of {len(bases)} pieces done"]
  if n < len(bases):
    return lines + ["shards: waiting for pack"]
  _, o, _, counts = _piece_counts(output, "status")
  tasks = _shard_tasks(output, o, counts)
  n = sum(os.path.exists(base + ".json") for _, base, _, _ in tasks)
  return lines + [f"shards: {n} of {len(tasks)} shards done"]
