"""What one training step costs beyond its microbatches, how much it varies, and how it grows
with the per-device batch: the cluster model's fixed per-step cost, jitter and batch terms,
measured with the real trainer on this machine's CPU.

  python benchmarks/bench_step_profile.py                    # a synthetic dataset, hidden 128
  python benchmarks/bench_step_profile.py --dataset DATA --steps 40 --out F

Every configuration is a real run of ``python -m lmscale_jax.main --config=configs/tiny.py``
(through ``launch/local.sh``, as ``bench_allreduce.py --train-check`` runs it) with one
``metrics.jsonl`` window per step (``train.log_every=1``); a run's step times are its windows
after the first ``--skip`` (compilation, warm-up). Measured, one run at a time:

* accumulation: ``train.grad_accum_steps`` k = 1, 2, 4 at the same microbatch, fitted by least
  squares to ``step(k) = fixed + k·micro``: ``fixed_s`` is what a step costs once whatever k
  is (optimizer update, launch, host work); negative from noise → clamped to 0
  (``fixed_clamped``, and ``micro_s`` refitted through the origin);
* jitter: the standard deviation of the k = 1 run's step times (``jitter_s``, ``jitter_cv``);
* batch: k = 1 at per-device batch 2, 4, 8, 16 and the line ``t(b) = t0 + b·t1``;
* two processes: the k = 1 configuration as 2 processes over localhost against two 1-process
  runs started together (the compute as the 2 processes share this machine's cores, see
  ``allreduce_train_check``) plus the calibrated all-reduce of the float32 gradients (the last
  ``fit_of: all`` line of ``--calibration``): the residual, beside the straggler term a jitter
  σ predicts for 2 ranks, ``σ·E[max of 2 standard normals] = σ/√π``. Both are reported; neither
  is forced onto the other.

Appends one JSON line per configuration and one ``kind: fit`` line (the cluster model reads a
file's last) to ``--out`` (default ``benchmarks/results/<date>-cpu-step-profile.jsonl``) and
prints a markdown table. The machine is measured as it is (``loadavg_1m`` on every line).
"""

from __future__ import annotations

import datetime
import glob
import json
import math
import os
import shutil
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import _host, allreduce_train_check  # noqa: E402
from lmscale_jax.cli.args import Parser, guarded, number  # noqa: E402
from lmscale_jax.errors import UserError  # noqa: E402


