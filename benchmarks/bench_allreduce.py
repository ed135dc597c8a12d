"""All-reduce time vs message size between JAX processes on this machine, and the α–β fit of it.

  python benchmarks/bench_allreduce.py                      # 2 and 4 processes, 4 KB…256 MB
  python benchmarks/bench_allreduce.py --processes 2 --sizes-mb 8,64 --repeats 5 --out F

Each process count starts that many processes over localhost, exactly as training does
(``lmscale_jax.cluster.distributed.initialize``: the gloo CPU collectives, ``JAX_PLATFORMS=cpu``,
``JAX_NUM_CPU_DEVICES=1`` each). Every size is one float32 array sharded over the ``data``
mesh axis, one slice per process, reduced by a jitted ``shard_map`` ``psum`` over that axis:
the collective the manual gradient path of ``lmscale_jax/train/steps.py`` runs (the plain path's
XLA-inserted all-reduce is the same op). Each repeat is preceded by a 4-byte ``psum`` as a
barrier, so the time of a repeat is the collective's, not the processes' skew; the time of a
repeat is the slowest process's; a size's time is the median over repeats.

Loopback has no wire: the "link" is the kernel copying bytes between the processes, CPU
work. With more processes than cores they share the cores, so each one's copies run
``p/cores`` times slower. The fits (``lmscale_jax.study.cluster_model.measured``'s
``fit_alpha_beta``, least squares in relative error) of the ring model
``t = 2(p−1)·α + 2(p−1)/p · n·s/β``:

* ``all``: one α and β for every process count, ``s = max(1, p/cores)`` (the shared cores);
  the calibration ``tools/scaling_model.py --calibration FILE`` uses (its β is this machine's
  effective link for one process per core);
* ``all-uncorrected``: the same with ``s = 1``, as if loopback were a network (how wrong that
  is on an oversubscribed machine);
* one per process count: this machine's effective link at that load.

Then the transport efficiency e(m) of every point against fit ``all``, its β taken as the line
rate: ``e = [2(p−1)/p·m·s/β] / (t − 2(p−1)·α)`` (the share of the link's bandwidth the
transport reaches at m bytes; the latency term stays α per ring step), one ``transport`` row
per point and one ``transport-curve`` row (per size, the median e over process counts).

Prints the table of every point against every fit; appends one JSON line per point, per fit,
per transport point and the curve to ``--out`` (default
``benchmarks/results/<date>-cpu-allreduce.jsonl``); ``--refit FILE`` fits a file's last run
again (fits and transport rows). ``--train-check DATASET`` instead measures real 1- and 2-process
training runs (``launch/local.sh``) against the model (see :func:`train_check`), appended to
``benchmarks/results/<date>-cpu-allreduce-train-check.jsonl``. The machine is measured as it
is: other programs' load shows as noise (``loadavg_1m`` is recorded with every line).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import _host, allreduce_train_check  # noqa: E402
from lmscale_jax.cli.args import Parser, guarded, number  # noqa: E402

MB = 1_000_000
# From 4 KB (where the latency term is all of it) to 256 MB: the transport efficiency curve
# needs the small sizes, the α–β fit the large ones.
DEFAULT_SIZES_MB = (0.004, 0.016, 0.064, 0.25, 1, 2, 4, 8, 16, 32, 64, 128, 256)
# The transport efficiency e(m) = (bandwidth term at the fitted β) / (measured − latency term):
# the denominator is clamped at this (a point no slower than its latency term), and e capped.
_MIN_BANDWIDTH_S, EFFICIENCY_CAP = 1e-7, 1.5
_WORKER_TIMEOUT_S = 900


# ----------------------------------------------------------------------------- worker
def worker(process_id: int, processes: int, port: int, sizes_mb, repeats: int,
           leaves: list[int]) -> None:
  """One process of the job: times the all-reduce of every size, as one array and as each
  count of ``leaves`` equal arrays in one call; prints one JSON line."""
  os.environ.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec

  from lmscale_jax.cluster import distributed
  from lmscale_jax.config import defaults as config_defaults
  from lmscale_jax.train import sharding

  config = config_defaults.get_base_config()
  config.distributed.update(coordinator=f"localhost:{port}", num_processes=processes,
                            process_id=process_id, initialization_timeout=120)
  distributed.initialize(config)
  mesh = sharding.data_mesh()
  spec = NamedSharding(mesh, PartitionSpec(sharding.AXIS))
  # A list of arrays is one call of one psum per leaf, which XLA combines into one
  # all-reduce of many operands: what a training step's per-leaf gradient reduction runs.
  allreduce = jax.jit(jax.shard_map(lambda x: jax.tree.map(
      lambda y: jax.lax.psum(y, sharding.AXIS), x), mesh=mesh,
      in_specs=PartitionSpec(sharding.AXIS), out_specs=PartitionSpec()))

  def global_array(elements: int):
    local = np.full(elements, 1.0 + process_id, np.float32)
    return jax.make_array_from_process_local_data(spec, local)

  barrier_in = global_array(1)
  allreduce(barrier_in).block_until_ready()
  inputs = {str(size): global_array(int(size * MB) // 4) for size in sizes_mb}
  for size in sizes_mb:
    for n in leaves:
      inputs[f"{size}x{n}"] = [global_array(int(size * MB) // 4 // n) for _ in range(n)]
  expected = sum(1.0 + p for p in range(processes))
  for size, x in inputs.items():  # compile + first run (not timed)
    first = jax.tree.leaves(allreduce(x))[0]
    if float(np.asarray(first.addressable_data(0))[0]) != expected:
      raise RuntimeError(f"all-reduce of {size} MB gave a wrong sum")
  times = {size: [] for size in inputs}
  faults = {size: [] for size in inputs}  # minor page faults: fresh memory touched per call
  # Round-robin over sizes: a burst of load from other programs spreads over every size
  # instead of spoiling the repeats of one.
  for _ in range(repeats):
    for size, x in inputs.items():
      allreduce(barrier_in).block_until_ready()
      f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      t0 = time.perf_counter()
      jax.block_until_ready(allreduce(x))
      times[size].append(time.perf_counter() - t0)
      faults[size].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
  print("RESULT " + json.dumps({"process": process_id, "times": times, "faults": faults}),
        flush=True)
  jnp.zeros(()).block_until_ready()


# ----------------------------------------------------------------------------- driver
def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


# glibc returns every block above its mmap threshold (dynamic, at most 32 MB; and anything
# over 64 MB allocated by a thread outside the main arena) to the kernel on free, so every
# all-reduce of a larger array page-faults its freshly mapped output and temporaries (measured
# here: 62,501 minor faults per 256 MB call; 64 MB then takes ~3x the time per byte of 16 MB).
# "keep" (one arena, thresholds raised) keeps freed memory in the heap: 0 faults per call, so
# the timing is the transport's; "default" measures what an untuned process pays.
HEAP_ENV = {"keep": {"MALLOC_MMAP_THRESHOLD_": str(1 << 34), "MALLOC_ARENA_MAX": "1",
                     "MALLOC_TRIM_THRESHOLD_": str(1 << 35)},
            "default": {}}


def run_job(processes: int, sizes_mb, repeats: int, heap: str, leaves: list[int]) -> dict:
  """Starts the job's processes; returns "size" or "size x leaves" (MB) -> (per-repeat
  seconds of the slowest process, median minor page faults per call of process 0)."""
  port = free_port()
  cmd = [sys.executable, os.path.abspath(__file__), "--_worker", str(processes), str(port),
         "--sizes-mb", ",".join(map(str, sizes_mb)), "--repeats", str(repeats)]
  if leaves:
    cmd += ["--leaves", ",".join(map(str, leaves))]
  env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
  env.update(HEAP_ENV[heap])
  procs = [subprocess.Popen(cmd + ["--_process", str(i)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=ROOT,
                            env=env)
           for i in range(processes)]
  outputs = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=_WORKER_TIMEOUT_S)
      if p.returncode != 0:
        tail = err.strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"all-reduce process exited with {p.returncode}: {tail[0]}")
      outputs.append(next(json.loads(line[7:]) for line in out.splitlines()
                          if line.startswith("RESULT ")))
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
  return {s: ([max(o["times"][s][r] for o in outputs) for r in range(repeats)],
               statistics.median(outputs[0]["faults"][s]))
          for s in outputs[0]["times"]}


def measure(processes_list, sizes_mb, repeats: int, device: str, heap: str,
            leaves: list[int] = ()) -> list[dict]:
  """One ``point`` row per process count, size and leaf count (``leaves``: 1 = one array;
  only those enter the α–β fits)."""
  now = datetime.datetime.now()
  rows = []
  for processes in processes_list:
    t0 = time.time()
    per_size = run_job(processes, sizes_mb, repeats, heap, list(leaves))
    print(f"{processes} processes: {len(per_size)} sizes in {time.time() - t0:.0f} s",
          file=sys.stderr)
    for key, (seconds, faults) in per_size.items():
      size, _, n = key.partition("x")
      rows.append({"date": now.date().isoformat(), "device": device,
                   "time": now.isoformat(timespec="seconds"), "bench": "allreduce",
                   "kind": "point", "processes": processes, "bytes": int(float(size) * MB),
                   "leaves": int(n or 1),
                   "dtype": "float32", "heap": heap, "repeats": repeats, "seconds": seconds,
                   "median_s": statistics.median(seconds),
                   "page_faults_per_call": faults, "cores": os.cpu_count(),
                   "loadavg_1m": os.getloadavg()[0]})
  return rows


def fit_rows(points: list[dict], device: str) -> list[dict]:
  """The α–β fits (joint and per process count), each point's predicted time and error."""
  from lmscale_jax.study.cluster_model import measured

  cores = os.cpu_count()
  points = [r for r in points if r.get("leaves", 1) == 1]
  counts = sorted({r["processes"] for r in points})
  # "all": one link for every process count, its bandwidth shared by processes beyond the
  # cores; "all-uncorrected": the same without that (how wrong a plain network fit is here);
  # one fit per process count: this machine's effective link at that load.
  fits = [("all", points, cores), ("all-uncorrected", points, None)] + [
      (str(p), [r for r in points if r["processes"] == p], None) for p in counts]
  out = []
  for name, rows, fit_cores in fits:
    if len(rows) < 2 or (name == "all-uncorrected" and len(counts) < 2):
      continue
    alpha, beta = measured.fit_alpha_beta(
        [(r["processes"], r["bytes"], r["median_s"]) for r in rows], cores=fit_cores)
    for r in rows:
      predicted = measured.calibrated_allreduce_s(r["bytes"], r["processes"], alpha, beta,
                                                       fit_cores)
      r.setdefault("fits", {})[name] = {"predicted_s": predicted,
                                        "error": predicted / r["median_s"] - 1}
    out.append({"date": points[0]["date"], "device": device, "time": points[0]["time"],
                "bench": "allreduce", "kind": "fit", "fit_of": name, "heap": rows[0]["heap"],
                "processes": sorted({r["processes"] for r in rows}), "cores": fit_cores,
                "alpha_s": alpha, "beta_bytes_per_s": beta,
                "max_abs_error_ge_8mb": max(abs(r["fits"][name]["error"]) for r in rows
                                            if r["bytes"] >= 8 * MB) if any(
                                                r["bytes"] >= 8 * MB for r in rows) else None})
  return out


