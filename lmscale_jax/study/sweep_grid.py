"""The grid of lmscale sweep: its points, each point's config overrides and identity, what a
finished run measured (from its metrics.jsonl), why a failed one failed, and the results file.

No JAX here: the sweep process only plans, launches and reads; compilation happens in the
processes it starts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import re
import statistics

from lmscale_jax.config import loader
from lmscale_jax.errors import UserError
from lmscale_jax.store import file_io

# Keys a point sets itself: --set may not change them (the sweep's own flags do).
GRID_KEYS = {"data.path": "--data", "data.workers": "--workers", "train.batch_size": "--batch",
             "train.grad_accum_steps": "--accum", "train.steps": "--steps",
             "train.log_every": "--log-every", "data.autotune": "--workers"}
# Medians of these metrics.jsonl fields make a row (metrics.throughput's names).
MEASURED = ("samples_per_sec", "tokens_per_sec", "mfu", "input_wait_frac", "step_time")


class SweepError(UserError):
  """A bad grid, flag or results file: one line naming it and what was expected."""


# ----------------------------------------------------------------------------- configs
def load_config(path: str, sets, root: str = ""):
  """``path`` (relative to ``root``)'s get_config() (``config.loader.load``) with the (key,
  value) ``sets`` applied: the sweep's own lines, naming the file and both flags that set
  keys (--set, --model); an unknown key names the closest one."""
  config = loader.load(path, root=root)
  keys = loader.dotted_keys(config)
  for key, text in sets:  # typed as --config.KEY=VALUE is (config.loader)
    if key not in keys:
      near = loader.closest(key, keys)
      raise SweepError(f"config key {key!r} (--set/--model) does not exist in {path}"
                       + (f"; did you mean {near!r}?" if near else ""))
    *sections, leaf = key.split(".")
    node = config
    for section in sections:
      node = node[section]
    node[leaf] = loader.parse_value(node[leaf], text, key)
  return config


def key_values(text: str, flag: str) -> list[tuple[str, str]]:
  pairs = []
  for item in filter(None, text.split(",")):
    key, eq, value = item.partition("=")
    if not eq or key.count(".") != 1:
      raise SweepError(f"{flag} {text!r}: expected section.key=value[,section.key=value…]")
    pairs.append((key, value))
  return pairs


# ----------------------------------------------------------------------------- points
@dataclasses.dataclass(frozen=True)
class Plan:
  """What every point shares."""
  data: str
  steps: int
  log_every: int
  sets: tuple                 # ((key, value), …) from --set
  env: tuple                  # ("KEY=VALUE", …) from --env
  launcher: str               # local | slurm
  devices_per_process: int    # local on CPU
  gpus: int                   # GPUs on this machine (local: one per process if enough)
  tag: str = ""


@dataclasses.dataclass(frozen=True)
class Point:
  config: str
  model: str                 # label: the config's stem, or "stem/variant"
  model_sets: tuple          # ((key, value), …) of the --model variant
  processes: int
  workers: int
  batch: int                 # per-device microbatch
  accum: int


def model_variants(specs) -> list[tuple[str, tuple]]:
  """``--model LABEL:key=v,…`` values → [(label, sets)]; none: the config as it is."""
  if not specs:
    return [("", ())]
  out = []
  for spec in specs:
    label, colon, sets = spec.partition(":")
    if not colon or not label:
      raise SweepError(f"--model {spec!r}: expected LABEL:key=value[,key=value…]")
    out.append((label, tuple(key_values(sets, "--model"))))
  return out


def grid(configs, models, processes, workers, batches, accums) -> list[Point]:
  points = []
  for path, (label, sets), p, w, b, k in itertools.product(
      configs, model_variants(models), processes, workers, batches, accums):
    stem = os.path.splitext(os.path.basename(path))[0]
    points.append(Point(path, f"{stem}/{label}" if label else stem, sets, p, w, b, k))
  return points


def devices(plan: Plan, pt: Point) -> int:
  """Devices of a point's job: launch/local.sh gives each process one GPU where there are
  enough, else DEVICES_PER_PROCESS CPU devices; Slurm one GPU per task."""
  cpu = plan.launcher == "local" and plan.gpus < pt.processes
  return pt.processes * (plan.devices_per_process if cpu else 1)


def point_sets(plan: Plan, pt: Point) -> list[tuple[str, str]]:
  """Every config override of a point, in the order main.py applies them: short and bounded
  (evaluation of one batch and a checkpoint at the last step only)."""
  steps = str(plan.steps)
  return [("data.path", plan.data), ("data.workers", str(pt.workers)),
          ("data.autotune", "False"),
          ("train.batch_size", str(pt.batch * pt.accum * devices(plan, pt))),
          ("train.grad_accum_steps", str(pt.accum)), ("train.steps", steps),
          ("train.log_every", str(plan.log_every)), ("train.eval_every", steps),
          ("train.eval_batches", "1"), ("checkpoint.every", steps),
          *pt.model_sets, *plan.sets]


def point_key(plan: Plan, pt: Point) -> str:
  """A point's identity in the results file: everything that changes what it measures."""
  ident = {"point": dataclasses.asdict(pt), "sets": point_sets(plan, pt), "env": plan.env,
           "launcher": plan.launcher, "devices": devices(plan, pt), "tag": plan.tag}
  return hashlib.sha1(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- a finished run
def summarize(workdir: str) -> dict:
  """Medians of :data:`MEASURED` over the training windows of metrics.jsonl after the first
  (its start-up and first-step compilation dominate a short run), and that first step's time."""
  path = os.path.join(workdir, "metrics.jsonl")
  rows = []
  if os.path.exists(path):
    for line in open(path):
      try:
        row = json.loads(line)
      except ValueError:  # a torn last line of a killed run
        continue
      if row.get("samples_per_sec") is not None:
        rows.append(row)
  rows.sort(key=lambda r: r["step"])
  out = {"windows": max(0, len(rows) - 1),
         "first_step_seconds": rows[0].get("first_step_seconds") if rows else None}
  for k in MEASURED:
    values = [r[k] for r in rows[1:] if r.get(k) is not None]
    out[k] = statistics.median(values) if values else None
  return out


_OOM = re.compile(r"RESOURCE_EXHAUSTED|[Oo]ut of memory|\bOOM\b")
_PREFIX = re.compile(r"^\[\d+\] ")  # launch/*.sh prefix every line with the process id


def failure_reason(rc: int, log: str, timed_out: bool, timeout: int) -> str:
  """One line: timeout, out-of-memory, the run's own ``error:`` line, a launch failure, or
  the exit status with the last line of output."""
  lines = [_PREFIX.sub("", line).strip() for line in log.splitlines() if line.strip()]
  last = lines[-1] if lines else "no output"
  if timed_out:
    return f"timeout: still running after --timeout {timeout} s"
  oom = next((line for line in lines if _OOM.search(line)), None)
  if oom:
    return f"out-of-memory: {oom}"[:300]
  if rc in (137, -9):
    return f"killed (exit {rc}: SIGKILL, e.g. the kernel's out-of-memory killer)"
  error = next((line for line in lines if line.startswith("error:")), None)
  if error:
    return error[:300]
  if rc in (126, 127):
    return f"launch failed (exit {rc}): {last}"[:300]
  return f"exit status {rc}: {last}"[:300]


# ----------------------------------------------------------------------------- results file
def read_rows(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  rows = []
  for n, line in enumerate(open(path), 1):
    if line.strip():
      try:
        rows.append(json.loads(line))
      except ValueError:
        raise SweepError(f"{path}:{n}: not a JSON line (a lmscale sweep results file "
                         "expected)") from None
      if not isinstance(rows[-1], dict) or "key" not in rows[-1]:
        raise SweepError(f"{path}:{n}: a row without 'key': not a lmscale sweep results file")
  return rows


def save_row(path: str, row: dict) -> None:
  """One row per point (replacing the point's earlier one); the file is written whole, then
  renamed, so a killed sweep never leaves half a row."""
  rows = [r for r in read_rows(path) if r.get("key") != row["key"]] + [row]
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  file_io.atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in rows).encode())