# ----------------------------------------------------------------------------- runs
def step_times(workdir: str, skip: int) -> list[float]:
  """The run's per-step seconds (one window per step) after the first ``skip`` windows."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  times = [r["step_time"] for r in rows if isinstance(r.get("step_time"), (int, float))]
  if len(times) <= skip + 1:
    raise RuntimeError(f"{workdir}: {len(times)} step windows, need more than {skip + 1}")
  return times[skip:]


def run_config(a, kind: str, processes: int, batch: int, k: int, copies: int = 1) -> list[dict]:
  """``copies`` runs of one configuration started together (``batch`` sequences per device
  per microbatch, ``k`` microbatches per step); one row per run."""
  overrides = [f"--config.model.hidden={a.hidden}", f"--config.model.ffn={4 * a.hidden}",
               f"--config.train.steps={a.steps}", "--config.train.log_every=1",
               f"--config.train.eval_every={a.steps}", "--config.train.eval_batches=1",
               f"--config.checkpoint.every={a.steps}", "--config.checkpoint.async_save=false",
               f"--config.train.batch_size={batch * k * processes}",
               f"--config.train.grad_accum_steps={k}"]
  workdirs = [os.path.join(a.workdirs, f"{kind}-p{processes}-b{batch}-k{k}-{c}")
              for c in range(copies)]
  for w in workdirs:
    shutil.rmtree(w, ignore_errors=True)  # a fresh run, not a resume
  done = allreduce_train_check.train_runs(processes, a.dataset, workdirs, overrides)
  rows = []
  for w, run in zip(workdirs, done):
    times = step_times(w, a.skip)
    rows.append({"bench": "step-profile", "kind": kind, "processes": processes,
                 "batch_per_device": batch, "grad_accum_steps": k, "params": run["params"],
                 "step_times_s": times, "median_s": statistics.median(times),
                 "loadavg_1m": os.getloadavg()[0]})
  print(f"{kind}: {processes} process(es) x{copies}, batch {batch}, k {k}: " + ", ".join(
      f"{r['median_s'] * 1e3:.1f}" for r in rows) + " ms", file=sys.stderr)
  return rows


# ----------------------------------------------------------------------------- fits
def line_fit(points) -> tuple[float, float]:
  """Least squares ``y = a + b·x`` over ``(x, y)`` points: (a, b)."""
  xs, ys = [x for x, _ in points], [y for _, y in points]
  mx, my = statistics.fmean(xs), statistics.fmean(ys)
  sxx = sum((x - mx) ** 2 for x in xs)
  if len(points) < 2 or not sxx:
    raise UserError(f"a line fit needs two distinct x values, got {sorted(set(xs))}")
  b = sum((x - mx) * (y - my) for x, y in points) / sxx
  return my - b * mx, b


def accumulation_fit(points) -> dict:
  """``step(k) = fixed + k·micro``; a negative ``fixed`` is noise: 0, micro through the
  origin."""
  fixed, micro = line_fit(points)
  if fixed >= 0:
    return {"fixed_s": fixed, "micro_s": micro, "fixed_clamped": False}
  micro = sum(k * t for k, t in points) / sum(k * k for k, _ in points)
  return {"fixed_s": 0.0, "micro_s": micro, "fixed_clamped": True, "fixed_unclamped_s": fixed}


def newest_calibration() -> str:
  """The newest ``benchmarks/results/*-cpu-allreduce.jsonl`` (the dates sort)."""
  found = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "*-cpu-allreduce.jsonl")))
  if not found:
    raise UserError("no benchmarks/results/*-cpu-allreduce.jsonl: run benchmarks/"
                    "bench_allreduce.py first, or give --calibration")
  return found[-1]


def straggler(a, base: dict, concurrent: list[dict], two: dict, jitter: float) -> dict:
  """The 2-process step against 1-process compute (run concurrently) + the calibrated
  all-reduce of the float32 gradients; the residual beside σ/√π."""
  from lmscale_jax.study.cluster_model import measured

  fit = measured.calibration_fit(a.calibration, "all")
  grad = 4 * two["params"]
  comm = measured.calibrated_allreduce_s(grad, 2, fit["alpha_s"], fit["beta_bytes_per_s"],
                                              fit.get("cores"))
  compute = statistics.median(r["median_s"] for r in concurrent)
  return {"measured_two_process_s": two["median_s"], "concurrent_one_process_s": compute,
          "one_process_s": base["median_s"], "allreduce_s": comm, "grad_bytes": grad,
          "measured_residual_s": two["median_s"] - compute - comm,
          "predicted_s": jitter / math.sqrt(math.pi), "sigma_s": jitter,
          "calibration": {"file": os.path.relpath(a.calibration, ROOT),
                          "alpha_s": fit["alpha_s"], "beta_bytes_per_s": fit["beta_bytes_per_s"],
                          "cores": fit.get("cores"), "time": fit["time"]}}


def fit_row(a, rows: list[dict], shape: dict) -> dict:
  accum = [r for r in rows if r["kind"] == "accumulation"]
  base = next(r for r in accum if r["grad_accum_steps"] == 1)
  jitter = statistics.stdev(base["step_times_s"])
  batch = sorted((r["batch_per_device"], r["median_s"]) for r in rows if r["kind"] == "batch")
  t0, t1 = line_fit(batch)
  two = [r for r in rows if r["kind"] == "two-process"]
  concurrent = [r for r in rows if r["kind"] == "concurrent"]
  return {"bench": "step-profile", "kind": "fit", "processes": 1,
          "model": {"hidden": a.hidden, "layers": shape["layers"], "params": base["params"]},
          "microbatch": a.micro, "steps": a.steps, "skipped_windows": a.skip,
          **accumulation_fit([(r["grad_accum_steps"], r["median_s"]) for r in accum]),
          "accumulation_points": [[r["grad_accum_steps"], r["median_s"]] for r in accum],
          "jitter_s": jitter, "jitter_cv": jitter / base["median_s"],
          "batch_points": [list(p) for p in batch],
          "batch_fit": {"t0_s": t0, "per_sequence_s": t1},
          "straggler": straggler(a, base, concurrent, two[0], jitter) if two else None}


def table(rows: list[dict], fit: dict) -> str:
  lines = ["| kind | processes | batch/device | k | median ms | std ms | steps |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    t = r["step_times_s"]
    lines.append(f"| {r['kind']} | {r['processes']} | {r['batch_per_device']} | "
                 f"{r['grad_accum_steps']} | {r['median_s'] * 1e3:.2f} | "
                 f"{statistics.stdev(t) * 1e3:.2f} | {len(t)} |")
  b, s = fit["batch_fit"], fit["straggler"]
  lines += ["", f"fixed {fit['fixed_s'] * 1e3:.2f} ms"
            + (" (clamped from a negative fit)" if fit["fixed_clamped"] else "")
            + f", micro {fit['micro_s'] * 1e3:.2f} ms; jitter {fit['jitter_s'] * 1e3:.2f} ms "
            f"(cv {fit['jitter_cv']:.1%}); batch: t0 {b['t0_s'] * 1e3:.2f} ms + "
            f"{b['per_sequence_s'] * 1e3:.2f} ms per sequence"]
  if s:
    lines.append(f"2 processes: measured {s['measured_two_process_s'] * 1e3:.2f} ms = compute "
                 f"{s['concurrent_one_process_s'] * 1e3:.2f} + all-reduce "
                 f"{s['allreduce_s'] * 1e3:.2f} + residual {s['measured_residual_s'] * 1e3:+.2f}"
                 f" ms; straggler sigma/sqrt(pi) predicts {s['predicted_s'] * 1e3:.2f} ms")
  return "\n".join(lines)


# ----------------------------------------------------------------------------- main
def profile(a) -> list[dict]:
  """Every configuration, one run at a time: accumulation (k = 1 is also the batch point of
  its microbatch), the other batches, then the two-process pair."""
  rows = []
  for k in a.accum:
    rows += run_config(a, "accumulation", 1, a.micro, k)
  for b in a.batches:
    if b == a.micro and 1 in a.accum:
      rows.append(dict(next(r for r in rows if r["grad_accum_steps"] == 1), kind="batch"))
    else:
      rows += run_config(a, "batch", 1, b, 1)
  if a.two_process:
    rows += run_config(a, "concurrent", 1, a.micro, 1, copies=2)
    rows += run_config(a, "two-process", 2, a.micro, 1)
  return rows


def synthetic_dataset(directory: str) -> str:
  """The synthetic dataset the tests use (store/synthetic_dataset.py), enough for every run."""
  from lmscale_jax.store.synthetic_dataset import write_synthetic_dataset

  write_synthetic_dataset(directory, n_train=2048, n_val=64)
  return directory


def int_list(text: str) -> list[int]:
  import argparse

  try:
    values = [int(x) for x in text.split(",") if x.strip()]
  except ValueError:
    values = []
  if not values or any(not 1 <= v <= 4096 for v in values):
    raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers in 1..4096")
  return values


def main(argv=None) -> int:
  p = Parser(description="Fixed per-step cost, jitter, straggler and step time vs per-device "
                         "batch of the real trainer (configs/tiny.py) on this CPU.")
  p.add_argument("--dataset", help="a prepared dataset (default: a synthetic one, made here)")
  p.add_argument("--hidden", type=number(int, 32, 256), default=128)
  p.add_argument("--steps", type=number(int, 4, 60), default=40, help="steps per run (<= 60)")
  p.add_argument("--skip", type=number(int, 1, 50), default=5,
                 help="first windows dropped (compilation, warm-up)")
  p.add_argument("--micro", type=number(int, 1, 4096), default=4,
                 help="per-device microbatch of the accumulation runs")
  p.add_argument("--accum", type=int_list, default=[1, 2, 4], help="grad_accum_steps (1,2,4)")
  p.add_argument("--batches", type=int_list, default=[2, 4, 8, 16],
                 help="per-device batches at k = 1 (2,4,8,16)")
  p.add_argument("--no-two-process", dest="two_process", action="store_false",
                 help="skip the 2-process straggler measurement")
  p.add_argument("--calibration", help="bench_allreduce.py results for the all-reduce "
                 "(default: the newest benchmarks/results/*-cpu-allreduce.jsonl)")
  p.add_argument("--out", default="", help="JSON lines to append to (default "
                 "benchmarks/results/<date>-cpu-step-profile.jsonl)")
  a = p.parse_args(argv)
  if 1 not in a.accum or len(set(a.accum)) < 2 or len(set(a.batches)) < 2:
    p.error("--accum needs 1 and another k; --batches two distinct batches")
  if a.steps <= a.skip + 2:
    p.error(f"--steps {a.steps}: must exceed --skip {a.skip} by 3 or more (a jitter needs "
            "2 timed steps)")

  def go() -> int:
    a.calibration = a.calibration or (newest_calibration() if a.two_process else None)
    now = datetime.datetime.now()
    with tempfile.TemporaryDirectory(prefix="bench_step_profile_") as tmp:
      a.workdirs = tmp
      a.dataset = a.dataset or synthetic_dataset(os.path.join(tmp, "data"))
      rows = profile(a)
      with open(os.path.join(tmp, f"accumulation-p1-b{a.micro}-k1-0", "config.json")) as f:
        shape = json.load(f)["model"]
    stamp = {"date": now.date().isoformat(), "time": now.isoformat(timespec="seconds"),
             "device": _host.cpu_name(), "hidden": a.hidden}
    rows = [{**stamp, **r} for r in rows]
    fit = {**stamp, **fit_row(a, rows, shape), "loadavg_1m": os.getloadavg()[0]}
    print(table(rows, fit))
    out = a.out or os.path.join(ROOT, "benchmarks", "results",
                                f"{stamp['date']}-cpu-step-profile.jsonl")
    with open(out, "a") as f:  # appended: earlier runs' lines stay
      f.writelines(json.dumps(r) + "\n" for r in rows + [fit])
    print(f"appended {len(rows) + 1} lines to {out}", file=sys.stderr)
    return 0

  return guarded(go, "rerun to measure again")


if __name__ == "__main__":
  sys.exit(main())