def transport_rows(points: list[dict], fits: list[dict]) -> list[dict]:
  """The transport efficiency e(m) of every point against fit ``all`` (β = "line rate"):
  ``e = [2(p−1)/p·m·s/β] / (t − 2(p−1)·α)``, one ``transport`` row per point (and e in the
  point's ``fits["all"]``), then one ``transport-curve`` row: per size the median e over the
  process counts, sizes ascending (the cluster model reads a file's last such row)."""
  from lmscale_jax.study.cluster_model import measured

  fit = next((f for f in fits if f["fit_of"] == "all"), None)
  if fit is None:
    return []
  alpha, beta, cores = fit["alpha_s"], fit["beta_bytes_per_s"], fit["cores"]
  rows, by_size = [], {}
  for r in (r for r in points if r.get("leaves", 1) == 1):
    p, m, t = r["processes"], r["bytes"], r["median_s"]
    ideal = 2 * (p - 1) / p * m * measured.shared_cores(p, cores) / beta
    raw = ideal / max(t - 2 * (p - 1) * alpha, _MIN_BANDWIDTH_S)
    e = min(raw, EFFICIENCY_CAP)
    r["fits"]["all"]["efficiency"] = e
    by_size.setdefault(m, []).append(e)
    rows.append({"date": r["date"], "device": r["device"], "time": r["time"],
                 "bench": "allreduce", "kind": "transport", "fit_of": "all", "heap": r["heap"],
                 "processes": p, "bytes": m, "efficiency": e, "capped": raw > EFFICIENCY_CAP,
                 "busbw_bytes_per_s": 2 * (p - 1) / p * m / t})
  rows.append({"date": fit["date"], "device": fit["device"], "time": fit["time"],
               "bench": "allreduce", "kind": "transport-curve", "fit_of": "all",
               "heap": fit["heap"], "alpha_s": alpha, "beta_bytes_per_s": beta, "cores": cores,
               "processes": fit["processes"], "capped": any(r["capped"] for r in rows),
               "points": [[m, statistics.median(es)] for m, es in sorted(by_size.items())]})
  return rows


