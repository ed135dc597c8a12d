"""Loader autotune: the fewest Grain worker processes whose input wait stays under a target
fraction of the step time, recorded in the workdir so that a resume takes the same choice.

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

Why recorded: ``workdir/loader_autotune.json`` holds the choice and the measurements, so a
resumed run takes the same choice without measuring again (tens of seconds of start-up) and
the choice is visible after the fact. Nothing else depends on it: the loader's checkpointed
state is ``{"next_batch": k}`` for any worker count, so a run without a record (started before
autotune was switched on) simply measures like a fresh one.

:func:`choose_for_run` is what training calls: it measures real steps of the run's own
compiled step function (:func:`time_steps`) and real iterators of its own dataset.
"""

from __future__ import annotations

import copy
import json
import os
import time
from typing import Callable, Iterator

from absl import logging

from lmscale_jax.store import file_io

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


def resolve_workers(workdir: str, data_config, *, is_writer: bool,
                    step_seconds: Callable[[], float],
                    make_iterator: Callable[[int], Iterator]) -> int:
  """The worker count this run uses with ``data.autotune``: recorded, or measured.

  ``step_seconds`` (measuring a few real steps) and ``make_iterator`` are only called when
  there is no record yet.
  """
  path = os.path.join(workdir, FILENAME)
  if os.path.exists(path):
    with open(path) as f:
      record = json.load(f)
    logging.info("loader autotune: %d workers, as recorded in %s", record["workers"], path)
    return int(record["workers"])
  max_workers = int(data_config.autotune_max_workers) or (os.cpu_count() or 1)
  target = float(data_config.autotune_target)
  step_s = float(step_seconds())
  workers, results = choose_workers(make_iterator, step_s, target=target,
                                    max_workers=max_workers)
  record = {"workers": workers, "reason": "measured", "target": target,
            "step_seconds": step_s, "max_workers": max_workers, "measurements": results}
  if is_writer:
    os.makedirs(workdir, exist_ok=True)
    file_io.atomic_write_json(path, record)
  logging.info("loader autotune: %d workers (%s)", record["workers"], record["reason"])
  return int(record["workers"])


def time_steps(steps, host_batch: dict, seed: int, n: int = 5) -> float:
  """Seconds per training step of ``steps`` (a ``steps.Steps``), timed on a scratch state
  (freed before returning)."""
  import jax

  batch = jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(steps.batch_sharding, x), host_batch)
  state = steps.init(jax.random.key(seed))
  state, metrics = steps.train_step(state, batch)  # compiles
  jax.block_until_ready(metrics)
  t0 = time.perf_counter()
  for _ in range(n):
    state, metrics = steps.train_step(state, batch)
  jax.block_until_ready((state, metrics))
  seconds = (time.perf_counter() - t0) / n
  del state
  return seconds


def choose_for_run(config, meta, workdir: str, steps, *, is_writer: bool) -> int:
  """``data.workers`` for this run (every process takes process 0's choice, the one
  recorded): the loader of ``config``'s train split against ``steps``' measured step time."""
  import jax
  import numpy as np

  from lmscale_jax.input import grain_pipeline

  process_index, process_count = jax.process_index(), jax.process_count()

  def make_iterator(workers: int):
    candidate = copy.deepcopy(config)
    candidate.data.workers = workers
    return iter(grain_pipeline.make_dataset(candidate, meta, "train", train=True,
                                  process_index=process_index, process_count=process_count))

  def step_seconds() -> float:
    return time_steps(steps, next(make_iterator(0)), int(config.train.seed))

  workers = resolve_workers(workdir, config.data, is_writer=is_writer,
                            step_seconds=step_seconds, make_iterator=make_iterator)
  if process_count > 1:
    from jax.experimental import multihost_utils

    workers = int(multihost_utils.broadcast_one_to_all(np.int32(workers)))
  return workers
