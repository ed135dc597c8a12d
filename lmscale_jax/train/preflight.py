"""The checks of a run before it reads data, in the order :mod:`lmscale_jax.config.checks`
describes: :func:`check_before_runtime` (every config value, and the start model of
``init_from``) before the runtime starts, so a typo never waits for start-up or staging; then,
with the runtime up, :func:`preflight` across the processes."""

from __future__ import annotations

import json
import os
import uuid

import jax

from lmscale_jax.cluster import distributed
from lmscale_jax.cluster.topology import DistributedError
from lmscale_jax.config import checks as config_checks
from lmscale_jax.model import hf_convert
from lmscale_jax.train import checkpoint


def check_before_runtime(config) -> None:
  """Step 1 (one ``ConfigError`` line naming the key): every value on its own, then the
  Hugging Face directory of ``init_from`` holds a BERT of ``config.model``'s shape."""
  config_checks.check_config(config)
  if config.init_from:
    hf_convert.check_matches_model_config(str(config.init_from), config.model)


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