# ----------------------------------------------------------------------------- train check
def last_run(path: str) -> list[dict]:
  """The points of the latest run (``time``) in a results file."""
  from lmscale_jax.errors import UserError

  try:
    with open(path) as f:
      rows = [json.loads(line) for line in f if line.strip()]
  except (OSError, ValueError) as e:
    raise UserError(f"--refit {path}: cannot read its JSON lines ({e})") from None
  points = [r for r in rows if r.get("bench") == "allreduce" and r.get("kind") == "point"]
  if not points:
    raise UserError(f"--refit {path}: no all-reduce points")
  latest = max(r["time"] for r in points)
  return [{k: v for k, v in r.items() if k != "fits"} for r in points if r["time"] == latest]


def leaves_table(points: list[dict]) -> str:
  """The same bytes as one array and as N arrays in one call; the cost of each extra leaf."""
  one = {(r["processes"], r["bytes"]): r["median_s"] for r in points if r.get("leaves", 1) == 1}
  lines = []
  for r in points:
    n, base = r.get("leaves", 1), one.get((r["processes"], r["bytes"]))
    if n > 1 and base is not None:
      lines.append(f"| {r['processes']} | {r['bytes'] / MB:g} | {n} | {base * 1e3:.1f} | "
                   f"{r['median_s'] * 1e3:.1f} | {(r['median_s'] - base) / (n - 1) * 1e6:.0f} |")
  if not lines:
    return ""
  return "\n".join(["| processes | MB | leaves | one array ms | leaves ms | us per extra leaf |",
                    "|---|---|---|---|---|---|", *lines])


