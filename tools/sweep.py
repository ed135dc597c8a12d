"""A grid of short, bounded training runs, one JSON row per run (tools/report.py plots them).

  python tools/sweep.py --data DATASET --config configs/tiny.py --processes 1,2 --workers 0,2 \
      --batch 8 --accum 1 --output benchmarks/results/2026-12-01-cpu-sweep.jsonl

Axes (every combination is one point): --processes, --workers (data.workers), --config (files)
× --model (named override sets, e.g. --model wide:model.hidden=256,model.ffn=1024), --batch
(per-device microbatch: sequences one device computes per forward/backward) and --accum
(train.grad_accum_steps); as in Hugging Face's Trainer, the global batch train.batch_size is
batch × accum × devices. --set KEY=VALUE overrides any other config key for every point.

Each run is short and bounded: --steps steps logged every --log-every, evaluation (1 batch) and
a checkpoint only at the last step, killed after --timeout seconds. Its row holds the medians,
over the logging windows after the first (start-up and compilation), of samples/s (global),
non-pad tokens/s, MFU (null on CPU), input-wait fraction and step time from the run's
metrics.jsonl, and the compiled peak device memory of its training step (one compilation per
distinct step, in one process with as many devices, before the runs: flops.peak_bytes). A run
that fails (out of memory, a launch failure, a timeout, an error) is a row with status
"failed" and the reason; the sweep goes on. With --budget-gb a point whose compiled peak
exceeds the budget is recorded as out-of-memory without running it (a device budget simulated
on CPU; on a GPU the run itself would fail). The results file is rewritten atomically after
every point, keeping one row per point; a rerun skips the points it holds (--retry-failed
reruns failed ones).

Run directories: --runs (default runs/sweep-<results stem>), one per point, named by the
point's key; a point rerun starts from an empty one. --tag labels a variant (e.g. other --env
thread settings) so that tools/report.py keeps its series apart.

Launchers: "local" runs launch/local.sh N (CPU processes here, one GPU each where there are at
least N). "slurm" submits each point, one after the other, as `sbatch --wait
launch/slurm.sbatch …` (one task per GPU, --gpus-per-node per node; the job stages --data to
node-local disk as DATA_SRC; its time limit is --timeout rounded up to minutes; --slurm-arg
passes --partition and the like; --runs must be on storage every node sees; the peak-memory
compilation is off unless --probe, which compiles on this host's backend). --dry-run prints
every point's command and runs nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

from _cli import Parser, guarded, output_file  # noqa: E402
from lmscale_jax import sweep_grid as sg  # noqa: E402
from lmscale_jax.sweep_grid import Plan, Point, SweepError  # noqa: E402

MARKER = "sweep_point.json"  # written in every run directory this tool makes (and may remove)


def int_list(flag: str, lo: int):
  def parse(text: str) -> list[int]:
    try:
      values = [int(x) for x in text.split(",")]
    except ValueError:
      values = []
    if not values or min(values) < lo:
      raise argparse.ArgumentTypeError(
          f"{flag} {text!r}: expected comma-separated integers >= {lo}")
    return sorted(set(values))
  return parse


def gpu_count() -> int:
  """GPUs launch/local.sh would use (none with JAX_PLATFORMS=cpu)."""
  if os.environ.get("JAX_PLATFORMS") == "cpu" or not shutil.which("nvidia-smi"):
    return 0
  out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
  return sum(line.startswith("GPU") for line in out.splitlines())


# ----------------------------------------------------------------------------- commands
def main_args(plan: Plan, pt: Point, workdir: str) -> list[str]:
  # Under Slurm the job stages DATA_SRC and passes its node-local copy as data.path itself.
  sets = [(k, v) for k, v in sg.point_sets(plan, pt)
          if not (plan.launcher == "slurm" and k == "data.path")]
  return [f"--config={pt.config}", f"--workdir={workdir}",
          *(f"--config.{k}={v}" for k, v in sets)]


def command(a, plan: Plan, pt: Point, workdir: str) -> tuple[list[str], dict]:
  """The command that runs a point, and the environment it adds."""
  env = dict(kv.split("=", 1) for kv in plan.env)
  if plan.launcher == "local":
    env.setdefault("DEVICES_PER_PROCESS", str(plan.devices_per_process))
    return ["bash", os.path.join(ROOT, "launch/local.sh"), str(pt.processes), "--",
            *main_args(plan, pt, workdir)], env
  per_node = min(pt.processes, a.gpus_per_node)  # one task per GPU
  exports = ",".join(["ALL", f"DATA_SRC={os.path.abspath(plan.data)}",
                      *(f"{k}={v}" for k, v in env.items())])
  return ["sbatch", "--wait", f"--nodes={pt.processes // per_node}",
          f"--ntasks-per-node={per_node}", f"--gpus-per-node={per_node}",
          f"--time={-(-a.timeout // 60)}", f"--job-name=sweep-{sg.point_key(plan, pt)[:8]}",
          f"--output={workdir}/slurm-%j.out", f"--export={exports}", *a.slurm_arg,
          os.path.join(ROOT, "launch/slurm.sbatch"), *main_args(plan, pt, workdir)], {}


# ----------------------------------------------------------------------------- compiled peak
# Runs in a fresh interpreter per device count (JAX fixes it at start-up). argv: specs, out.
PROBE = r"""
import json, sys
from lmscale_jax import dataset, flops, steps as steps_lib, sweep_grid, train
specs, out, meta = json.load(open(sys.argv[1])), {}, None
for spec in specs:
  try:
    c = sweep_grid.load_config(spec["config"], spec["sets"])
    meta = meta or dataset.DatasetMeta.load(c.data.path)
    s = train.build_setup(c, meta)
    st = steps_lib.build_steps(c, s.model_cfg, s.predictions)
    batch = flops.abstract_batch(c.train.batch_size, meta.seq_len, s.predictions,
                                 st.batch_sharding)
    m = st.train_step.lower(st.abstract_state, batch).compile().memory_analysis()
    out[spec["id"]] = {"peak_bytes": flops.peak_bytes(m), "param_count": s.param_count,
                       "seq_len": meta.seq_len, "flops_per_step": s.flops_per_step}
  except Exception as e:
    out[spec["id"]] = {"probe_error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
json.dump(out, open(sys.argv[2], "w"))
"""


def probe(a, plan: Plan, points: list[Point], scratch: str) -> dict:
  """Compiled peak bytes per device (and parameter count) of each point's training step:
  one process per device count, one compilation per distinct step (the loader's worker count
  does not change it). Nothing runs: the step is lowered with abstract state and batch."""
  wanted, by_devices = {}, {}
  for pt in points:
    sets = [kv for kv in sg.point_sets(plan, pt) if kv[0] != "data.workers"]
    ident, n = json.dumps([pt.config, sets]), sg.devices(plan, pt)
    by_devices.setdefault(n, {})[ident] = {"config": pt.config, "sets": sets}
    wanted[pt] = (n, ident)
  found = {}
  os.makedirs(scratch, exist_ok=True)
  for n, specs in sorted(by_devices.items()):
    spec_file, out_file = (os.path.join(scratch, f"probe-{n}.{x}") for x in ("in", "out"))
    with open(spec_file, "w") as f:
      json.dump([{"id": i, **s} for i, s in specs.items()], f)
    env = dict(os.environ, PYTHONPATH=ROOT)
    if plan.gpus < n:
      env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(n))
    print(f"sweep: compiling {len(specs)} training step(s) on {n} device(s) for their peak "
          "memory", flush=True)
    try:
      r = subprocess.run([sys.executable, "-c", PROBE, spec_file, out_file], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=a.timeout)
      got = json.load(open(out_file)) if r.returncode == 0 else {}
      why = (r.stderr.strip().splitlines() or ["no output"])[-1][:300]
    except subprocess.TimeoutExpired:
      got, why = {}, f"compilation still running after --timeout {a.timeout} s"
    for ident in specs:
      found[(n, ident)] = got.get(ident, {"probe_error": why})
  return {pt: found[wanted[pt]] for pt in points}


# ----------------------------------------------------------------------------- one run
def run_point(a, plan: Plan, pt: Point, workdir: str) -> dict:
  if os.path.exists(workdir):  # an interrupted attempt: start afresh, not from its checkpoint
    if not os.path.exists(os.path.join(workdir, MARKER)):
      raise SweepError(f"{workdir} exists but was not made by tools/sweep.py: remove it or "
                       "give another --runs")
    shutil.rmtree(workdir)
  os.makedirs(workdir)
  cmd, env = command(a, plan, pt, workdir)
  with open(os.path.join(workdir, MARKER), "w") as f:
    json.dump({"point": dataclasses.asdict(pt), "command": cmd, "env": env}, f)
  log_path = os.path.join(workdir, "sweep.log")
  t0, timed_out = time.monotonic(), False
  with open(log_path, "w") as log:
    try:
      # Its own process group, so a timeout stops the launcher and every process it started.
      proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=log,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              start_new_session=True)
    except OSError as e:
      return {"status": "failed", "reason": f"launch failed: {e}", "wall_s": 0.0}
    try:  # under Slurm the job's time limit bounds the run (the queue wait is unbounded)
      rc = proc.wait(timeout=None if plan.launcher == "slurm" else a.timeout)
    except subprocess.TimeoutExpired:
      timed_out = True
      rc = stop(proc)
  wall = time.monotonic() - t0
  text = open(log_path, errors="replace").read()
  for name in sorted(f for f in os.listdir(workdir) if f.startswith("slurm-")):
    text += open(os.path.join(workdir, name), errors="replace").read()
  found = sg.summarize(workdir)
  if rc == 0 and not timed_out and found["windows"] >= 1:
    return {"status": "ok", "reason": None, "wall_s": wall, **found}
  reason = (sg.failure_reason(rc, text, timed_out, a.timeout) if rc or timed_out else
            "no logging window after the first: raise --steps or lower --log-every")
  return {"status": "failed", "reason": reason, "wall_s": wall, **found}


def stop(proc: subprocess.Popen) -> int:
  """SIGTERM to the point's process group (they checkpoint and leave), SIGKILL 15 s later."""
  for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
    try:
      os.killpg(proc.pid, sig)
      return proc.wait(timeout=wait)
    except subprocess.TimeoutExpired:
      continue
    except ProcessLookupError:
      break
  return proc.wait()


def device_name(a, plan: Plan, pt: Point) -> str:
  if plan.launcher == "slurm":
    return f"slurm: {a.gpus_per_node} gpu(s) per node"
  if plan.gpus >= pt.processes:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.splitlines()
    return f"gpu: {out[0] if out else 'unknown'}"
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  from _host import cpu_name

  return cpu_name()


# ----------------------------------------------------------------------------- the sweep
def sweep(a) -> int:
  plan = Plan(data=a.data, steps=a.steps, log_every=a.log_every, sets=tuple(a.sets),
              env=tuple(a.env), launcher=a.launcher,
              devices_per_process=a.devices_per_process,
              gpus=gpu_count() if a.launcher == "local" else 0, tag=a.tag)
  points = sg.grid(a.config, a.model, a.processes, a.workers, a.batch, a.accum)
  for pt in points:  # every config and override loads before anything runs
    sg.load_config(pt.config, sg.point_sets(plan, pt), root=ROOT)
    if a.launcher == "slurm" and pt.processes > a.gpus_per_node and (
        pt.processes % a.gpus_per_node):
      raise SweepError(f"--processes {pt.processes}: not a whole number of nodes of "
                       f"--gpus-per-node {a.gpus_per_node}")
  runs = a.runs or os.path.join(ROOT, "runs", "sweep-" + os.path.splitext(
      os.path.basename(a.output))[0])
  if a.dry_run:
    for pt in points:
      cmd, env = command(a, plan, pt, os.path.join(runs, sg.point_key(plan, pt)))
      print(" ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()),
                      *map(shlex.quote, cmd)]))
    return 0
  done = {r["key"]: r for r in sg.read_rows(a.output)}
  todo = [pt for pt in points if sg.point_key(plan, pt) not in done or (
      a.retry_failed and done[sg.point_key(plan, pt)]["status"] != "ok")]
  print(f"sweep: {len(points)} point(s), {len(points) - len(todo)} already in {a.output}",
        flush=True)
  peaks = probe(a, plan, todo, os.path.join(runs, "probe")) if a.probe and todo else {}
  for i, pt in enumerate(todo, 1):
    row = run_and_record(a, plan, pt, runs, peaks.get(pt, {}))
    print(f"sweep: [{i}/{len(todo)}] {pt.model} processes={pt.processes} "
          f"workers={pt.workers} batch={pt.batch} accum={pt.accum}: {row['status']}"
          + (f" ({row['reason']})" if row["reason"] else
             f", {row['samples_per_sec']:.1f} samples/s, step {row['step_time']:.3f} s"),
          flush=True)
  keys = {sg.point_key(plan, pt) for pt in points}
  rows = [r for r in sg.read_rows(a.output) if r["key"] in keys]
  import report

  print(report.runs_table(rows))
  return 0


