"""What training checks on its dataset directory before reading it (steps 3 and 4 of
``lmscale_jax/config/checks.py``): a staged copy is complete and holds every shard of this
process's read plan (:func:`check_dataset_dir`); with ``--verify_data``, those shards' sha256
(:func:`verify_shards`)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import time
from typing import Callable, Sequence

from lmscale_jax.input import staging
from lmscale_jax.store import dataset


def check_dataset_dir(path: str, *, plan: str = "interleaved", num_processes: int = 1,
                      process_id: int = 0) -> dataset.DatasetMeta:
  """The dataset's metadata (loaded once, for the run to pass down), after refusing a
  directory that training must not read.

  A directory without ``staging.json`` was not staged (e.g. a prepared dataset on shared
  storage): :class:`~lmscale_jax.store.dataset.DatasetMeta` checks it as usual. A staged one must
  have finished (``complete``) and hold every shard that process ``process_id`` of
  ``num_processes`` reads under ``plan`` (the loader's: ``by_shard`` when
  ``data.shard_by_process``), with the size ``metadata.json`` gives.
  """
  state = staging.read_state(path)
  if state is None:
    return dataset.DatasetMeta.load(path)
  status = state.get("status")
  if status == "failed":
    raise staging.StagingError(
        f"{path}: staging from {state.get('source')} failed: {state.get('error')}; rerun "
        "lmscale stage (it recopies what is bad)")
  if status != "complete":
    raise staging.StagingError(
        f"{path}: staging from {state.get('source')} did not finish (status {status!r}, host "
        f"{state.get('host')}): interrupted? rerun lmscale stage to complete it")
  meta = dataset.DatasetMeta.load(path)
  needed = staging.needed_shards(meta, num_processes, [process_id], plan)
  missing = []
  for shards in needed.values():
    for shard in shards:
      shard_path = os.path.join(path, shard["file"])
      if not os.path.exists(shard_path) or os.path.getsize(shard_path) != shard["bytes"]:
        missing.append(shard["file"])
  if missing:
    staged = state.get("only_needed")
    how = (f" (staged with --only-needed, plan {staged['plan']!r}, processes "
           f"{staged['process_ids']} of {staged['num_processes']})" if staged else "")
    if plan == "by_shard":
      fix = (f"with data.shard_by_process=True process {process_id} of {num_processes} reads "
             f"shards {process_id}::{num_processes} of every split: stage them (lmscale stage "
             f"--only-needed --plan by_shard --num-processes {num_processes} --process-ids "
             "<this node's ids>) or the whole dataset")
    else:
      fix = ("with data.shard_by_process=False the loader interleaves records over all shards "
             "in every process: stage the whole dataset (without --only-needed), or train "
             "with --config.data.shard_by_process=True on a dataset staged with --plan by_shard")
    raise staging.StagingError(
        f"{path}: {len(missing)} shards the loader reads are missing or the wrong size"
        f"{how}, e.g. {missing[0]}. {fix[0].upper()}{fix[1:]}")
  return meta


def verify_shards(meta: dataset.DatasetMeta, *, splits: Sequence[str] = ("train", "validation"),
                  plan: str = "interleaved", num_processes: int = 1, process_id: int = 0,
                  workers: int = 4, log: Callable[[str], None] | None = None) -> dict:
  """``--verify_data``: re-hashes every shard of ``splits`` that process ``process_id`` of
  ``num_processes`` reads under ``plan`` and compares size, sha256 and record count with
  ``metadata.json`` (``DatasetMeta.shard_problem``).

  Raises :class:`staging.StagingError` (one line: the first bad file, expected and actual value);
  returns ``{"files", "bytes", "seconds", "mb_per_s"}`` and logs the rate.
  """
  log = log or staging.log_to_stderr
  path = meta.path
  needed = staging.needed_shards(meta, num_processes, [process_id], plan)
  shards = [s for split in splits for s in needed.get(split, [])]

  started = time.perf_counter()
  with cf.ThreadPoolExecutor(max(1, workers)) as pool:  # hashing releases the GIL
    problems = [problem for problem in pool.map(meta.shard_problem, shards) if problem]
  secs = time.perf_counter() - started
  if problems:
    more = f" (and {len(problems) - 1} more bad shards)" if len(problems) > 1 else ""
    raise staging.StagingError(
        f"data verification failed: {problems[0]}{more}: the shard is corrupt; restore it "
        "(rerun lmscale stage, or re-prepare the dataset)")
  total = sum(int(s["bytes"]) for s in shards)
  rate = total / max(secs, 1e-9) / 1e6
  log(f"verified {len(shards)} shards of {path} ({', '.join(splits)}): "
      f"{staging.human_bytes(total)} in {secs:.1f} s ({rate:.0f} MB/s, sha256)")
  return {"files": len(shards), "bytes": total, "seconds": secs, "mb_per_s": rate}