def table(points: list[dict], fits: list[dict]) -> str:
  names = [f["fit_of"] for f in fits]
  head = "| processes | MB | measured ms | " + " | ".join(
      f"fit {n}: ms (err)" for n in names) + " | e (fit all) |"
  lines = [head, "|" + "---|" * (4 + len(names))]
  for r in points:
    cells = [f"{r['fits'][n]['predicted_s'] * 1e3:.1f} ({r['fits'][n]['error']:+.0%})"
             if n in r.get("fits", {}) else "" for n in names]
    e = r.get("fits", {}).get("all", {}).get("efficiency")
    lines.append(f"| {r['processes']} | {r['bytes'] / MB:g} | {r['median_s'] * 1e3:.2f} | "
                 + " | ".join(cells) + f" | {'' if e is None else f'{e:.2f}'} |")
  lines.append("")
  for f in fits:
    worst = f["max_abs_error_ge_8mb"]
    lines.append(f"fit {f['fit_of']}: alpha {f['alpha_s'] * 1e6:.1f} us, beta "
                 f"{f['beta_bytes_per_s'] / 1e9:.3f} GB/s, max |error| at >= 8 MB "
                 + (f"{worst:.1%}" if worst is not None else "(no such point)"))
  return "\n".join(lines)


def sizes(text: str) -> list[float]:
  try:
    values = [float(x) for x in text.split(",") if x.strip()]
  except ValueError:
    values = []
  if not values or any(not 0 < v <= 4096 for v in values):
    raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated sizes in MB, "
                                     "each in (0, 4096]")
  return values


def int_list(what: str, lo: int, hi: int):
  """An argparse type: comma-separated integers, each in lo..hi (``what`` names them)."""
  def parse(text: str) -> list[int]:
    try:
      values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
      values = []
    if not values or any(not lo <= v <= hi for v in values):
      raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated {what}, "
                                       f"each in {lo}..{hi}")
    return values
  return parse


leaf_counts, counts = int_list("leaf counts", 2, 4096), int_list("process counts", 2, 64)


