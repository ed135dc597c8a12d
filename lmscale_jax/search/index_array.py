"""A function index built as a Slurm job array (launch/index.sbatch): ``lmscale index --task I
--tasks N`` per array task, then ``lmscale index finish`` once. The result is the index one
node builds from the same files, index.json and shard files byte for byte.

Each task takes a contiguous share of the binaries to add (the given files in order, the first
of each sha256, those index.json already holds left out: every task computes the same list) and
writes only its binaries' shard files and, in INDEX_DIR/parts/:

  binary-<sha256>.json              a binary's index.json entry, once its shards are complete
                                    (the completion marker: a rerun skips the binary)
  task-<I>-of-<N>.json              the task's entries in order, once all are done

No task writes index.json: finish, alone, merges the task files in task order (the one-node
order), writes index.json atomically and removes parts/. A finish that lacks a task file names
the missing tasks; one over task files of different runs (another file list, model or N) says so.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil

from lmscale_jax.errors import UserError
from lmscale_jax.search import index, index_files
from lmscale_jax.store import file_io

PARTS = "parts"
PART_KEYS = {"task", "tasks", "plan", "model", "pool", "dim", "binaries"}


def share(count: int, task: int, tasks: int) -> range:
  """Task ``task``'s contiguous share of ``count`` units (sizes differ by at most one)."""
  return range(task * count // tasks, (task + 1) * count // tasks)


def task_name(task: int, tasks: int) -> str:
  return f"task-{task:05d}-of-{tasks:05d}.json"


def plan_digest(todo: list[tuple[int, str]], tasks: int) -> str:
  """What every task of one array agrees on: the binaries to add, in order, and the split."""
  return hashlib.sha256(json.dumps([tasks, [d for _, d in todo]]).encode()).hexdigest()


def run_task(model, elf_paths: list[str], index_dir: str, task: int, tasks: int,
             say=print, strict: bool = False) -> dict:
  """Array task ``task`` of ``tasks``: embeds its share (see the module's doc) → its task file's
  contents. Every input is checked before anything is written; a file preparation would skip
  is skipped and counted as index.build counts it (its ``files_skipped``: task 0 counts those
  every task sees, each task those of its share), or with ``strict`` refused."""
  if task >= tasks:
    raise UserError(f"--task {task}: expected 0 .. {tasks - 1} (--tasks {tasks})")
  doc = index.open_index(index_dir, model)
  broken = index.damaged(index_dir, doc)
  if broken:  # one process repairs (index.json is rewritten): not N tasks at once
    raise UserError(f"{broken[0][1]} ({len(broken)} damaged shard(s)); run lmscale index "
                    f"--output {index_dir} without --tasks once to rebuild them, then the array")
  passed: list[index.Skipped] | None = None if strict else []
  todo = index.to_add(elf_paths, doc, index.first_of_each(index.checked(elf_paths, passed)))
  if task and passed:  # every task checks every file: task 0 alone tells and counts them
    del passed[:]
  for e in passed or ():
    index.tell_skipped(e, say)
  mine = [todo[j] for j in share(len(todo), task, tasks)]
  os.makedirs(os.path.join(index_dir, PARTS), exist_ok=True)
  index_files.clear_partial(index_dir, [d for _, d in mine])
  entries = []
  for i, digest in mine:
    entry = _marked(model, index_dir, elf_paths[i], digest, doc["model"], entries, passed, say)
    entries += [entry] if entry is not None else []
  part = {"task": task, "tasks": tasks, "plan": plan_digest(todo, tasks), "model": doc["model"],
          "pool": doc["pool"], "dim": doc["dim"], "binaries": entries,
          "files_skipped": index.counts(passed or [])}
  file_io.atomic_write_json(os.path.join(index_dir, PARTS, task_name(task, tasks)), part)
  return part


def _marked(model, index_dir, path, digest, ident, done, skipped, say) -> dict | None:
  """A binary's entry: from its completion marker (same model), else embedded and marked;
  None where it is skipped (``index.embedded_or_skipped``)."""
  marker = os.path.join(index_dir, PARTS, f"binary-{digest}.json")
  if os.path.exists(marker):
    kept = file_io.read_json(marker, "a binary's completion marker", "delete it (the binary is "
                             "embedded again)", index_files.IndexFileError)
    if _still_good(kept, ident, index_dir):
      say(f"already embedded: {path}")
      return {**kept["entry"], "path": os.path.abspath(path)}  # the path this run gives
  entry = index.kept_so_far(lambda: index.embedded_or_skipped(model, index_dir, path, digest,
                                                             skipped, say),
                            done, os.path.join(index_dir, PARTS))
  if entry is None:
    return None
  file_io.atomic_write_json(marker, {"model": ident, "entry": entry})
  say(f"indexed {entry['functions']} functions of {path}")
  return entry


def _still_good(kept, ident: dict, index_dir: str) -> bool:
  """A marker of this model whose shard files are still there."""
  ok = (isinstance(kept, dict) and isinstance(kept.get("model"), dict)
        and isinstance(kept.get("entry"), dict) and "shard" in kept["entry"]
        and kept["model"].get("sha256") == ident["sha256"])
  return ok and all(os.path.isfile(os.path.join(index_dir, kept["entry"]["shard"] + ext))
                    for ext in (".npz", ".jsonl"))


def read_parts(index_dir: str) -> list[dict]:
  """The task files of one array, in task order; a missing task or a mix of runs is one line."""
  folder = os.path.join(index_dir, PARTS)
  paths = sorted(glob.glob(os.path.join(folder, "task-*-of-*.json")))
  if not paths:
    raise UserError(f"{folder}: no task files (run the array's tasks first: lmscale index … "
                    "--task I --tasks N)")
  parts = [_read_part(p) for p in paths]
  if len({(p["tasks"], p["plan"], p["model"].get("sha256")) for p in parts}) != 1:
    raise UserError(f"{folder}: task files of different runs (another file list, model or "
                    "--tasks); delete the folder and run the array again")
  tasks = parts[0]["tasks"]
  missing = sorted(set(range(tasks)) - {p["task"] for p in parts})
  if missing:
    raise UserError(f"{index_dir}: task(s) {', '.join(map(str, missing))} of {tasks} have not "
                    f"finished (no {PARTS}/{task_name(missing[0], tasks)}); rerun them, then "
                    "finish")
  return sorted(parts, key=lambda p: p["task"])


def _read_part(path: str) -> dict:
  part = file_io.read_json(path, "an index task's file", "delete it and rerun that task",
                           index_files.IndexFileError)
  if not (isinstance(part, dict) and PART_KEYS <= set(part) and isinstance(part["model"], dict)):
    raise index_files.IndexFileError(f"{path}: not an index task's file (expected the keys "
                                     f"{', '.join(sorted(PART_KEYS))}); delete it and rerun "
                                     "that task")
  return part


def finish(index_dir: str) -> dict:
  """Merges the tasks' entries into index.json → {"added": binaries, "functions": count}."""
  parts = read_parts(index_dir)
  first = parts[0]
  doc = index_files.read(index_dir) or index_files.new(first["model"], first["pool"],
                                                        first["dim"])
  index.check_model(doc, first["model"], index_dir)
  have = {b["sha256"] for b in doc["binaries"]}
  added = [e for p in parts for e in p["binaries"] if e["sha256"] not in have]
  index_files.check_present(index_dir, {"binaries": added})
  doc["binaries"] += added
  index_files.write(index_dir, doc)
  shutil.rmtree(os.path.join(index_dir, PARTS))  # after index.json: a rerun merges nothing twice
  index_files.clear_partial(index_dir)
  return {"added": len(added), "functions": sum(e["functions"] for e in added),
          "files_skipped": skip_counts(parts)}


def skip_counts(parts: list[dict]) -> dict[str, int]:
  """The tasks' files_skipped, summed (a task file written before they were counted: none)."""
  out: dict[str, int] = {}
  for p in parts:
    for reason, n in (p.get("files_skipped") or {}).items():
      out[reason] = out.get(reason, 0) + n
  return dict(sorted(out.items()))