def run_and_record(a, plan: Plan, pt: Point, runs: str, peak: dict) -> dict:
  key = sg.point_key(plan, pt)
  workdir = os.path.join(runs, key)
  n = sg.devices(plan, pt)
  row = {"key": key, "date": datetime.date.today().isoformat(),
         "device": device_name(a, plan, pt), "launcher": plan.launcher, "tag": plan.tag,
         **dataclasses.asdict(pt), "model_sets": dict(pt.model_sets), "devices": n,
         "global_batch": pt.batch * pt.accum * n, "steps": plan.steps,
         "log_every": plan.log_every, "sets": dict(plan.sets), "env": list(plan.env),
         "data": os.path.abspath(plan.data), "peak_bytes": None, "param_count": None, **peak,
         "workdir": os.path.abspath(workdir)}
  if a.budget_gb and row["peak_bytes"] and row["peak_bytes"] > a.budget_gb * 2**30:
    row.update(status="failed", reason=(
        f"out-of-memory: compiled peak {row['peak_bytes'] / 2**30:.3g} GiB per device > "
        f"--budget-gb {a.budget_gb:g} (not run)"))
  else:
    # The 1-minute load average around the run: on a shared machine, what the rates shared.
    load = os.getloadavg()[0]
    row.update(run_point(a, plan, pt, workdir))
    row["load_avg"] = [round(load, 2), round(os.getloadavg()[0], 2)]
  sg.save_row(a.output, row)
  return row


