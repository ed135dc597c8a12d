"""Shared test fixtures: real datasets written through the production writer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import ml_collections

from lmscale_jax.child_process import stop_group as stop_process_group  # noqa: F401
from lmscale_jax.config import defaults as config_defaults
# The dataset every test trains on: the product's synthetic writer (benchmarks use it too).
from lmscale_jax.store.synthetic_dataset import SPECIAL_IDS  # noqa: F401
from lmscale_jax.store.synthetic_dataset import (  # noqa: F401
    write_synthetic_dataset as make_synthetic_dataset)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The lmscale subcommand module each old tools/<name>.py is kept for (where the names differ).
CLI_MODULES = {"inspect_shards": "inspect_data", "fetch_bench_sources": "similarity_sources",
               "build_similarity_bench": "similarity_build", "finetune_similarity": "finetune"}


def lmscale(tool: str) -> list[str]:
  """The command line of the lmscale subcommand ``tool`` (an old tools/ name, ``.py`` or not)
  as ``python -m lmscale_jax.cli.<module>``: what the installed ``lmscale`` runs."""
  name = tool.removesuffix(".py")
  if name.startswith("prepare_"):  # prepare_binary / _text / _cluster: one module, kind first
    return [sys.executable, "-m", "lmscale_jax.cli.prepare", name.removeprefix("prepare_")]
  return [sys.executable, "-m", f"lmscale_jax.cli.{CLI_MODULES.get(name, name)}"]


def communicate(p: subprocess.Popen, timeout: float = 180) -> tuple[str, str]:
  """``p.communicate`` that never hangs a test: past ``timeout`` the process group (started
  with ``start_new_session``) is killed and the test fails with the tails of its output."""
  try:
    return p.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(p.pid, signal.SIGKILL)
    out, err = p.communicate()
    raise AssertionError(f"timed out after {timeout} s:\n{out[-3000:]}\n{err[-3000:]}")


def make_config(data_path="", **sections) -> ml_collections.ConfigDict:
  """The default config (``config_defaults.get_base_config``) with ``data.path`` set and
  overrides per section: ``make_config(path, train=dict(batch_size=8), data=dict(workers=1))``.
  Every test config starts here, so a test sees the defaults users get."""
  c = config_defaults.get_base_config()
  c.data.path = str(data_path)
  for section, values in sections.items():
    c[section].update(values)
  return c


def small_train_config(data_path, **train) -> ml_collections.ConfigDict:
  """A 2 × 64 float32 model without dropout, 6 steps of batch 8, logging every step, eval and
  checkpoint every 3: what the training-loop tests run (seconds on a CPU)."""
  c = make_config(
      data_path,
      model=dict(layers=2, hidden=64, heads=2, ffn=128, dtype="float32", dropout=0.0),
      train=dict(batch_size=8, steps=6, learning_rate=2e-3, warmup_steps=2, log_every=1,
                 eval_every=3, eval_batches=2),
      checkpoint=dict(every=3, keep=2))
  c.train.update(train)
  return c
