"""The run directory (``--workdir``) outside its checkpoints: one run at a time
(``.lock``), ``config.json`` and what a resume may change in it, ``run_state.json``.

``workdir/config.json`` is the config of the latest run, with ``changes``: what each resume
changed that alters results, from which step (:func:`check_config_change`, the rules above
:data:`SHAPE_KEYS`). A resume with an incompatible model, optimizer state or (without
``--allow_config_change``) data stream or optimisation is refused. ``workdir/.lock``
(:func:`lock_workdir`) keeps a second run off a workdir in use.
"""

from __future__ import annotations

import json
import os

from lmscale_jax.cluster import run_state
from lmscale_jax.config import checks as config_checks
from lmscale_jax.config import legacy
from lmscale_jax.errors import UserError
from lmscale_jax.store import dataset, dir_lock
from lmscale_jax.train.checkpoint import IncompatibleCheckpoint, step_dir

# What a resume may change, one list per rule (config.json against this run's config; keys as
# "section.key"): the parameter shapes (SHAPE_KEYS, of the resolved model) and the layout of
# the optimizer state (STATE_KEYS) never; what changes the data stream or the optimisation
# (RESULT_KEYS) only with --allow_config_change, recorded in config.json's "changes";
# train.steps (how a finished run is extended) always, recorded too; NEUTRAL_KEYS (logging,
# checkpointing, the loader's speed, paths, memory levers) silently. A key in no list counts as
# a RESULT_KEY, so a new key is never resumed over silently before someone classifies it.
SHAPE_KEYS = ("layers", "hidden", "heads", "ffn", "vocab_size", "seq_len", "type_vocab_size",
              "pre_ln")
STATE_KEYS = ("train.nonfinite",)  # skip mode wraps the optimizer state (optax.apply_if_finite)
RESULT_KEYS = (
    "train.batch_size", "train.learning_rate", "train.warmup_steps", "train.schedule",
    "train.end_lr_frac", "train.weight_decay", "train.b1", "train.b2", "train.eps",
    "train.clip_norm", "train.seed", "train.grad_accum_steps", "train.grad_allreduce_dtype",
    "train.dropout_rng", "train.inject_nonfinite_steps",
    "data.seed", "data.mask_prob", "data.max_predictions", "data.shard_by_process",
    "data.on_corrupt", "model.dropout", "model.attention_dropout", "model.dtype",
    "model.layer_norm_eps", "model.packed_attention")
EXTEND_KEYS = ("train.steps",)
NEUTRAL_KEYS = (
    "train.log_every", "train.eval_every", "train.eval_batches", "train.remat", "train.fsdp",
    "train.grad_allreduce",
    "train.max_consecutive_nonfinite", "checkpoint", "metrics", "distributed", "data.path",
    "data.workers", "data.prefetch_buffer", "data.read_threads", "data.stage_from",
    "data.stage_workers", "data.stage_timeout", "data.autotune", "data.autotune_max_workers",
    "data.autotune_target", "model.initializer_range", "model.attention_impl",
    "init_from",  # the weights of step 0 only: a resume restores its checkpoint instead
    *(f"model.{k}" for k in SHAPE_KEYS))  # shapes: compared on the resolved model instead
# Keys added after workdirs already existed (config/legacy.py): such a workdir resumes under the
# legacy value as unchanged (and under another as a change of the key's rule), instead of
# failing on "None -> value".
LEGACY_VALUES = legacy.VALUES


def resume_rule(key: str) -> str:
  """``"state"``, ``"result"``, ``"extend"`` or ``"neutral"``: what a resume does when ``key``
  ("section.key") differs from the workdir's config.json (see the lists above)."""
  for rule, keys in (("state", STATE_KEYS), ("extend", EXTEND_KEYS),
                     ("neutral", NEUTRAL_KEYS), ("result", RESULT_KEYS)):
    if any(key == k or key.startswith(f"{k}.") for k in keys):
      return rule
  return "result"


def _resolved(config, model_cfg) -> dict:
  return {"config": json.loads(config.to_json_best_effort()),
          "model": {k: model_cfg[k] for k in SHAPE_KEYS}}


