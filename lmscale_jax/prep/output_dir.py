"""The output directory of a preparation: what in it is ours, who may write it, whether a rerun
resumes it.

``prepare_manifest.json`` (written before anything else) lists every name a preparation created
there: ``--overwrite`` replaces exactly those, and nothing the user put beside them, and only
once the new dataset is complete (``prep/dataset_swap.py``: until then the old one stays usable).
Which directories are refused (one that is, contains or lies in an input; a non-empty one that
holds another dataset or files no lmscale tool wrote) is ``store/destination.py``'s rule, which
``lmscale stage`` follows too. ``.prepare.lock`` holds the directory while a run writes
(exclusive for a single-node run, shared among a cluster preparation's array tasks); an
unfinished run's ``_work/params.json`` says whether a rerun resumes it (the same options and input
files) or starts afresh. Used by ``prep/prepare.py`` (one node) and ``prep/cluster_extract.py``
(the stages of a Slurm array).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys

from lmscale_jax import errors
from lmscale_jax.errors import PrepareError
from lmscale_jax.prep import dataset_swap
from lmscale_jax.prep.options import PrepareOptions
from lmscale_jax.store import dataset, destination, dir_lock, file_io

WORK = destination.WORK
LOCK = destination.PREPARE_LOCK  # in the output directory, while a preparation writes there


def check_overlap(o: PrepareOptions) -> None:
  """The output directory is written: it must not hold, lie in or be an input
  (``store/destination``'s rule, which ``lmscale stage`` follows too)."""
  named = [("--input", p) for p in o.inputs] + ([("--tokenizer", o.tokenizer)]
                                                if o.tokenizer else [])
  hit = destination.overlap(o.output, [p for _, p in named])
  if hit:
    how, path = hit
    flag = next(f for f, p in named if p == path)
    raise PrepareError(f"--output {o.output!r} {how} the {flag} {path!r}: the dataset directory "
                       "is written (and with --overwrite cleared of the old dataset), so it must "
                       "lie outside every input; choose another --output")


# The manifest lists every name a preparation created in the output directory: --overwrite
# replaces those and nothing else (a README or anything the user put there survives).
MANIFEST = destination.MANIFEST
TFDS_FILES = destination.TFDS_FILES


def manifest(out: str) -> list[str] | None:
  try:
    return destination.manifest(out)
  except dataset.DatasetError as e:
    raise PrepareError(str(e)) from None


def write_manifest(out: str, names) -> None:
  destination.write_manifest(out, names)


def _overwritten(out: str, names: list[str]) -> list[str]:
  """--overwrite: the names of ``out`` the new dataset will replace (what earlier preparations
  wrote); they stay until it is complete (``prep/dataset_swap.py``)."""
  try:
    foreign = destination.foreign(out, names, tools="prepare")
  except dataset.DatasetError as e:
    raise PrepareError(str(e)) from None
  if manifest(out) is None and foreign:
    more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
    raise PrepareError(f"output {out!r} holds {foreign[0]!r}{more}, which no preparation wrote "
                       f"(it has no {MANIFEST}): --overwrite replaces only a dataset's own "
                       "files; choose a new or empty --output")
  return [n for n in names if n not in foreign]


def _refusal(out: str, occupant: destination.Occupant, resumable: bool) -> str:
  """Why a preparation without --overwrite may not write into ``out``."""
  if occupant.kind == "dataset":
    unfinished = " (and resume the unfinished run there that replaces it)" if resumable else ""
    return (f"output {out!r} already holds a complete dataset; pass --overwrite to replace "
            f"it{unfinished}: it stays until the new one is complete")
  if occupant.kind == "foreign":
    return (f"output {out!r} is not empty: it holds {occupant.name!r}, which no preparation "
            "wrote; choose a new or empty --output")
  if occupant.kind == "staging":
    return (f"output {out!r} holds an unfinished staging ({occupant.name}) but no dataset; "
            "choose a new or empty --output")
  return (f"output {out!r} holds the files of an earlier preparation but no dataset; pass "
          "--overwrite to replace them")


def _resume_or_restart(o: PrepareOptions, params: dict) -> bool:
  """An unfinished preparation in the work dir: True to resume it; False when it was started
  on other input files (then its work is dropped: nothing of it is valid)."""
  work = os.path.join(o.output, WORK)
  with open(os.path.join(work, "params.json")) as f:
    old = json.load(f)
  if old == params:
    return True
  changed = sorted(k for k in set(old) | set(params) if old.get(k) != params.get(k))
  if o.overwrite:  # --overwrite starts over (an unfinished run of the same settings resumes)
    print(f"dropping the unfinished preparation in {o.output} ({', '.join(changed)} differ): "
          "--overwrite starts over", file=sys.stderr)
    shutil.rmtree(work)
    return False
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
  """Creates/validates the output directory (held by :func:`output_lock`, which also refuses
  an output that is not a directory). Returns True when resuming an earlier run (with
  --overwrite too: the same settings and input files make the same dataset)."""
  out, work = o.output, os.path.join(o.output, WORK)
  dataset_swap.complete_interrupted(out)  # a swap a kill cut short: finished first
  names = destination.entries(out)
  resumable = os.path.exists(os.path.join(work, "params.json"))
  replaced = _overwritten(out, names) if o.overwrite else []
  occupant = None if o.overwrite else destination.occupant(out, names)
  if occupant and (occupant.kind == "dataset" or not resumable):
    raise PrepareError(_refusal(out, occupant, resumable))
  if resumable and _resume_or_restart(o, params):
    return True
  try:
    os.makedirs(out, exist_ok=True)
    # The manifest first: whatever happens next, it names what is ours, the old dataset's
    # files included (the swap removes them once the new one is complete).
    write_manifest(out, (manifest(out) or replaced) + [WORK])
    os.makedirs(work, exist_ok=True)
    file_io.atomic_write_json(os.path.join(work, "params.json"), params)
  except OSError as e:
    if errors.disk_full(e):
      raise
    raise PrepareError(f"output {out!r} is not writable: {e.strerror}") from None
  return False


def remove_work(out: str, work: str) -> None:
  """``work`` and its name in the manifest (the manifest too, if it named nothing else)."""
  shutil.rmtree(work, ignore_errors=True)
  names = [n for n in manifest(out) or [] if n != WORK]
  if names:
    write_manifest(out, names)
  elif os.path.exists(os.path.join(out, MANIFEST)):
    os.unlink(os.path.join(out, MANIFEST))
