"""Replace on success: a preparation builds its dataset complete in ``_work/new/`` and swaps it
into the output directory only at the end, so a run that fails, is killed or fills the disk
leaves the dataset that was there complete and usable (``prepare --overwrite`` used to remove
it first: a new run that failed on an empty validation split left an empty directory).

:func:`swap_in`, once ``_work/new/`` holds the whole dataset (``metadata.json`` included):

1. the manifest (``store/destination``) lists the old dataset's names and the new ones: however
   the swap ends, every file in the directory is accounted for;
2. ``_work/swap.json`` names the new files (and the run's settings, ``params.json``): from here
   on the swap only goes forward;
3. the old ``metadata.json`` goes first (no mix of old and new files is ever a complete
   dataset), then the old names the new dataset does not have; the new files are renamed into
   place, ``metadata.json`` last;
4. the manifest lists the new names only; ``_work/`` is removed, the journal last.

The swap is renames within one file system: it needs no space, but until it runs both datasets
are on the disk (the old one's bytes on top of what the new preparation needs). A run killed
during the swap (kill -9, a power cut) leaves the journal: the next preparation over that output,
or the cluster's finish stage, completes it first (:func:`complete_interrupted`), redoing each
step not done yet (every step is idempotent); a rerun of the same command is then done. Only
the names the manifest lists are ever removed: a README the user put beside the dataset stays.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

from lmscale_jax.errors import PrepareError
from lmscale_jax.store import dataset, destination, file_io

NEW = "new"  # in _work: the finished dataset, before the swap
JOURNAL = "swap.json"  # in _work: written when the swap starts, removed when it is done


def new_dir(work: str) -> str:
  """``work/new``, created: where the finished dataset is built."""
  path = os.path.join(work, NEW)
  os.makedirs(path, exist_ok=True)
  return path


def _remove(path: str) -> None:
  if os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path)
  elif os.path.lexists(path):
    os.unlink(path)


def _finished_names(new: str) -> list[str]:
  """The new dataset's names; the temp files of writes killed in an earlier run go."""
  names = []
  for n in sorted(os.listdir(new)):
    if destination.temp_of(n) is None:
      names.append(n)
    else:
      _remove(os.path.join(new, n))
  return names


def swap_in(out: str, work: str) -> None:
  """Replaces the dataset in ``out`` (if any) by the finished one in ``work/new``."""
  names = _finished_names(os.path.join(work, NEW))
  old = destination.manifest(out) or []
  destination.write_manifest(out, set(old) | set(names) | {destination.WORK})
  try:
    with open(os.path.join(work, "params.json")) as f:
      params = json.load(f)
  except (OSError, ValueError):
    params = {}
  file_io.atomic_write_json(os.path.join(work, JOURNAL), {"new": names, "params": params})
  file_io.fsync_dir(work)
  _roll_forward(out, work, names)


def complete_interrupted(out: str) -> dict | None:
  """Completes a swap a killed run left half done (its journal in ``out/_work``). Returns that
  run's ``params.json`` (kept in the journal: a rerun of the same settings is then done), or
  None when there was no such swap."""
  work = os.path.join(out, destination.WORK)
  path = os.path.join(work, JOURNAL)
  if not os.path.exists(path):
    return None
  record = file_io.read_json(path, "the journal of a dataset swap",
                             f"remove {work} and prepare the dataset again", PrepareError)
  _roll_forward(out, work, list(record["new"]))
  print(f"completed the replacement of the dataset in {out} that an interrupted run began: "
        "the new dataset is in place", file=sys.stderr)
  return record.get("params") or {}


def _roll_forward(out: str, work: str, names: list[str]) -> None:
  new = os.path.join(work, NEW)
  if os.path.exists(os.path.join(new, dataset.METADATA)):  # not moved yet: out's is the old one
    _remove(os.path.join(out, dataset.METADATA))
  keep = set(names) | {destination.WORK, destination.MANIFEST}
  ours = set(destination.manifest(out) or []) | {destination.MANIFEST}
  for n in os.listdir(out):  # old names the new dataset lacks, and killed writes' temps
    if (n in ours and n not in keep) or destination.temp_of(n) in ours:
      _remove(os.path.join(out, n))
  for n in sorted(names, key=lambda n: n == dataset.METADATA):  # metadata.json last
    if os.path.lexists(os.path.join(new, n)):
      if os.path.isdir(os.path.join(out, n)):
        _remove(os.path.join(out, n))  # os.replace puts a file over a file, not a directory
      os.replace(os.path.join(new, n), os.path.join(out, n))
  file_io.fsync_dir(out)
  destination.write_manifest(out, set(names) | {destination.WORK})
  _remove_work(work)
  destination.write_manifest(out, names)


def _remove_work(work: str) -> None:
  """``work`` with the journal last: a kill in between leaves a journal that redoes this."""
  for n in os.listdir(work):
    if n != JOURNAL:
      _remove(os.path.join(work, n))
  _remove(os.path.join(work, JOURNAL))
  os.rmdir(work)
