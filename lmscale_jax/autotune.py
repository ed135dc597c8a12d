"""Loader autotune: the fewest Grain worker processes whose input wait stays under a target
fraction of the step time, recorded in the workdir so that a resume rebuilds the same iterator.

Why a measured loop rather than ``grain.experimental.pick_performance_config``: that function
(grain 0.2.18, ``prefetch_autotune.py``) sets ``num_workers = ram_budget_mb / element_mb``
capped at ``max_workers``: a memory bound that never looks at how fast batches are produced or
consumed, so it can neither tell that 1 worker suffices nor that 8 are too few.

The measurement (:func:`measure_wait`): build the loader with ``w`` workers, drain its
prefetch buffers, then consume ``steps`` batches with a consumer that spends the measured
device-step time per batch (a sleep: during a device step the training loop's host thread is
idle, waiting on the next batch) and report the fraction of wall time spent blocked in
``next()`` -- the same ``input_wait_frac`` the training loop logs. Candidates are
0, 1, 2, 4, … up to ``max_workers``; the first under the target wins (fewest processes, least
host memory); if none is, the one with the least wait.

Why recorded: Grain's ``mp_prefetch`` interleaves one iterator per worker, so a saved iterator
state is only valid for the worker count that produced it. ``workdir/loader_autotune.json``
holds the choice and the measurements; a resumed run reads it back and does not measure again.
A run that already has checkpoints but no record (started without autotune) keeps
``data.workers`` and records that.
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable, Iterator

from absl import logging

from lmscale_jax import dataset

FILENAME = "loader_autotune.json"


def candidates(max_workers: int) -> list[int]:
  """0, 1, 2, 4, … (powers of two) up to and including ``max_workers``."""
  out, w = [0], 1
  while w < max_workers:
    out.append(w)
    w *= 2
  if max_workers > 0:
    out.append(max_workers)
  return out


def measure_wait(make_iterator: Callable[[int], Iterator], workers: int, step_seconds: float,
                 *, steps: int = 40, max_seconds: float = 10.0, drain: int = 8) -> dict:
  """Input-wait fraction of a consumer taking ``step_seconds`` per batch (see module doc)."""
  it = make_iterator(workers)
  try:
    t0 = time.perf_counter()
    next(it)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(drain):  # empties the prefetch buffers filled during startup
      next(it)
    drain_s = time.perf_counter() - t0
    waited, n = 0.0, 0
    start = time.perf_counter()
    while n < steps and (n < 5 or time.perf_counter() - start < max_seconds):
      t = time.perf_counter()
      next(it)
      waited += time.perf_counter() - t
      time.sleep(step_seconds)
      n += 1
    elapsed = time.perf_counter() - start
  finally:
    close = getattr(it, "close", None)
    if close is not None:
      close()
  return {"workers": workers, "wait_frac": waited / elapsed, "batches": n,
          "seconds": elapsed, "first_batch_s": first,
          "drain_batch_s": drain_s / max(drain, 1)}


def choose_workers(make_iterator: Callable[[int], Iterator], step_seconds: float, *,
                   target: float, max_workers: int, **measure_kw) -> tuple[int, list[dict]]:
  """Raises the worker count until the input wait is under ``target``; (choice, measurements)."""
  results = []
  for w in candidates(max_workers):
    r = measure_wait(make_iterator, w, step_seconds, **measure_kw)
    results.append(r)
    logging.info("loader autotune: %d workers -> input wait %.1f%% of a %.3f s step", w,
                 100 * r["wait_frac"], step_seconds)
    if r["wait_frac"] < target:
      return w, results
  best = min(results, key=lambda r: r["wait_frac"])
  logging.warning("loader autotune: no worker count reached an input wait under %.1f%% (best "
                  "%.1f%% with %d workers); using %d", 100 * target, 100 * best["wait_frac"],
                  best["workers"], best["workers"])
  return best["workers"], results


def resolve_workers(workdir: str, data_config, *, has_checkpoint: bool, is_writer: bool,
                    step_seconds: Callable[[], float],
                    make_iterator: Callable[[int], Iterator]) -> int:
  """The worker count this run uses with ``data.autotune``: recorded, kept, or measured.

  ``step_seconds`` (measuring a few real steps) and ``make_iterator`` are only called when a
  measurement is needed: a fresh run without a record.
  """
  path = os.path.join(workdir, FILENAME)
  if os.path.exists(path):
    with open(path) as f:
      record = json.load(f)
    logging.info("loader autotune: %d workers, as recorded in %s", record["workers"], path)
    return int(record["workers"])
  if has_checkpoint:
    workers = int(data_config.workers)
    record = {"workers": workers, "reason": "resumed a run started without autotune: kept "
              "data.workers, which the saved iterator state depends on"}
  else:
    max_workers = int(data_config.autotune_max_workers) or (os.cpu_count() or 1)
    target = float(data_config.autotune_target)
    step_s = float(step_seconds())
    workers, results = choose_workers(make_iterator, step_s, target=target,
                                      max_workers=max_workers)
    record = {"workers": workers, "reason": "measured", "target": target,
              "step_seconds": step_s, "max_workers": max_workers, "measurements": results}
  if is_writer:
    os.makedirs(workdir, exist_ok=True)
    dataset.atomic_write_json(path, record)
  logging.info("loader autotune: %d workers (%s)", record["workers"], record["reason"])
  return int(record["workers"])