def root_relative(path: str) -> str:
  full = os.path.abspath(path)
  return os.path.relpath(full, ROOT) if full.startswith(ROOT + os.sep) else full


def parse_args(argv=None):
  p = Parser(prog="sweep.py", description=__doc__,
             formatter_class=argparse.RawDescriptionHelpFormatter,
             epilog="Axes, measurements and launchers: see tools/sweep.py's docstring.")
  p.add_argument("--data", required=True, metavar="DIR", help="a prepared dataset directory")
  p.add_argument("--output", required=True, type=output_file, metavar="JSONL",
                 help="results file (resumed)")
  p.add_argument("--config", type=lambda s: s.split(","), default=["configs/tiny.py"],
                 help="config file(s), comma-separated (default configs/tiny.py)")
  p.add_argument("--model", action="append", metavar="LABEL:KEY=V[,KEY=V]",
                 help="a model variant (repeatable; default: each config as it is)")
  p.add_argument("--processes", type=int_list("--processes", 1), default=[1])
  p.add_argument("--workers", type=int_list("--workers", 0), default=[0],
                 help="data.workers values")
  p.add_argument("--batch", type=int_list("--batch", 1), default=[8],
                 help="per-device microbatch sizes")
  p.add_argument("--accum", type=int_list("--accum", 1), default=[1],
                 help="train.grad_accum_steps values")
  p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                 help="config override for every point (repeatable)")
  p.add_argument("--steps", type=int_list("--steps", 2), default=[30])
  p.add_argument("--log-every", type=int_list("--log-every", 1), default=[5])
  p.add_argument("--timeout", type=int_list("--timeout", 10), default=[600],
                 help="seconds a point may run (Slurm: its time limit, minutes rounded up)")
  p.add_argument("--budget-gb", type=float, default=0.0,
                 help="record points whose compiled peak exceeds this as out-of-memory")
  p.add_argument("--probe", action=argparse.BooleanOptionalAction, default=None,
                 help="compile each step for its peak memory (default: on for local)")
  p.add_argument("--launcher", choices=["local", "slurm"], default="local")
  p.add_argument("--devices-per-process", type=int_list("--devices-per-process", 1),
                 default=[1], help="local, CPU: DEVICES_PER_PROCESS")
  p.add_argument("--gpus-per-node", type=int_list("--gpus-per-node", 1), default=[2],
                 help="slurm: GPUs (= training tasks) per node")
  p.add_argument("--slurm-arg", action="append", default=[], help="extra sbatch argument")
  p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                 help="environment of the launched runs (repeatable; part of the point)")
  p.add_argument("--tag", default="", help="a label stored in each row (tells variants apart)")
  p.add_argument("--runs", metavar="DIR",
                 help="run directories (default: runs/sweep-<OUTPUT stem>)")
  p.add_argument("--retry-failed", action="store_true", help="rerun points recorded as failed")
  p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
  a = p.parse_args(argv)
  # Runs start in the checkout (launch/*.sh): configs relative to it, the dataset absolute.
  a.config = [root_relative(c) for c in a.config]
  a.data = os.path.abspath(a.data)
  for flag in ("steps", "log_every", "timeout", "devices_per_process", "gpus_per_node"):
    values = getattr(a, flag)
    if len(values) != 1:
      p.error(f"--{flag.replace('_', '-')} takes one value (got {values})")
    setattr(a, flag, values[0])
  if a.steps < 2 * a.log_every:
    p.error(f"--steps {a.steps} with --log-every {a.log_every}: need at least two logging "
            "windows (the first, with start-up, is not measured)")
  if not os.path.isfile(os.path.join(a.data, "metadata.json")):
    p.error(f"--data {a.data}: not a prepared dataset (no metadata.json)")
  if not (a.budget_gb >= 0):
    p.error(f"--budget-gb {a.budget_gb}: expected a number >= 0")
  if any("=" not in kv for kv in a.env):
    p.error(f"--env {a.env}: expected KEY=VALUE")
  a.sets = [kv for s in a.sets for kv in sg.key_values(s, "--set")]
  for key, _ in a.sets:
    if key in sg.GRID_KEYS:
      p.error(f"--set {key}: set by the sweep; use {sg.GRID_KEYS[key]}")
  a.probe = a.launcher == "local" if a.probe is None else a.probe
  return a


def main(argv=None) -> int:
  return guarded(lambda: sweep(parse_args(argv)),
                 "rerun the same command: finished points are kept and skipped")


if __name__ == "__main__":
  sys.exit(main())