def main(argv=None) -> int:
  p = Parser(description="All-reduce time vs size between JAX CPU processes over localhost "
                         "(gloo), and the fitted alpha (latency) and beta (bytes/s).")
  p.add_argument("--processes", type=counts, default=[2, 4], help="comma-separated (2,4)")
  p.add_argument("--sizes-mb", type=sizes, default=list(DEFAULT_SIZES_MB),
                 help="comma-separated message sizes in MB (0.004,0.016,0.064,0.25,1,2,4,…,256)")
  p.add_argument("--repeats", type=number(int, 1, 1000), default=7)
  p.add_argument("--leaves", type=leaf_counts, default=[], help="comma-separated: also "
                 "reduce each size split into this many equal arrays in one call (a training "
                 "step's per-leaf gradient reduction; e.g. 42, configs/tiny.py's leaves)")
  p.add_argument("--heap", choices=tuple(HEAP_ENV), default="keep",
                 help="keep: freed memory stays in the process heap (the transport's time, "
                 "default); default: glibc's defaults (large buffers page-fault every call)")
  p.add_argument("--out", default="", help="JSON lines to append to (default "
                 "benchmarks/results/<date>-cpu-allreduce.jsonl)")
  p.add_argument("--refit", metavar="FILE", help="measure nothing: fit the last run's points "
                 "in FILE again and append the fits to it (or to --out)")
  t = p.add_argument_group("training check (instead of the all-reduce sweep)")
  t.add_argument("--train-check", metavar="DATASET", help="measure 1- and 2-process training "
                 "step times (configs/tiny.py, launch/local.sh) against the model")
  t.add_argument("--calibration", default=os.path.join(ROOT, "benchmarks", "results",
                                                       "2026-12-01-cpu-allreduce.jsonl"))
  t.add_argument("--train-batch", type=number(int, 1, 4096), default=8,
                 help="sequences per process (the global batch is twice that)")
  t.add_argument("--train-hidden", type=number(int, 64, 4096), default=256)
  t.add_argument("--train-steps", type=number(int, 4, 100000), default=60)
  t.add_argument("--train-rounds", type=number(int, 1, 100), default=1,
                 help="repeat the four runs; each kind's median step time is used")
  t.add_argument("--train-workdirs", metavar="DIR", help="keep the runs' workdirs here "
                 "(default: a temporary directory, removed)")
  t.add_argument("--train-log-every", type=number(int, 1, 1000), default=5)
  p.add_argument("--_worker", nargs=2, type=int, help=argparse.SUPPRESS)
  p.add_argument("--_process", type=int, help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  if a._worker:
    worker(a._process, a._worker[0], a._worker[1], a.sizes_mb, a.repeats, a.leaves)
    return 0

  def go() -> int:
    if a.train_check:
      rows = allreduce_train_check.train_check(a, _host.cpu_name())
      for r in rows:
        print(f"{r['processes']} process(es): measured {r['measured_step_s'] * 1e3:.1f} ms, "
              f"predicted {r['predicted_step_s'] * 1e3:.1f} ms ({r['error']:+.1%})")
      out = a.out or os.path.join(ROOT, "benchmarks", "results",
                                  f"{rows[0]['date']}-cpu-allreduce-train-check.jsonl")
      with open(out, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
      return 0
    if a.refit:
      points = last_run(a.refit)
      device = points[0]["device"]
    else:
      device = _host.cpu_name() + "; localhost gloo"
      points = measure(a.processes, a.sizes_mb, a.repeats, device, a.heap, a.leaves)
    fits = fit_rows(points, device)
    fits += transport_rows(points, fits)
    if any(f.get("capped") for f in fits):
      print(f"transport efficiency capped at {EFFICIENCY_CAP} for some points (faster than "
            "the fitted line rate)", file=sys.stderr)
    print(table([r for r in points if r.get("leaves", 1) == 1],
                [f for f in fits if f["kind"] == "fit"]))
    print(leaves_table(points))
    out = a.out or a.refit or os.path.join(ROOT, "benchmarks", "results",
                                           f"{points[0]['date']}-cpu-allreduce.jsonl")
    with open(out, "a") as f:  # appended: earlier runs' lines stay (one line per record)
      for row in ([] if a.refit else points) + fits:
        f.write(json.dumps(row) + "\n")
    written = len(fits) + (0 if a.refit else len(points))
    print(f"appended {written} lines to {out}", file=sys.stderr)
    return 0

  return guarded(go, "rerun to measure again")


if __name__ == "__main__":
  sys.exit(main())