def check_config_change(workdir: str, config, model_cfg, *, resume_step: int | None,
                        allow_change: bool = False) -> list[dict] | None:
  """Compares ``workdir/config.json`` with this run's config (the rules above SHAPE_KEYS).

  Returns None for a new workdir, else the changes to record in config.json: one
  ``{"step", "key", "from", "to"}`` per result or extend key that differs, ``step`` being the
  first step trained with the new value. Raises :class:`IncompatibleCheckpoint` (one line:
  the key, both values and the fix) for a change a resume cannot take. Only reads, so every
  process can call it before anything is written.
  """
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    old = json.load(f)
  new = _resolved(config, model_cfg)
  diff = {k: (old["model"].get(k), new["model"][k]) for k in SHAPE_KEYS
          if old["model"].get(k) != new["model"][k]}
  if diff:
    desc = ", ".join(f"model.{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in diff.items())
    raise IncompatibleCheckpoint(
        f"{workdir} holds a run of a different model ({desc}); use a new --workdir or the "
        "original config")
  if resume_step is None:  # no checkpoint yet: nothing saved would be reinterpreted
    return []
  before = config_checks.flat_keys(old.get("config", {}))
  now = config_checks.flat_keys(new["config"])
  before = {**{k: v for k, v in LEGACY_VALUES.items() if k in now}, **before}
  changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
  by_rule = {k: resume_rule(k) for k in changed}
  state = [k for k in changed if by_rule[k] == "state"]
  if state:
    raise IncompatibleCheckpoint(_change_message(
        workdir, resume_step, state, before, now,
        "it changes the layout of the saved optimizer state: use the original value or a new "
        "--workdir"))
  result = [k for k in changed if by_rule[k] == "result"]
  if result and not allow_change:
    raise IncompatibleCheckpoint(_change_message(
        workdir, resume_step, result, before, now,
        "it changes the data stream or the optimisation of the saved run: use the original "
        "value, a new --workdir, or --allow_config_change to continue with the change "
        "(recorded in config.json)"))
  return [{"step": resume_step + 1, "key": k, "from": before.get(k), "to": now.get(k)}
          for k in changed if by_rule[k] in ("result", "extend")]


def _change_message(workdir, step, keys, before, now, why) -> str:
  key = keys[0]
  more = f" (and {', '.join(keys[1:])})" if len(keys) > 1 else ""
  return (f"{workdir}: its checkpoint at step {step} was trained with {key}="
          f"{before.get(key)!r}, this run has {key}={now.get(key)!r}{more}; {why}")


def save_config(workdir: str, config, model_cfg, changes: list[dict] | None,
                is_writer: bool) -> None:
  """Writes ``workdir/config.json``: this run's config, and the earlier runs' ``changes`` plus
  ``changes`` (from :func:`check_config_change`; None = a new workdir). A resume under an
  unchanged config leaves the file as it is."""
  if not is_writer:
    return
  path = os.path.join(workdir, "config.json")
  resolved = _resolved(config, model_cfg)
  if changes is not None:
    with open(path) as f:
      old = json.load(f)
    same = config_checks.flat_keys(old.get("config", {})) == \
        config_checks.flat_keys(resolved["config"])
    if same and not changes:
      return
    resolved["changes"] = old.get("changes", []) + changes
  os.makedirs(workdir, exist_ok=True)
  dataset.atomic_write_json(path, resolved)


LOCK_FILE = ".lock"


class WorkdirError(UserError, ValueError):
  """``--workdir`` cannot be used: it is a file, below one, or not writable."""


class WorkdirBusy(UserError, RuntimeError):
  """Another run holds ``workdir/.lock``."""


# The workdirs this process holds: real path -> the open lock file (the lock lives as long as
# that file description, i.e. until release or process exit, even a kill -9).
_held: dict[str, int] = {}


def make_workdir(workdir: str) -> None:
  """Creates ``workdir`` (and parents), or one line saying why it cannot be one."""
  try:
    os.makedirs(workdir, exist_ok=True)
  except FileExistsError:
    raise WorkdirError(f"--workdir {workdir} is a file; expected a directory (give a new "
                       "or existing directory)") from None
  except NotADirectoryError:
    parent = os.path.abspath(workdir)
    while parent != os.path.dirname(parent) and not os.path.exists(parent):
      parent = os.path.dirname(parent)
    raise WorkdirError(f"--workdir {workdir} is below {parent}, which is a file, not a "
                       "directory; give a directory path") from None
  except PermissionError as e:
    raise WorkdirError(f"--workdir {workdir}: cannot create it ({e.strerror}: "
                       f"{e.filename}); give a writable directory") from None


def lock_workdir(workdir: str) -> bool:
  """Takes ``workdir/.lock`` (``store/dir_lock``: ``fcntl.flock``, exclusive) for this process,
  before anything in the workdir is touched: two runs on one workdir would delete each other's
  in-flight checkpoints (Orbax cleans tmp directories at start-up) and mix their metrics.
  Returns True if this call took it, False if this process already holds it. Raises
  :class:`WorkdirBusy` naming the holder's pid and host (written into the lock file), touching
  nothing else.

  A multi-process job: process 0 takes it for everyone (``main`` tells the others through
  ``distributed.agree``). ``flock`` is released by the kernel when the holder exits, however
  it ends, so a crashed run never leaves a stale lock; it works on local disks and on NFSv4
  (where Linux emulates it with a POSIX lock on the server).
  """
  key = os.path.realpath(workdir)
  if key in _held:
    return False
  make_workdir(workdir)
  path = os.path.join(workdir, LOCK_FILE)
  try:
    _held[key] = dir_lock.acquire(path)
  except dir_lock.Busy as e:
    raise WorkdirBusy(
        f"--workdir {workdir} is in use by another run ({e.holder}; lock "
        f"{path}): wait for it to end or stop it, or give this run another --workdir") from None
  except dir_lock.Unusable as e:
    if e.step == "open":
      raise WorkdirError(f"--workdir {workdir}: cannot open {path} ({e.strerror}); give a "
                         "writable directory") from None
    raise WorkdirError(f"--workdir {workdir}: cannot lock {path} ({e.strerror}); the file "
                       "system may not support flock: use a local or NFSv4 directory") from None
  return True


def unlock_workdir(workdir: str) -> None:
  """Releases a lock :func:`lock_workdir` took (the file stays, as a record of the last run's
  holder)."""
  fd = _held.pop(os.path.realpath(workdir), None)
  if fd is not None:
    dir_lock.release(fd)


RUN_STATE = run_state.FILE


def write_run_state(workdir: str, state: str, step: int, total_steps: int) -> None:
  """``workdir/run_state.json``: "running", or how the last run ended ("finished" or
  "preempted"), with the step reached and the Slurm job id and restart count of the
  allocation (``lmscale_jax/cluster/run_state.py``), so a job script can decide to requeue itself
  (launch/slurm.sbatch) without parsing logs; a crash leaves "running"."""
  dataset.atomic_write_json(os.path.join(workdir, RUN_STATE), run_state.record(
      state, step, total_steps, step_dir(workdir, step)))
