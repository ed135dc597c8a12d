"""The first stages of a cluster preparation (``cluster_stages`` has the plan of all of them):
plan (one task), extract (array over slices), dedup (array over hash buckets), and the paths and
helpers every stage shares."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
import sys
import time

import numpy as np

from lmscale_jax.errors import PrepareError
from lmscale_jax.prep import (corpus_extract, corpus_layout, output_dir, packed_pieces, prepare,
                              worker_pool)
from lmscale_jax.prep.options import PrepareOptions, check_options
from lmscale_jax.store import file_io

ENGINE = "slurm-array"
PLAN = "plan.json"
_BUCKET = np.dtype([("digest", "V16"), ("line", "<u4")])


def work_dir(output: str) -> str:
  return os.path.join(output, output_dir.WORK)


def work_path(work: str, *parts: str) -> str:
  return os.path.join(work, *parts)


def read_json(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def save_npy(path: str, array: np.ndarray) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  packed_pieces.save_npy(path, array)


def held(output: str, stage: str):
  """The output directory's lock for a stage (``output_dir.output_lock``): shared by the array
  tasks and the layout job, which write disjoint units side by side and must never block each
  other; exclusive for plan and finish, which make and remove the directory's top level as a
  single-node run does (a stray task of an earlier chain still running refuses them)."""
  return output_dir.output_lock(output, shared=stage not in ("plan", "finish"),
                                doing=f"a cluster preparation's {stage} stage")


def share(units: int, task: int, tasks: int) -> range:
  """Array task ``task`` of ``tasks``: its contiguous share of ``units``."""
  if not 0 <= task < tasks:
    raise PrepareError(f"--task {task}: expected 0..{tasks - 1} (of --tasks {tasks})")
  return range(units * task // tasks, units * (task + 1) // tasks)


# ----------------------------------------------------------------------------- plan
def plan(o: PrepareOptions, slices: int, buckets: int) -> dict:
  """Opens the output as ``prepare.prepare`` does and writes ``plan.json`` once; a rerun with
  the same options keeps the existing plan (its slices and buckets are fixed)."""
  check_options(o)
  output_dir.check_overlap(o)
  with held(o.output, "plan"):
    return _plan(o, slices, buckets)


def _plan(o: PrepareOptions, slices: int, buckets: int) -> dict:
  files, skipped, notes = corpus_extract.list_files(o)
  for note in notes:
    print(note, file=sys.stderr)
  params = o.output_params()
  params["input_files"] = prepare.input_key(files)
  params.update(prepare.pretokenizer_params(o))
  params["engine"] = ENGINE
  output_dir.open_output(o, params)
  path = work_path(work_dir(o.output), PLAN)
  if os.path.exists(path):
    p = read_json(path)
    if (len(p["slices"]), p["buckets"]) != (min(slices, len(p["tasks"])), buckets):
      print(f"plan: keeping the existing plan of {len(p['slices'])} slices and {p['buckets']} "
            f"buckets (work already done depends on them)", file=sys.stderr)
    return p
  sizes = [os.path.getsize(p) for p in files]
  parts = [corpus_extract.file_parts(o.kind, size) for size in sizes]
  tasks = [(i, part, parts[i]) for i in range(len(files)) for part in range(parts[i])]
  # Absolute paths: the array tasks may start elsewhere than the plan did.
  options = {**dataclasses.asdict(o), "overwrite": False, "progress": False,
             "output": os.path.abspath(o.output), "inputs": [os.path.abspath(x) for x in o.inputs]}
  p = {"options": options, "files": [os.path.abspath(f) for f in files], "skipped": skipped,
       "tasks": tasks,
       "slices": corpus_layout.balanced_ranges([sizes[i] / n for i, _, n in tasks], slices),
       "buckets": buckets, "started": time.time()}
  file_io.atomic_write_json(path, p)
  return p


def load_plan(output: str) -> tuple[dict, PrepareOptions]:
  path = work_path(work_dir(output), PLAN)
  if not os.path.exists(path):
    raise PrepareError(f"{path}: no plan; run the plan stage first (lmscale prepare cluster "
                       f"plan --input … --output {output})")
  p = read_json(path)
  # A plan written before --functions read symbols only: its slices keep doing so.
  return p, PrepareOptions(**{"functions": "symbols", **p["options"]})


# ----------------------------------------------------------------------------- extract
def slice_file(work: str, k: int, ext: str) -> str:
  return work_path(work, "extract", f"slice-{k:05d}{ext}")


def _bucket_file(work: str, b: int, k: int) -> str:
  return work_path(work, "buckets", f"{b:05d}", f"slice-{k:05d}.npy")


def extract(output: str, task: int, tasks: int, workers: int) -> None:
  with held(output, "extract"):
    p, o = load_plan(output)
    for k in share(len(p["slices"]), task, tasks):
      _extract_slice(work_dir(output), p, o, k, workers)


def _extract_slice(work: str, p: dict, o: PrepareOptions, k: int, workers: int) -> None:
  if os.path.exists(slice_file(work, k, ".json")):
    print(f"extract: slice {k} done already")
    return
  t0 = time.time()
  tmpdir = slice_file(work, k, ".tmp")
  shutil.rmtree(tmpdir, ignore_errors=True)
  os.makedirs(tmpdir)
  first, end = p["slices"][k]
  files = p["files"]
  tasks = [(i, (o.kind, files[i], part, parts, os.path.join(tmpdir, f"{t:06d}.tsv"), o.txt_docs,
                o.text_field, o.functions)) for t, (i, part, parts) in enumerate(p["tasks"][first:end], first)]
  sizes = {i: os.path.getsize(files[i]) for i, _ in tasks}
  lengths, digests, results = [], [], []
  corpus_extract.REPEATS.clear()
  with worker_pool.ordered_map(workers) as pmap, corpus_extract.input_errors(), \
      open(slice_file(work, k, ".txt.partial"), "wb") as txt:
    for res, out in itertools.chain.from_iterable(
        pmap(corpus_extract.extract_files, corpus_extract.batches(tasks, sizes))):
      with open(out["txt"], "rb") as f:
        shutil.copyfileobj(f, txt, 1 << 20)
      os.unlink(out["txt"])
      lengths += out["lengths"]
      digests.append(out["digests"])
      results.append({**dataclasses.asdict(res), "lines": len(out["lengths"]),
                      "repeats": out["repeats"]})
    txt.flush()
    os.fsync(txt.fileno())
  os.replace(slice_file(work, k, ".txt.partial"), slice_file(work, k, ".txt"))
  save_npy(slice_file(work, k, ".len.npy"), np.asarray(lengths, np.uint32))
  _write_buckets(work, k, b"".join(digests), p["buckets"])
  shutil.rmtree(tmpdir, ignore_errors=True)
  file_io.atomic_write_json(slice_file(work, k, ".json"),
                            {"tasks": results, "workers": workers, "seconds": time.time() - t0})
  print(f"extract: slice {k} done: {len(lengths):,} lines in {time.time() - t0:.1f} s")


def _bucket_of(digests: np.ndarray, buckets: int) -> np.ndarray:
  raw = digests.view(np.uint8).reshape(-1, 16)
  return (raw[:, 0].astype(np.int64) << 8 | raw[:, 1]) % buckets


def _write_buckets(work: str, k: int, digests: bytes, buckets: int) -> None:
  """Each line's (digest, line in the slice) into its digest's hash partition, in line order."""
  keys = np.frombuffer(digests, "V16")
  which = _bucket_of(keys, buckets)
  for b in range(buckets):
    lines = np.flatnonzero(which == b)
    rows = np.empty(len(lines), _BUCKET)
    rows["digest"], rows["line"] = keys[lines], lines
    save_npy(_bucket_file(work, b, k), rows)


# ----------------------------------------------------------------------------- dedup
def missing(what: str, paths: list[str], rerun: str) -> None:
  gone = [p for p in paths if not os.path.exists(p)]
  if gone:
    more = f" (and {len(gone) - 1} more)" if len(gone) > 1 else ""
    raise PrepareError(f"{what}: {gone[0]} is missing{more}; rerun the {rerun} stage first "
                       "(it redoes only what is missing)")


def dedup(output: str, task: int, tasks: int) -> None:
  with held(output, "dedup"):
    _dedup(output, task, tasks)


def _dedup(output: str, task: int, tasks: int) -> None:
  p, _ = load_plan(output)
  work, slices = work_dir(output), len(p["slices"])
  missing("dedup", [slice_file(work, k, ".json") for k in range(slices)], "extract")
  for b in share(p["buckets"], task, tasks):
    path = work_path(work, "dedup", f"{b:05d}.npy")
    if os.path.exists(path):
      print(f"dedup: bucket {b} done already")
      continue
    parts = [np.load(_bucket_file(work, b, k)) for k in range(slices)]
    rows = np.concatenate(parts) if parts else np.empty(0, _BUCKET)
    where = np.repeat(np.arange(slices, dtype=np.int64), [len(x) for x in parts])
    # np.unique's first index of each value: the first occurrence, since rows are in input
    # order (slices in order, lines in order within each).
    _, first = np.unique(rows["digest"], return_index=True)
    drop = np.ones(len(rows), bool)
    drop[first] = False
    save_npy(path, (where[drop] << 32) | rows["line"][drop].astype(np.int64))
    print(f"dedup: bucket {b} done: {int(drop.sum()):,} of {len(rows):,} lines dropped")
