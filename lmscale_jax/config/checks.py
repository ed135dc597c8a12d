"""Every check of the configuration, and the order they run in before any process reads data.

``main`` runs, in this order (each failure is one ``error:`` line; multi-process: raised in
every process, naming the process and host it concerns):

1. ``train.startup.check_before_runtime``, before the runtime starts: :func:`check_config`
   (here: each value on its own — every numeric key finite, of its type and in its range;
   known modes (``config.modes``); renamed keys; the model's own rules,
   :func:`check_model_config`), then the start model of ``init_from``. So a typo never waits
   for start-up, the workdir lock or staging.
   Then, once the runtime has started and before anything in the workdir is touched,
   ``train.workdir.lock_workdir``: process 0 takes ``workdir/.lock`` for the job (the others
   learn the outcome through ``cluster.distributed.agree``); a workdir in use is one line
   naming the holder's pid and host.
2. ``train.preflight.preflight``: :func:`check_batch` (here) over the global mesh, the one
   owner of that rule (``train.batch_size`` splits evenly over processes, their devices and
   ``train.grad_accum_steps`` microbatches; the loader calls it for its per-process rows);
   then identical configs in every process, one shared workdir, and a checkpoint there
   written by the same number of processes.
3. ``input.dataset_checks.check_dataset_dir``, after staging (``data.stage_from``) if any:
   every shard of this process's read plan is present.
4. ``--verify_data`` only (``input.dataset_checks.verify_shards``): the sha256 of those shards.
5. ``pretrain.trainer.build_setup``: :func:`check_model_fits_dataset` (here, through
   ``model.bert.resolve_model_config``) against the dataset's ``metadata.json``. For library
   callers (tests, tools), which pass through neither 1 nor 2, it runs 1 and :func:`check_batch`
   itself; ``main`` says they ran (``checked=True``), so each runs once per command. Then,
   in ``pretrain.trainer.train_and_evaluate`` before the first step: a workdir already past
   ``train.steps`` is refused, and ``train.run_record.check_config_change`` compares
   ``config.json`` with this config (its key lists say which changes a resume refuses, takes
   with ``--allow_config_change``, or takes silently).

A config read back from an old ``config.json`` is completed first (``config.legacy``), so no
rule here needs a fallback for a missing key.
"""

from __future__ import annotations

import math

from lmscale_jax.config import legacy, modes
from lmscale_jax.errors import ConfigError


# Every numeric key and the values it may take, checked where the config is parsed so that no
# value reaches the step that cannot be right (a NaN or negative learning rate trains on
# silently otherwise). Integers: (key, minimum). Floats: (key, low, high, low_open, high_open).
_INTS = (
    *[(f"train.{k}", 1) for k in ("batch_size", "steps", "log_every", "eval_every",
                                  "eval_batches", "grad_accum_steps",
                                  "max_consecutive_nonfinite")],
    ("train.warmup_steps", 0), ("train.seed", 0),
    ("checkpoint.every", 1), ("checkpoint.keep", 1),
    *[(f"model.{k}", 1) for k in ("layers", "hidden", "heads", "ffn", "type_vocab_size")],
    ("model.vocab_size", 0), ("model.seq_len", 0),  # 0 = from the dataset
    ("data.seed", 0), ("data.max_predictions", 0), ("data.workers", 0),
    ("data.prefetch_buffer", 1), ("data.read_threads", 1), ("data.stage_workers", 1),
    ("data.stage_timeout", 1), ("data.autotune_max_workers", 0),
)
_INF = float("inf")
_FLOATS = (
    ("train.learning_rate", 0.0, _INF, True, True),
    ("train.end_lr_frac", 0.0, 1.0, False, False),
    ("train.warmup_fraction", 0.0, 1.0, False, True),
    ("train.weight_decay", 0.0, _INF, False, True),
    ("train.b1", 0.0, 1.0, False, True),
    ("train.b2", 0.0, 1.0, False, True),
    ("train.eps", 0.0, _INF, True, True),
    ("train.clip_norm", 0.0, _INF, True, True),
    ("model.dropout", 0.0, 1.0, False, True),
    ("model.attention_dropout", 0.0, 1.0, False, True),
    ("model.layer_norm_eps", 0.0, _INF, True, True),
    ("model.initializer_range", 0.0, _INF, True, True),
    ("data.mask_prob", 0.0, 1.0, True, True),
    ("data.autotune_target", 0.0, 1.0, True, True),
    ("metrics.peak_tflops", 0.0, _INF, False, True),
)
# Keys renamed: the old spelling is refused with the new name (config.legacy keeps the table).
RENAMED = legacy.RENAMED


def _get(config, key: str):
  section, leaf = key.split(".")
  return config[section][leaf]


# The largest value of every integer key: steps reach the jitted step as its int32 counter and
# optax's schedules, seeds and sizes as int32 arrays, where a larger one was an 80-line
# OverflowError from inside jit (train.steps=2**31). No key needs more (2**31 steps of one
# millisecond are 25 days).
INT32_MAX = 2**31 - 1


def check_int(config, key: str, minimum: int) -> None:
  value = _get(config, key)
  if isinstance(value, bool) or not isinstance(value, int):
    raise ConfigError(f"{key}={value!r}: expected an integer >= {minimum} (got "
                      f"{type(value).__name__})")
  if value < minimum:
    what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    raise ConfigError(f"{key}={value}: expected {what}")
  if value > INT32_MAX:
    raise ConfigError(f"{key}={value}: expected an integer in [{minimum}, {INT32_MAX}] "
                      "(JAX takes steps, sizes and seeds as int32)")


