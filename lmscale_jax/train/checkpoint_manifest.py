"""Checksums of a committed checkpoint: which process wrote which file, one manifest per
process, and verification against them.

Orbax's commit (a temporary directory renamed when complete) covers interrupted saves, not what
happens to the files afterwards (bit rot on shared storage, a torn copy between file systems, a
half-synced directory). So every process lists the files it wrote in a step directory with
their size and SHA-256 in ``manifest.process_<i>-of-<n>.json`` there; a checkpoint counts as
complete only when the manifest of every process is present and every file matches.

Which process wrote a file (:func:`owner`): Orbax and Grain name each process's own files and
directories ``process_<i>``, ``ocdbt.process_<i>`` (the arrays it wrote) or
``process_<i>-of-<n>.json`` (its loader state); everything else (the merged OCDBT root, tree
metadata) is written by process 0. Not checksummed: :data:`COMMIT_FILES`, which Orbax writes or
rewrites at the commit itself, after the manifests (they are only required to be present, and
``_CHECKPOINT_METADATA`` to parse); they hold the commit marker and timestamps, not state.

SHA-256 (hashlib), not CRC32C: no CRC32C library is installed here, and the dataset's shards are
already checked with SHA-256 (one algorithm to reason about). Its cost against the save itself
is measured in benchmarks/bench_checkpoint.py (docs/reliability.md "Manifest cost").
"""

from __future__ import annotations

import json
import os
import re

from lmscale_jax.store import file_io

FORMAT = "lmscale_jax.checkpoint_manifest/1"
ALGORITHM = "sha256"
# Written or rewritten by Orbax when it renames the temporary directory, i.e. after the
# manifest of process 0 (see checkpoint.Checkpointer): present, not checksummed.
COMMIT_FILES = ("_CHECKPOINT_METADATA", "commit_success.txt")
STEP_METADATA = "_CHECKPOINT_METADATA"
_PART = re.compile(r"manifest\.process_(\d+)-of-(\d+)\.json")
_OWNED = re.compile(r"(?:ocdbt\.)?process_(\d+)(?:-of-\d+\.json)?")
# What save() records in Orbax's step metadata (custom_metadata): a checkpoint that says so
# must have its manifests; one without (written before manifests existed) is loaded unverified.
METADATA_KEY = "lmscale_manifest"


def part_name(process: int, count: int) -> str:
  return f"manifest.process_{process}-of-{count}.json"


def owner(relpath: str) -> int:
  """The process that wrote ``relpath`` (relative to the step directory)."""
  for part in relpath.split("/"):
    if m := _OWNED.fullmatch(part):
      return int(m.group(1))
  return 0


def _is_ours_or_commit(relpath: str) -> bool:
  name = os.path.basename(relpath)
  return (_PART.fullmatch(name) is not None or name in COMMIT_FILES
          or (name.startswith(".manifest.") and name.endswith(".tmp")))


def files_of(step_dir: str, process: int) -> list[str]:
  """The files (relative paths, sorted) that ``process`` wrote in ``step_dir``."""
  out = []
  for root, dirs, files in os.walk(step_dir):
    rel_root = os.path.relpath(root, step_dir)
    for name in files:
      rel = name if rel_root == "." else f"{rel_root}/{name}"
      if not _is_ours_or_commit(rel) and owner(rel) == process:
        out.append(rel)
  return sorted(out)


def write_part(step_dir: str, process: int, count: int, step: int) -> dict:
  """Hashes this process's files in ``step_dir`` (a temporary or committed step directory)
  and writes its manifest there atomically (temp file, fsync, rename). Returns it."""
  files = {rel: {"bytes": os.path.getsize(os.path.join(step_dir, rel)),
                 ALGORITHM: file_io.sha256_file(os.path.join(step_dir, rel))}
           for rel in files_of(step_dir, process)}
  manifest = {"format": FORMAT, "step": int(step), "process": process,
              "process_count": count, "algorithm": ALGORITHM, "files": files}
  file_io.atomic_write_json(os.path.join(step_dir, part_name(process, count)), manifest)
  return manifest


def parts_present(step_dir: str) -> dict[int, int]:
  """``{process: process_count}`` of the manifests in ``step_dir``."""
  names = os.listdir(step_dir) if os.path.isdir(step_dir) else []
  return {int(m.group(1)): int(m.group(2)) for n in names if (m := _PART.fullmatch(n))}


def expects_manifest(step_dir: str) -> bool | None:
  """True if the checkpoint was saved with manifests (its Orbax step metadata says so), False
  if it predates them, None if that metadata is missing or unreadable (itself a fault)."""
  try:
    with open(os.path.join(step_dir, STEP_METADATA)) as f:
      meta = json.load(f)
  except (OSError, ValueError):
    return None
  return METADATA_KEY in (meta.get("custom_metadata") or {})


def verify_part(step_dir: str, process: int, count: int) -> list[str]:
  """Problems of ``process``'s part of the checkpoint in ``step_dir``, each naming its file
  (empty: it verifies). Reads every byte that process wrote."""
  name = part_name(process, count)
  path = os.path.join(step_dir, name)
  try:
    with open(path) as f:
      manifest = json.load(f)
    files = manifest["files"]
    if not isinstance(files, dict) or not all(isinstance(f, dict) for f in files.values()):
      raise TypeError("'files' is not a map of file name to size and checksum")
    if manifest.get("format") != FORMAT or manifest.get("algorithm") != ALGORITHM:
      return [f"{path}: unknown manifest format {manifest.get('format')!r}"]
  except FileNotFoundError:
    return [f"{path}: manifest missing (the checkpoint was saved with manifests)"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    return [f"{path}: unreadable manifest ({type(e).__name__}: {e})"]
  problems = _listing_problems(step_dir, process, files, name)
  for rel, want in sorted(files.items()):
    file = os.path.join(step_dir, rel)
    try:
      size = os.path.getsize(file)
    except OSError:
      problems.append(f"{file}: missing")
      continue
    if size != want["bytes"]:
      problems.append(f"{file}: {size} bytes, the manifest says {want['bytes']}")
    elif file_io.sha256_file(file) != want[ALGORITHM]:
      problems.append(f"{file}: checksum mismatch ({ALGORITHM} differs from {name})")
  if process == 0:
    problems += _commit_problems(step_dir)
  return problems


def _listing_problems(step_dir: str, process: int, files: dict, name: str) -> list[str]:
  """A manifest must list every file its process wrote: checking only what it lists let one
  with an empty ``files`` map verify, and the damaged data then failed the restore (in zstd)
  instead of falling back to an older checkpoint."""
  if not files:
    return [f"{os.path.join(step_dir, name)}: lists no files (process {process} writes some "
            "in every checkpoint)"]
  return [f"{os.path.join(step_dir, rel)}: not in {name}"
          for rel in files_of(step_dir, process) if rel not in files]


def _commit_problems(step_dir: str) -> list[str]:
  missing = [n for n in COMMIT_FILES if not os.path.isfile(os.path.join(step_dir, n))]
  if missing:
    return [f"{os.path.join(step_dir, n)}: missing" for n in missing]
  if expects_manifest(step_dir) is None:
    return [f"{os.path.join(step_dir, STEP_METADATA)}: unreadable (not JSON)"]
  return []


def verify(step_dir: str, process: int | None = None, count: int | None = None) -> list[str]:
  """Problems of the checkpoint in ``step_dir`` (empty: it verifies). ``process``/``count``:
  only that process's part (what each process of a job checks on resume), plus the presence
  of every other part's manifest; None: every part (lmscale inspect).

  A checkpoint saved before manifests existed (its step metadata lacks :data:`METADATA_KEY`
  and it has no manifest) verifies with nothing to check; see :func:`expects_manifest`."""
  present = parts_present(step_dir)
  expected = expects_manifest(step_dir)
  if expected is False and not present:
    return []
  if expected is None:
    return _commit_problems(step_dir) or [f"{step_dir}/{STEP_METADATA}: unreadable"]
  if count is None:
    count = max(present.values(), default=1)
  if process is None:
    return [problem for p in range(count) for problem in verify_part(step_dir, p, count)]
  # The other parts are theirs to check; that they exist costs nothing to see here.
  problems = [f"{os.path.join(step_dir, part_name(p, count))}: manifest missing"
              for p in range(count) if p not in present and p != process]
  return problems + verify_part(step_dir, process, count)
