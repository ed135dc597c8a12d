"""The largest per-device batch whose training step fits a device-memory budget, per memory
lever (lmscale max-batch): peak memory from the compiler, nothing run.

The jitted training step is lowered with abstract (shape-only) state and batch and compiled;
``compiled.memory_analysis()`` gives the peak (``flops.peak_bytes``). The step's memory is
near-affine in the batch, so two compilations fit it and a secant/bisection search finds the
boundary in a few more (:func:`max_batch`).

JAX is imported only where a step is compiled: the backend's device count and XLA flags must
be set before (:func:`configure_backend`), and loading a config needs no JAX at all
(benchmarks/bench_step.py reads the shapes through ``config.loader.load``).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import time
from typing import Callable

from lmscale_jax.config import loader
from lmscale_jax.errors import UserError
from lmscale_jax.study.host import ROOT, checkout_importable


# Model shapes of the table; "bert1b" is BERT-large's recipe widened to ~1.05B parameters
# (20 x 2048, 16 heads of 128, FFN 8192).
TABLE_MODELS = {
    "bert120m": ("configs/bert120m.py", {}),
    "bert350m": ("configs/bert350m.py", {}),
    "bert1b": ("configs/bert350m.py", {"model.layers": 20, "model.hidden": 2048,
                                        "model.heads": 16, "model.ffn": 8192}),
}
TABLE_LEVERS = "plain,remat_dots,remat_full,accum4,fsdp"


class MaxBatchError(UserError):
  """A lever or a choice of models that cannot be measured: one line."""


@dataclasses.dataclass(frozen=True)
class MaxBatchOptions:
  """lmscale max-batch's flags, as its parser leaves them (its destinations' names)."""
  config: str | None
  sets: list            # KEY=VALUE overrides
  name: str | None
  table: bool
  models: str           # comma-separated TABLE_MODELS names
  levers: str | None    # comma-separated; None: plain, or TABLE_LEVERS with table
  budget_gb: float
  seq: int
  vocab: int
  devices: int
  probe: str            # "4,8": the two fit points, in steps
  max_batch: int
  granularity: int
  fit_only: bool
  json: str | None
  render: str | None


def say(line: str) -> None:
  """A row as soon as it is measured: a long table run shows (and keeps) what it finished."""
  print(line, flush=True)


# ----------------------------------------------------------------------------- configs
def apply_lever(config, lever: str):
  """``config`` (a copy) with ``lever`` ("remat_full+accum4", …) applied."""
  c = copy.deepcopy(config)
  for part in lever.split("+"):
    if part == "plain":
      continue
    if part.startswith("remat_"):
      c.train.remat = part.removeprefix("remat_")
    elif part.startswith("accum"):
      c.train.grad_accum_steps = int(part.removeprefix("accum"))
    elif part == "fsdp":
      c.train.fsdp = True
    elif part == "bf16reduce":
      c.train.grad_allreduce_dtype = "bfloat16"
    else:
      raise MaxBatchError(f"unknown lever {part!r}")
  return c


def configure_backend(devices: int) -> None:
  """Environment for the backend, before JAX initialises (it reads it once)."""
  if devices:  # the CPU device count is fixed when jax starts
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["JAX_NUM_CPU_DEVICES"] = str(devices)
  if os.environ.get("JAX_PLATFORMS") == "cpu":
    # XLA:CPU: the memory-minimizing scheduler (the default concurrency-optimized one realises
    # no remat saving at all) and no LLVM optimisation (buffer sizes do not depend on it;
    # compiles ~2x faster).
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_cpu_enable_concurrency_optimized_scheduler=false"
                               " --xla_backend_optimization_level=0").strip()


# ----------------------------------------------------------------------------- compiling
class Probe:
  """Compiles the training step of ``config`` at a per-device batch; caches peak bytes."""

  def __init__(self, config, seq: int, vocab: int):
    import jax

    from lmscale_jax.model import flops
    from lmscale_jax.store import dataset
    from lmscale_jax.pretrain import mlm, trainer

    self.jax, self.train, self.steps, self.flops = jax, trainer, mlm, flops
    self.config, self.devices = config, jax.device_count()
    self.meta = dataset.DatasetMeta.synthetic(seq, vocab)
    self.cache: dict[int, dict] = {}
    self.compile_seconds = 0.0

  def estimate(self, per_device: int) -> int:
    """flops.memory_estimate_bytes at this batch (no compilation)."""
    c = copy.deepcopy(self.config)
    c.train.batch_size = per_device * self.devices
    return int(self.train.build_setup(c, self.meta).memory_bytes)

  def __call__(self, per_device: int) -> dict:
    if per_device not in self.cache:
      c = copy.deepcopy(self.config)
      c.train.batch_size = per_device * self.devices
      s = self.train.build_setup(c, self.meta)
      st = self.steps.build_steps(c, s.model_cfg, s.predictions)
      batch = self.flops.abstract_batch(c.train.batch_size, self.meta.seq_len, s.predictions,
                                        st.batch_sharding)
      t0 = time.perf_counter()
      m = st.train_step.lower(st.abstract_state, batch).compile().memory_analysis()
      self.compile_seconds += time.perf_counter() - t0
      self.cache[per_device] = {
          "peak": self.flops.peak_bytes(m), "temp": int(m.temp_size_in_bytes),
          "arguments": int(m.argument_size_in_bytes), "alias": int(m.alias_size_in_bytes),
          "params": s.param_count, "estimate": int(s.memory_bytes)}
    return self.cache[per_device]


# ----------------------------------------------------------------------------- the search
def max_batch(probe: Probe, budget: int, accum: int, probes=(4, 8), limit: int = 4096,
              granularity: int = 1) -> dict:
  """Largest per-device batch (a multiple of ``accum`` and ``granularity``) with peak <=
  ``budget``; 0 if even the smallest does not fit.

  Peak memory grows with the batch (monotone, near-affine). Starting from the affine fit
  through the two probes, each step predicts the boundary by a secant through the known points
  nearest to the budget (alternating with plain bisection once it is bracketed, so a curved
  profile cannot stall it) until the bracket [fits, does not fit] is one step wide.
  """
  step = math.lcm(accum, granularity)
  known: dict[int, float] = {}

  def peak(b: int) -> float:
    if b not in known:
      known[b] = probe(b)["peak"]
    return known[b]

  b1, b2 = (step * p for p in probes)
  per_seq = max((peak(b2) - peak(b1)) / (b2 - b1), 1.0)
  fixed = peak(b1) - per_seq * b1
  found = {"fixed_bytes": fixed, "bytes_per_sequence": per_seq, "step": step}
  top = limit // step * step
  down = lambda x: int(x) // step * step
  b = min(max(step, down((budget - fixed) / per_seq)), top)
  for i in range(64):
    peak(b)
    fit = [k for k, v in known.items() if v <= budget]
    over = [k for k, v in known.items() if v > budget]
    lo, hi = max(fit, default=None), min(over, default=None)
    if hi is not None and hi <= step:
      return {"max_per_device": 0, **found}
    if lo is not None and (lo >= top or (hi is not None and hi - lo <= step)):
      break
    if lo is not None and hi is not None:
      if i % 2:  # bisection
        b = down((lo + hi) // 2)
      else:  # secant through the bracket's ends
        b = down(lo + (budget - peak(lo)) * (hi - lo) / max(peak(hi) - peak(lo), 1.0))
      b = min(max(b, lo + step), hi - step)
    elif lo is not None:  # everything fits so far: extrapolate up from the two largest
      a, c = sorted(fit)[-2:]
      slope = max((peak(c) - peak(a)) / (c - a), 1.0)
      b = min(max(down(lo + (budget - peak(lo)) / slope), lo + step), top)
    else:  # nothing fits yet: extrapolate down from the two smallest
      a, c = sorted(over)[:2] if len(over) > 1 else (b1, hi)
      slope = max((peak(c) - peak(a)) / max(c - a, 1), 1.0)
      b = max(min(down(hi - (peak(hi) - budget) / slope), hi - step), step)
  return {"max_per_device": lo or 0, **found}


def fit_only(probe: Probe, budget: int, accum: int, probes=(4, 8),
             granularity: int = 1) -> dict:
  """The affine fit through two compilations and the batch it predicts (not verified)."""
  step = math.lcm(accum, granularity)
  b1, b2 = (step * p for p in probes)
  m1, m2 = probe(b1)["peak"], probe(b2)["peak"]
  per_seq = max((m2 - m1) / (b2 - b1), 1.0)
  fixed = m1 - per_seq * b1
  return {"max_per_device_fit": max(0, int((budget - fixed) // per_seq) // step * step),
          "fixed_bytes": fixed, "bytes_per_sequence": per_seq, "step": step}


# ----------------------------------------------------------------------------- the table
def models(o: MaxBatchOptions) -> tuple[list, list[str]]:
  """[(label, config)] to measure and the levers to measure each with."""
  if not o.table and not o.config:
    raise MaxBatchError("give --config or --table")
  # Relative paths from the checkout, with it importable: as a run loads its config.
  with checkout_importable():
    if o.table:
      base = []
      for name in o.models.split(","):
        path, overrides = TABLE_MODELS[name]
        sets = [f"{k}={v}" for k, v in overrides.items()] + o.sets
        base.append((name, loader.load(path, sets=sets, root=ROOT)))
      return base, (o.levers or TABLE_LEVERS).split(",")
    name = o.name or os.path.splitext(os.path.basename(o.config))[0]
    return ([(name, loader.load(o.config, sets=o.sets, root=ROOT))],
            (o.levers or "plain").split(","))


def measure(o: MaxBatchOptions, config, budget: int, probes: tuple) -> dict:
  """One (model, lever) entry: the search's (or fit's) result, at what cost."""
  probe = Probe(config, o.seq, o.vocab)
  t0 = time.perf_counter()
  accum = int(config.train.grad_accum_steps)
  if o.fit_only:
    result = fit_only(probe, budget, accum, probes, o.granularity)
    b, at = result["max_per_device_fit"], {}
  else:
    result = max_batch(probe, budget, accum, probes, o.max_batch, o.granularity)
    b = result["max_per_device"]
    at = probe(b) if b else {}
  return {**result, "peak_gb": at.get("peak", 0) / 2**30,
          "estimate_gb": probe.estimate(b) / 2**30 if b else 0.0,
          "params": next(iter(probe.cache.values()))["params"],
          "compiles": len(probe.cache), "seconds": time.perf_counter() - t0,
          "points": {str(k): v["peak"] for k, v in sorted(probe.cache.items())}}


def run(o: MaxBatchOptions, log: Callable[[str], None] = say) -> list[dict]:
  """Every (model, lever) entry, each logged as a JSON line and appended to ``o.json`` as it
  finishes (a long table run keeps what it finished)."""
  import jax

  base, levers = models(o)
  budget = int(o.budget_gb * 2**30)
  probes = tuple(int(x) for x in o.probe.split(","))
  device = jax.devices()[0]
  rows = []
  for name, config in base:
    config.model.vocab_size = 0  # from the synthetic metadata (--vocab)
    config.model.seq_len = 0
    for lever in levers:
      c = apply_lever(config, lever)
      row = {"model": name, "lever": lever, "seq": o.seq, "vocab": o.vocab,
             "budget_gb": o.budget_gb, "backend": jax.default_backend(),
             "device": device.device_kind, "devices": jax.device_count()}
      if c.train.fsdp and jax.device_count() == 1:
        row["skipped"] = "fsdp needs more than one device (--devices N on CPU)"
      else:
        row.update(measure(o, c, budget, probes))
      rows.append(row)
      log(json.dumps(row))
      if o.json:
        with open(o.json, "a") as f:
          f.write(json.dumps(row) + "\n")
  return rows


def read_rows(path: str) -> list[dict]:
  """The rows of a ``--json`` file."""
  return [json.loads(line) for line in open(path) if line.strip()]


def summary(o: MaxBatchOptions, rows: list[dict]) -> str:
  """The line above the table: budget, shapes, the devices that compiled."""
  import jax

  d = rows[0] if rows else {}
  return (f"budget {o.budget_gb:g} GiB per device, seq {o.seq}, vocab {o.vocab}, "
          f"{jax.device_count()} x {d.get('device', '?')} ({jax.default_backend()})")


def table(rows: list[dict]) -> str:
  out = ["| model | lever | max batch / device | peak GiB at it | analytic estimate GiB | "
         "GiB / sequence | fixed GiB | compiles |", "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    if "skipped" in r:
      out.append(f"| {r['model']} | {r['lever']} | n/a: {r['skipped']} | | | | | |")
      continue
    best = (r["max_per_device"] if "max_per_device" in r
            else f"{r['max_per_device_fit']} (fit)")
    peak = f"{r['peak_gb']:.3g}" if "max_per_device" in r else "-"
    out.append(f"| {r['model']} | {r['lever']} | {best} | {peak} | "
               f"{r['estimate_gb']:.3g} | {r['bytes_per_sequence'] / 2**30:.3g} | "
               f"{r['fixed_bytes'] / 2**30:.3g} | {r['compiles']} |")
  return "\n".join(out)