def _range_text(low, high, low_open, high_open) -> str:
  if high == _INF:
    return f"{'>' if low_open else '>='} {low:g}"
  return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def check_float(config, key: str, low, high, low_open, high_open) -> None:
  value = _get(config, key)
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise ConfigError(f"{key}={value!r}: expected a number (got {type(value).__name__})")
  value = float(value)
  inside = (low < value if low_open else low <= value) and (
      value < high if high_open else value <= high)
  if not math.isfinite(value) or not inside:
    raise ConfigError(f"{key}={value}: expected a finite number "
                      f"{_range_text(low, high, low_open, high_open)}")


def one_of(value, options, key: str) -> None:
  if value not in options:
    raise ConfigError(f"{key}={value!r}: expected one of {list(options)}")


def check_config(config) -> None:
  """Step 1: every value on its own (raises :class:`ConfigError` naming the key)."""
  for old, new in RENAMED.items():
    section, leaf = old.split(".")
    if leaf in config[section]:
      raise ConfigError(f"{old} was renamed {new}: set --config.{new}=… (or {new} in the "
                        "config file) instead")
  for key, minimum in _INTS:
    check_int(config, key, minimum)
  for key, *bounds in _FLOATS:
    check_float(config, key, *bounds)
  t = config.train
  for value, options, key in (
      (t.schedule, modes.SCHEDULES, "train.schedule"),
      (t.nonfinite, modes.NONFINITE_MODES, "train.nonfinite"),
      (t.grad_allreduce_dtype, modes.DTYPES, "train.grad_allreduce_dtype"),
      (t.grad_allreduce, modes.GRAD_ALLREDUCE, "train.grad_allreduce"),
      (t.dropout_rng, modes.DROPOUT_RNGS, "train.dropout_rng"),
      (config.data.on_corrupt, modes.ON_CORRUPT, "data.on_corrupt"),
      (config.checkpoint.on_full, modes.ON_FULL, "checkpoint.on_full"),
      (config.model.packed_attention, modes.PACKED_ATTENTION, "model.packed_attention")):
    one_of(value, options, key)
  check_model_config(config.model, remat=t.remat)
  parse_steps(t.inject_nonfinite_steps, "train.inject_nonfinite_steps")


def check_model_config(model_config, *, remat: str) -> None:
  """The model's own values: its compute dtype, attention path, recomputation (``train.remat``)
  and heads that split the hidden size. Also run where a model config is resolved
  (``model.bert.resolve_model_config``), for library callers that never parsed a config."""
  one_of(model_config.dtype, modes.DTYPES, "model.dtype")
  one_of(model_config.attention_impl, modes.ATTENTION_IMPLS, "model.attention_impl")
  one_of(model_config.positions, modes.POSITIONS, "model.positions")
  one_of(model_config.norm, modes.NORMS, "model.norm")
  one_of(remat, modes.REMAT, "train.remat")
  if model_config.hidden % model_config.heads:
    raise ConfigError(f"model.hidden={model_config.hidden} is not divisible by "
                      f"model.heads={model_config.heads}: each head gets hidden/heads features")


def parse_steps(text, key: str) -> tuple[int, ...]:
  """``"3,7"`` -> ``(3, 7)`` (the fault-injection step list)."""
  try:
    steps = tuple(int(x) for x in str(text).replace(" ", "").split(",") if x)
  except ValueError:
    raise ConfigError(f"{key}={text!r}: expected comma-separated step numbers") from None
  if any(s <= 0 for s in steps):
    raise ConfigError(f"{key}={text!r}: step numbers start at 1")
  if any(s > INT32_MAX for s in steps):
    raise ConfigError(f"{key}={text!r}: step numbers end at {INT32_MAX} (the step counter is "
                      "int32)")
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
  the dataset's; ``model.packed_attention="segment"`` needs a dataset whose packed functions
  each start with [CLS] (format 2, or format 1 packed one per record)."""
  mpath = meta.metadata_path
  for key, meta_value in (("vocab_size", meta.vocab_size), ("seq_len", meta.seq_len)):
    value = model_config[key]
    if value and value != meta_value:
      raise ConfigError(
          f"model.{key}={value} disagrees with the dataset's {key}={meta_value} ({mpath}); set "
          f"model.{key}=0 to take it from the dataset")
  if model_config.packed_attention == "segment" and not meta.has_cls_per_segment:
    raise ConfigError(
        f"model.packed_attention='segment' needs a [CLS] before every packed function, and "
        f"{mpath} is format {meta.raw.get('format')!r} (one [CLS] per record): re-prepare the "
        "dataset (lmscale prepare binary / text put a [CLS] before every function) "
        "or set model.packed_attention=cross")
  if model_config.positions == "instruction" and not meta.has_instructions:
    raise ConfigError(
        f"model.positions='instruction' counts instructions by [NEXT], and {mpath} is a "
        f"{meta.raw.get('kind', 'text')} corpus without [NEXT] tokens: use it on a dataset made "
        "by lmscale prepare binary, or set model.positions=segment (or absolute)")


def flat_keys(tree: dict, prefix: str = "") -> dict:
  """A config as JSON (``json.loads(config.to_json_best_effort())``) -> ``{"section.key":
  value}``: how configs are compared (across processes, and a resume against config.json)."""
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(flat_keys(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat
