"""The output directory of a preparation: what in it is ours, who may write it, whether a rerun
resumes it.

``prepare_manifest.json`` (written before anything else) lists every name a preparation created
there: ``--overwrite`` removes exactly those, and nothing the user put beside them. The directory
never contains, lies in or is an input; ``.prepare.lock`` holds it while a run writes
(exclusive for a single-node run, shared among a cluster preparation's array tasks); an
unfinished run's ``_work/params.json`` says whether a rerun resumes it (the same options and input
files) or starts afresh. Used by ``prep/prepare.py`` (one node) and ``prep/cluster_extract.py``
(the stages of a Slurm array).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys

from lmscale_jax import errors
from lmscale_jax.errors import PrepareError
from lmscale_jax.prep.options import PrepareOptions
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


def manifest(out: str) -> list[str] | None:
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


def write_manifest(out: str, names) -> None:
  file_io.atomic_write_json(os.path.join(out, MANIFEST),
                            {"tool": "lmscale_jax.prepare", "files": sorted(set(names))})


# The temp file of an atomic write killed half way (file_io.atomic_write_bytes): ".NAME.*.tmp".
_TEMP_NAME = re.compile(r"\.(.+)\.[^.]+\.tmp")


def _foreign(out: str, names: list[str]) -> list[str]:
  """The entries of ``out`` that no preparation wrote."""
  owned = manifest(out)
  named = (lambda n: n in owned or n == MANIFEST) if owned is not None else _ours_by_name

  def ours(n: str) -> bool:
    m = _TEMP_NAME.fullmatch(n)
    return named(n) or (m is not None and named(m.group(1)))

  return sorted(n for n in names if not ours(n))


def remove_stale_temps(out: str, ours: set[str]) -> None:
  """The temp files a killed run left half written beside our files (a finished dataset holds
  none: CI runs killed during the writes of stats.json and of the manifest kept one each)."""
  for n in os.listdir(out):
    m = _TEMP_NAME.fullmatch(n)
    if m is not None and (m.group(1) in ours or m.group(1) == MANIFEST):
      os.unlink(os.path.join(out, n))


def _clear_own(out: str, names: list[str]) -> None:
  """--overwrite: removes what earlier preparations wrote, the manifest last."""
  foreign = set(_foreign(out, names))
  if manifest(out) is None and foreign:
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
  """Creates/validates the output directory (held by :func:`output_lock`, which also refuses
  an output that is not a directory). Returns True when resuming an earlier run."""
  out, work = o.output, os.path.join(o.output, WORK)
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
    write_manifest(out, (manifest(out) or []) + [WORK])
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
