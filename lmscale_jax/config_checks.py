"""Every check of the configuration, and the order they run in before any process reads data.

``main`` runs, in this order (each failure is one ``error:`` line; multi-process: raised in
every process, naming the process and host it concerns):

1. :func:`check_config` (here), before the runtime starts: each value on its own (positive
   counts, known modes), so a typo never waits for start-up or staging.
2. ``distributed.preflight``: :func:`check_batch` (here) over the global mesh, the one owner
   of that rule (``train.batch_size`` splits evenly over processes, their devices and
   ``train.grad_accum_steps`` microbatches; the loader calls it for its per-process rows);
   then identical configs in every process, one shared workdir, and a checkpoint there
   written by the same number of processes.
3. ``data_checks.check_dataset_dir``, after staging (``data.stage_from``) if any: every shard of
   this process's read plan is present.
4. ``--verify_data`` only (``data_checks.verify_shards``): the sha256 of those shards.
5. ``train.build_setup``: :func:`check_model_fits_dataset` (here, through
   ``model.resolve_model_config``) against the dataset's ``metadata.json``. It also runs 1 and
   :func:`check_batch` again, for library callers (tests, tools); both are cheap.
"""

from __future__ import annotations

import os

from lmscale_jax.errors import ConfigError


def _positive(section, key: str, where: str) -> None:
  value = section[key]
  if int(value) <= 0:
    raise ConfigError(f"{where}.{key}={value}: expected a positive integer")


def _one_of(value, options, key: str) -> None:
  if value not in options:
    raise ConfigError(f"{key}={value!r}: expected one of {list(options)}")


def check_config(config) -> None:
  """Step 1: every value on its own (raises :class:`ConfigError` naming the key)."""
  from lmscale_jax import optim, steps  # the modes are defined where they are implemented

  t = config.train
  for key in ("batch_size", "steps", "log_every", "eval_every", "eval_batches",
              "grad_accum_steps", "max_consecutive_nonfinite"):
    _positive(t, key, "train")
  for key in ("every", "keep"):
    _positive(config.checkpoint, key, "checkpoint")
  _one_of(t.schedule, optim.SCHEDULES, "train.schedule")
  _one_of(t.nonfinite, optim.NONFINITE_MODES, "train.nonfinite")
  _one_of(t.grad_allreduce_dtype, sorted(steps.REDUCE_DTYPES), "train.grad_allreduce_dtype")
  _one_of(t.dropout_rng, steps.DROPOUT_RNGS, "train.dropout_rng")
  parse_steps(t.inject_nonfinite_steps, "train.inject_nonfinite_steps")


def parse_steps(text, key: str) -> tuple[int, ...]:
  """``"3,7"`` -> ``(3, 7)`` (the fault-injection step list)."""
  try:
    steps = tuple(int(x) for x in str(text).replace(" ", "").split(",") if x)
  except ValueError:
    raise ConfigError(f"{key}={text!r}: expected comma-separated step numbers") from None
  if any(s <= 0 for s in steps):
    raise ConfigError(f"{key}={text!r}: step numbers start at 1")
  return steps


def check_batch(batch_size: int, *, processes: int = 1, devices_per_process: int = 1,
                accum_steps: int = 1) -> int:
  """Step 2: the one rule for splitting ``train.batch_size``: every device of every process
  gets the same whole number of rows, and each device's rows split into ``accum_steps``
  microbatches. Returns the rows per process."""
  batch, devices = int(batch_size), int(processes) * int(devices_per_process)
  if batch <= 0 or batch % devices:
    raise ConfigError(
        f"train.batch_size={batch} is not divisible by the {devices} global devices "
        f"({processes} process{'es' if processes > 1 else ''} × {devices_per_process}): "
        "every device must get the same number of rows")
  per_device = batch // devices
  if per_device % int(accum_steps):
    raise ConfigError(f"train.batch_size={batch} gives {per_device} sequences per device, "
                      f"not divisible by train.grad_accum_steps={accum_steps}")
  return batch // int(processes)


def check_model_fits_dataset(model_config, meta) -> None:
  """Step 3: ``model.vocab_size`` / ``model.seq_len`` are 0 (take the dataset's) or equal to
  the dataset's."""
  from lmscale_jax import dataset

  mpath = os.path.join(meta.path, dataset.METADATA)
  for key, meta_value in (("vocab_size", meta.vocab_size), ("seq_len", meta.seq_len)):
    value = model_config[key]
    if value and value != meta_value:
      raise ConfigError(
          f"model.{key}={value} disagrees with the dataset's {key}={meta_value} ({mpath}); set "
          f"model.{key}=0 to take it from the dataset")
