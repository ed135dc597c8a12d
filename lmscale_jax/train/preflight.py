"""The checks of a run before it reads data that need the runtime, in the order
:mod:`lmscale_jax.config.checks` describes: :func:`preflight` across the processes, once the
runtime is up (those that need none run first: ``train.startup.check_before_runtime``)."""

from __future__ import annotations

import json
import os
import uuid

import jax

from lmscale_jax.cluster import distributed
from lmscale_jax.cluster.topology import DistributedError
from lmscale_jax.config import checks as config_checks
from lmscale_jax.errors import ConfigError
from lmscale_jax.train import checkpoint


def device_memory() -> tuple[int, str] | None:
  """``(bytes, what they are)`` one local device can hold: the runtime's allocator limit
  (``memory_stats()["bytes_limit"]``, on GPUs), or on CPUs this host's memory shared by its
  CPU devices; None where neither is known."""
  device = jax.local_devices()[0]
  stats = device.memory_stats() or {}
  if stats.get("bytes_limit"):
    return int(stats["bytes_limit"]), f"a {device.device_kind}'s memory (the runtime's limit)"
  if device.platform == "cpu" and hasattr(os, "sysconf"):
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    count = jax.local_device_count()
    return host // count, ("this host's memory" if count == 1 else
                           f"this host's memory shared by {count} CPU devices")
  return None


def check_memory(config, estimate_at) -> None:
  """Refuses a step whose memory estimate (``estimate_at(per_device_batch)``, bytes:
  ``model.flops.memory_estimate_bytes``) exceeds what a device holds, naming the batch that
  fits and the levers. The estimate leaves out XLA's temporaries (it was 0.64x of the measured
  peak of bert120m, docs/performance.md), so a step above it cannot fit: starting anyway only
  fails later, after the start-up and the compile (train.batch_size=100000000 of configs/tiny
  logged "278,289 GiB per device" and started). ``train.memory_check=false`` skips it."""
  have = device_memory() if config.train.memory_check else None
  per_device = config.train.batch_size // jax.device_count()
  if have is None or estimate_at(per_device) <= have[0]:
    return
  grain = jax.device_count() * int(config.train.grad_accum_steps)  # what a batch divides by
  fits = _largest_fitting(estimate_at, have[0], per_device) * jax.device_count() // grain * grain
  raise ConfigError(
      f"train.batch_size={config.train.batch_size}: a step needs ≈"
      f"{estimate_at(per_device) / 2**30:,.1f} GiB per device by the memory estimate, more "
      f"than the {have[0] / 2**30:,.1f} GiB of {have[1]}. "
      + (f"Use train.batch_size={fits} or less" if fits else
         f"Not even train.batch_size={grain} fits") + ", or the levers: train.remat=full (or dots), train.grad_accum_steps, train.fsdp=true "
      "(--dry_run prints the estimate); train.memory_check=false starts anyway")


def _largest_fitting(estimate_at, limit: int, upper: int) -> int:
  """The largest per-device batch in 0..upper whose estimate fits ``limit`` (it grows with
  the batch): a bisection."""
  lo, hi = 0, upper
  while lo < hi:
    mid = (lo + hi + 1) // 2
    lo, hi = (mid, hi) if estimate_at(mid) <= limit else (lo, mid - 1)
  return lo


_SHARED_CHECK_FILE = ".lmscale_shared_check"

# Config keys that may differ between processes without changing what they compute.
PER_PROCESS_KEYS = ("distributed", "data.path", "data.workers", "data.prefetch_buffer",
                    "data.read_threads", "data.stage_from", "data.stage_workers")


def comparable_config(config) -> dict:
  """The config as flat ``{"a.b": value}``, without :data:`PER_PROCESS_KEYS`."""
  flat = config_checks.flat_keys(json.loads(config.to_json_best_effort()))
  return {key: value for key, value in flat.items()
          if not any(key == k or key.startswith(f"{k}.") for k in PER_PROCESS_KEYS)}


def _check_same_config(config) -> None:
  mine = comparable_config(config)
  for p, text in enumerate(distributed.allgather("config", json.dumps(mine, sort_keys=True))):
    other = json.loads(text)
    diff = sorted(k for k in set(mine) | set(other) if mine.get(k) != other.get(k))
    if diff:
      key = diff[0]
      more = f" (and {len(diff) - 1} more keys)" if len(diff) > 1 else ""
      raise DistributedError(
          f"the processes were started with different configs: process "
          f"{jax.process_index()} has {key}={mine.get(key)!r}, process {p} has "
          f"{key}={other.get(key)!r}{more}; they would run different steps")


def _check_shared_workdir(workdir: str) -> None:
  """Process 0 writes a fresh token into ``workdir``; every process must read it back."""
  mine = uuid.uuid4().hex if jax.process_index() == 0 else ""
  token = distributed.allgather("workdir_token", mine)[0]
  check = os.path.join(workdir, _SHARED_CHECK_FILE)

  def write_token():
    if jax.process_index() == 0:
      os.makedirs(workdir, exist_ok=True)
      with open(check, "w") as f:
        f.write(token)

  def read_token():
    try:
      with open(check) as f:
        seen = "another run's token" if f.read() != token else None
    except OSError as e:
      seen = f"unreadable: {e.strerror}"
    if seen:
      raise DistributedError(
          f"workdir {workdir} is not the same directory on every process (process 0 wrote "
          f"{check}; here it is {seen}): checkpoints and metrics need a shared file system "
          "visible to all nodes")

  distributed.agree("workdir", write_token)
  distributed.agree("shared workdir", read_token)


def preflight(config, workdir: str) -> None:
  """Checks, before any data is read, that the processes will run the same steps together:
  a batch that splits over the global devices (``config_checks.check_batch``), identical
  configs, one shared workdir, and a checkpoint (if any) written by the same number of
  processes. Any failure is raised in every process with the process and host it concerns."""
  config_checks.check_batch(config.train.batch_size, processes=jax.process_count(),
                            devices_per_process=jax.local_device_count(),
                            accum_steps=config.train.grad_accum_steps)
  if jax.process_count() == 1:
    checkpoint.check_process_count(workdir, 1)
    return
  _check_same_config(config)
  _check_shared_workdir(workdir)
  distributed.agree("checkpoint",
                    lambda: checkpoint.check_process_count(workdir, jax.process_count()))
