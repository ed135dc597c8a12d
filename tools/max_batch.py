"""The largest per-device batch whose training step fits a device-memory budget, per lever.

  python tools/max_batch.py --config configs/bert350m.py --budget-gb 80
  python tools/max_batch.py --table --budget-gb 80 --json out.jsonl   # 120M / 350M / 1B

Peak memory comes from the compiler, not from running anything: the jitted training step is
lowered with abstract (shape-only) state and batch and compiled, and
``compiled.memory_analysis()`` gives argument, output, alias and temporary sizes; the peak is
arguments + outputs - donated aliases + temporaries (``flops.peak_bytes``). Nothing is
allocated, so the 1B model is measured on any machine that can compile it.

Search: the step's memory is affine in the batch (state + per-sequence activations), so two
compilations (``--probe``, default 4 and 8 microbatch sequences) fit it, the fit predicts the
largest batch, and that prediction is then checked by compiling at it (and one more
sequence's worth above it), walking down or up until the boundary is found (usually 2-3 more
compilations). Batches are multiples of ``train.grad_accum_steps``.

The numbers are the backend's own: on a GPU they are XLA:GPU's buffer assignment with cuDNN
flash attention; on a CPU (here, CI) XLA:CPU's, with XLA attention that materialises the
[B,N,S,S] scores and a scheduler that realises less of the remat savings -- a CPU table
ranks the levers but is not a GPU budget. The runtime's own reservation (CUDA context, cuDNN
workspaces, allocator fragmentation) is not included: keep ``--budget-gb`` a few GB under the
card. ``train.fsdp`` needs several devices; on CPU ``--devices N`` simulates N.

Levers (``--levers``, comma-separated, ``+`` combines): plain, remat_dots, remat_full,
accumN (train.grad_accum_steps=N), fsdp, bf16reduce (train.grad_allreduce_dtype=bfloat16).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Model shapes of the table; "bert1b" is BERT-large's recipe widened to ~1.05B parameters
# (20 x 2048, 16 heads of 128, FFN 8192).
TABLE_MODELS = {
    "bert120m": ("configs/bert120m.py", {}),
    "bert350m": ("configs/bert350m.py", {}),
    "bert1b": ("configs/bert350m.py", {"model.layers": 20, "model.hidden": 2048,
                                        "model.heads": 16, "model.ffn": 8192}),
}
TABLE_LEVERS = "plain,remat_dots,remat_full,accum4,fsdp"


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--config", help="config file (configs/*.py)")
  ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                  help="config override, e.g. model.layers=20 (repeatable)")
  ap.add_argument("--name", help="model label in the output (default: the config's stem)")
  ap.add_argument("--table", action="store_true",
                  help=f"every model of {sorted(TABLE_MODELS)} with every lever")
  ap.add_argument("--models", default=",".join(TABLE_MODELS), help="--table models")
  ap.add_argument("--levers", default=None,
                  help=f"comma-separated levers (default plain; --table: {TABLE_LEVERS})")
  ap.add_argument("--budget-gb", type=float, default=80.0, help="device memory budget, GiB")
  ap.add_argument("--seq", type=int, default=512)
  ap.add_argument("--vocab", type=int, default=22016, help="vocabulary size (peer default)")
  ap.add_argument("--devices", type=int, default=0,
                  help="CPU only: simulate this many devices (needed for fsdp)")
  ap.add_argument("--probe", default="4,8", help="microbatch sizes of the two fit points")
  ap.add_argument("--max-batch", type=int, default=4096, help="search bound per device")
  ap.add_argument("--granularity", type=int, default=1,
                  help="batches are multiples of this (and of grad_accum_steps): fewer "
                       "compilations for a coarser answer")
  ap.add_argument("--fit-only", action="store_true",
                  help="two compilations per entry: report the affine fit's prediction "
                       "(max_per_device_fit), unverified")
  ap.add_argument("--json", help="append one JSON object per (model, lever) to this file")
  ap.add_argument("--render", metavar="JSONL", help="only print the table of a --json file")
  return ap.parse_args(argv)


def load_config(path: str, overrides: list[str]):
  import importlib.util

  spec = importlib.util.spec_from_file_location("max_batch_cfg", os.path.join(ROOT, path)
                                                if not os.path.isabs(path) else path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  c = mod.get_config()
  for item in overrides:
    key, value = item.split("=", 1)
    section, leaf = key.split(".")
    old = c[section][leaf]
    c[section][leaf] = type(old)(value) if not isinstance(old, bool) else value in ("1", "true",
                                                                                   "True")
  return c


def apply_lever(config, lever: str):
  """``config`` (a copy) with ``lever`` ("remat_full+accum4", …) applied."""
  import copy

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
      raise SystemExit(f"error: unknown lever {part!r}")
  return c


class Probe:
  """Compiles the training step of ``config`` at a per-device batch; caches peak bytes."""

  def __init__(self, config, seq: int, vocab: int):
    import jax

    from lmscale_jax import dataset, flops, steps, train

    self.jax, self.train, self.steps, self.flops = jax, train, steps, flops
    self.config, self.devices = config, jax.device_count()
    self.meta = dataset.DatasetMeta.synthetic(seq, vocab)
    self.cache: dict[int, dict] = {}
    self.compile_seconds = 0.0

  def estimate(self, per_device: int) -> int:
    """flops.memory_estimate_bytes at this batch (no compilation)."""
    import copy

    c = copy.deepcopy(self.config)
    c.train.batch_size = per_device * self.devices
    return int(self.train.build_setup(c, self.meta).memory_bytes)

  def __call__(self, per_device: int) -> dict:
    if per_device not in self.cache:
      import copy

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


def run(args) -> list[dict]:
  import jax

  base = []
  if args.table:
    for name in args.models.split(","):
      path, overrides = TABLE_MODELS[name]
      sets = [f"{k}={v}" for k, v in overrides.items()] + args.set
      base.append((name, load_config(path, sets)))
    levers = (args.levers or TABLE_LEVERS).split(",")
  else:
    if not args.config:
      raise SystemExit("error: give --config or --table")
    name = args.name or os.path.splitext(os.path.basename(args.config))[0]
    base.append((name, load_config(args.config, args.set)))
    levers = (args.levers or "plain").split(",")
  budget = int(args.budget_gb * 2**30)
  probes = tuple(int(x) for x in args.probe.split(","))
  device = jax.devices()[0]
  rows = []
  for name, config in base:
    config.model.vocab_size = 0  # from the synthetic metadata (--vocab)
    config.model.seq_len = 0
    for lever in levers:
      c = apply_lever(config, lever)
      row = {"model": name, "lever": lever, "seq": args.seq, "vocab": args.vocab,
             "budget_gb": args.budget_gb, "backend": jax.default_backend(),
             "device": device.device_kind, "devices": jax.device_count()}
      if c.train.fsdp and jax.device_count() == 1:
        rows.append({**row, "skipped": "fsdp needs more than one device (--devices N on CPU)"})
        print(json.dumps(rows[-1]), flush=True)
        if args.json:
          with open(args.json, "a") as f:
            f.write(json.dumps(rows[-1]) + "\n")
        continue
      probe = Probe(c, args.seq, args.vocab)
      t0 = time.perf_counter()
      if args.fit_only:
        result = fit_only(probe, budget, int(c.train.grad_accum_steps), probes,
                          args.granularity)
        b = result["max_per_device_fit"]
        at = {}
      else:
        result = max_batch(probe, budget, int(c.train.grad_accum_steps), probes,
                           args.max_batch, args.granularity)
        b = result["max_per_device"]
        at = probe(b) if b else {}
      rows.append({**row, **result,
                   "peak_gb": at.get("peak", 0) / 2**30,
                   "estimate_gb": probe.estimate(b) / 2**30 if b else 0.0,
                   "params": next(iter(probe.cache.values()))["params"],
                   "compiles": len(probe.cache), "seconds": time.perf_counter() - t0,
                   "points": {str(k): v["peak"] for k, v in sorted(probe.cache.items())}})
      print(json.dumps(rows[-1]), flush=True)
      if args.json:  # row by row: a long table run keeps what it finished
        with open(args.json, "a") as f:
          f.write(json.dumps(rows[-1]) + "\n")
  return rows


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


def main(argv=None):
  args = parse_args(argv)
  if args.render:
    print(table([json.loads(l) for l in open(args.render) if l.strip()]))
    return
  if args.devices:
    # Must precede jax's initialisation: the CPU device count is fixed when jax starts.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["JAX_NUM_CPU_DEVICES"] = str(args.devices)
  if os.environ.get("JAX_PLATFORMS") == "cpu":
    # XLA:CPU: the memory-minimizing scheduler (the default concurrency-optimized one realises
    # no remat saving at all) and no LLVM optimisation (buffer sizes do not depend on it;
    # compiles ~2x faster).
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_cpu_enable_concurrency_optimized_scheduler=false"
                               " --xla_backend_optimization_level=0").strip()
  rows = run(args)
  import jax

  d = rows[0] if rows else {}
  print(f"\nbudget {args.budget_gb:g} GiB per device, seq {args.seq}, vocab {args.vocab}, "
        f"{jax.device_count()} x {d.get('device', '?')} ({jax.default_backend()})")
  print(table(rows))


if __name__ == "__main__":
  main()
