"""Running lmscale sweep's grid: each point's launch command (launch/local.sh, or
``sbatch --wait launch/slurm.sbatch``), the compiled peak memory of each distinct training step
(compiled in a fresh process per device count, nothing run), one bounded run per point in its
own run directory, and its row in the resumable results file.

The grid itself, each point's overrides and identity, a finished run's medians and a failed
one's reason are :mod:`lmscale_jax.study.sweep_grid`'s; the table printed at the end is
:mod:`lmscale_jax.study.report`'s. No JAX in this process: it plans, launches and reads.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from typing import Callable

from lmscale_jax import child_process
from lmscale_jax.study import sweep_grid as sg
from lmscale_jax.study.host import ROOT, checkout_importable, cpu_name
from lmscale_jax.study.sweep_grid import Plan, Point, SweepError

MARKER = "sweep_point.json"  # written in every run directory this module makes (and may remove)


@dataclasses.dataclass(frozen=True)
class SweepOptions:
  """lmscale sweep's flags, as its parser leaves them (one value each where it takes one;
  configs relative to :data:`ROOT`, the dataset absolute, ``sets`` as (key, value) pairs)."""
  data: str
  output: str
  config: list
  model: list | None
  processes: list
  workers: list
  batch: list
  accum: list
  sets: list
  steps: int
  log_every: int
  timeout: int
  budget_gb: float
  probe: bool
  launcher: str
  devices_per_process: int
  gpus_per_node: int
  slurm_arg: list
  env: list
  tag: str
  runs: str | None
  retry_failed: bool
  dry_run: bool


def say(line: str) -> None:
  """Progress of a sweep that runs for hours: each line as it happens."""
  print(line, flush=True)


# ----------------------------------------------------------------------------- the host
def gpu_count() -> int:
  """GPUs launch/local.sh would use (none with JAX_PLATFORMS=cpu)."""
  if os.environ.get("JAX_PLATFORMS") == "cpu" or not shutil.which("nvidia-smi"):
    return 0
  out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
  return sum(line.startswith("GPU") for line in out.splitlines())


def device_name(o: SweepOptions, plan: Plan, pt: Point) -> str:
  if plan.launcher == "slurm":
    return f"slurm: {o.gpus_per_node} gpu(s) per node"
  if plan.gpus >= pt.processes:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.splitlines()
    return f"gpu: {out[0] if out else 'unknown'}"
  return cpu_name()


# ----------------------------------------------------------------------------- commands
def main_args(plan: Plan, pt: Point, workdir: str) -> list[str]:
  # Under Slurm the job stages DATA_SRC and passes its node-local copy as data.path itself.
  sets = [(k, v) for k, v in sg.point_sets(plan, pt)
          if not (plan.launcher == "slurm" and k == "data.path")]
  return [f"--config={pt.config}", f"--workdir={workdir}",
          *(f"--config.{k}={v}" for k, v in sets)]


def command(o: SweepOptions, plan: Plan, pt: Point, workdir: str) -> tuple[list[str], dict]:
  """The command that runs a point, and the environment it adds."""
  env = dict(kv.split("=", 1) for kv in plan.env)
  if plan.launcher == "local":
    env.setdefault("DEVICES_PER_PROCESS", str(plan.devices_per_process))
    return ["bash", os.path.join(ROOT, "launch/local.sh"), str(pt.processes), "--",
            *main_args(plan, pt, workdir)], env
  per_node = min(pt.processes, o.gpus_per_node)  # one task per GPU
  exports = ",".join(["ALL", f"DATA_SRC={os.path.abspath(plan.data)}",
                      *(f"{k}={v}" for k, v in env.items())])
  return ["sbatch", "--wait", f"--nodes={pt.processes // per_node}",
          f"--ntasks-per-node={per_node}", f"--gpus-per-node={per_node}",
          f"--time={-(-o.timeout // 60)}", f"--job-name=sweep-{sg.point_key(plan, pt)[:8]}",
          f"--output={workdir}/slurm-%j.out", f"--export={exports}", *o.slurm_arg,
          os.path.join(ROOT, "launch/slurm.sbatch"), *main_args(plan, pt, workdir)], {}


# ----------------------------------------------------------------------------- compiled peak
# The child's whole program: JAX fixes its device count at start-up, so each count needs a
# fresh interpreter. argv: the specs file, the output file.
PROBE = ("import sys; from lmscale_jax.study.sweep import compile_peaks; "
         "compile_peaks(sys.argv[1], sys.argv[2])")


def compile_peaks(spec_file: str, out_file: str) -> None:
  """(In the child) each spec's compiled peak bytes per device, parameter count, sequence
  length and flops per step, or its one-line compilation error, as JSON to ``out_file``."""
  from lmscale_jax.model import flops
  from lmscale_jax.store import dataset
  from lmscale_jax.pretrain import mlm
  from lmscale_jax.pretrain import trainer

  specs, out, meta = json.load(open(spec_file)), {}, None
  for spec in specs:
    try:
      c = sg.load_config(spec["config"], spec["sets"])
      meta = meta or dataset.DatasetMeta.load(c.data.path)
      s = trainer.build_setup(c, meta)
      st = mlm.build_steps(c, s.model_cfg, s.predictions)
      batch = flops.abstract_batch(c.train.batch_size, meta.seq_len, s.predictions,
                                   st.batch_sharding)
      m = st.train_step.lower(st.abstract_state, batch).compile().memory_analysis()
      out[spec["id"]] = {"peak_bytes": flops.peak_bytes(m), "param_count": s.param_count,
                         "seq_len": meta.seq_len, "flops_per_step": s.flops_per_step}
    except Exception as e:  # a point that does not compile is a row saying why, not the end
      out[spec["id"]] = {"probe_error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
  json.dump(out, open(out_file, "w"))


def probe(o: SweepOptions, plan: Plan, points: list[Point], scratch: str,
          log: Callable[[str], None] = say) -> dict:
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
    log(f"sweep: compiling {len(specs)} training step(s) on {n} device(s) for their peak "
        "memory")
    for ident, result in probe_devices(o, plan, n, specs, scratch).items():
      found[(n, ident)] = result
  return {pt: found[wanted[pt]] for pt in points}


def probe_devices(o: SweepOptions, plan: Plan, n: int, specs: dict, scratch: str) -> dict:
  """One child process compiling ``specs`` on ``n`` devices (CPU devices where this machine
  has fewer GPUs); a spec it did not answer gets the child's last error line."""
  spec_file, out_file = (os.path.join(scratch, f"probe-{n}.{x}") for x in ("in", "out"))
  with open(spec_file, "w") as f:
    json.dump([{"id": i, **s} for i, s in specs.items()], f)
  env = dict(os.environ, PYTHONPATH=ROOT)
  if plan.gpus < n:
    env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(n))
  try:
    # Ends with the sweep (a compilation can take minutes): it starts nothing of its own.
    r = subprocess.run([sys.executable, "-c", PROBE, spec_file, out_file], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=o.timeout,
                       preexec_fn=functools.partial(child_process.die_with_parent, os.getpid(),
                                                    watch=False))
    got = json.load(open(out_file)) if r.returncode == 0 else {}
    why = (r.stderr.strip().splitlines() or ["no output"])[-1][:300]
  except subprocess.TimeoutExpired:
    got, why = {}, f"compilation still running after --timeout {o.timeout} s"
  return {ident: got.get(ident, {"probe_error": why}) for ident in specs}


# ----------------------------------------------------------------------------- one run
def run_point(o: SweepOptions, plan: Plan, pt: Point, workdir: str) -> dict:
  if os.path.exists(workdir):  # an interrupted attempt: start afresh, not from its checkpoint
    if not os.path.exists(os.path.join(workdir, MARKER)):
      raise SweepError(f"{workdir} exists but was not made by lmscale sweep: remove it or "
                       "give another --runs")
    shutil.rmtree(workdir)
  os.makedirs(workdir)
  cmd, env = command(o, plan, pt, workdir)
  with open(os.path.join(workdir, MARKER), "w") as f:
    json.dump({"point": dataclasses.asdict(pt), "command": cmd, "env": env}, f)
  log_path = os.path.join(workdir, "sweep.log")
  t0, timed_out = time.monotonic(), False
  with open(log_path, "w") as log:
    try:
      # Its own process group, so a timeout stops the launcher and every process it started.
      # And it ends with the sweep, however the sweep ends: the point is rerun from scratch
      # (see above), so a run left behind only takes the CPUs or GPUs from the rerun's
      # measurement, and its workdir from under it (seen: a point's training processes alive
      # under ppid 1 after a kill -9 of the sweep). PDEATHSIG reaches the launcher alone, so
      # SIGTERM, which it passes on to every process it started (they checkpoint and exit,
      # launch/_procs.sh); SIGKILL would leave those orphaned. This thread waits for the run,
      # so it outlives it as PDEATHSIG needs. Slurm: it ends `sbatch --wait`; the job keeps its
      # time limit (--timeout).
      proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=log,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              start_new_session=True, preexec_fn=functools.partial(
                                  child_process.die_with_parent, os.getpid(), signal.SIGTERM,
                                  watch=False))
    except OSError as e:
      return {"status": "failed", "reason": f"launch failed: {e}", "wall_s": 0.0}
    try:  # under Slurm the job's time limit bounds the run (the queue wait is unbounded)
      rc = proc.wait(timeout=None if plan.launcher == "slurm" else o.timeout)
    except subprocess.TimeoutExpired:
      timed_out = True
      rc = stop(proc)
    except BaseException:  # Ctrl-C, or SIGTERM (cli/args.guarded): the run stops first
      stop(proc)
      raise
  wall = time.monotonic() - t0
  return outcome(o, workdir, log_path, rc, timed_out, wall)


def outcome(o: SweepOptions, workdir: str, log_path: str, rc: int, timed_out: bool,
            wall: float) -> dict:
  """A finished run's status, reason and medians, from its log (and Slurm's) and metrics."""
  text = open(log_path, errors="replace").read()
  for name in sorted(f for f in os.listdir(workdir) if f.startswith("slurm-")):
    text += open(os.path.join(workdir, name), errors="replace").read()
  found = sg.summarize(workdir)
  if rc == 0 and not timed_out and found["windows"] >= 1:
    return {"status": "ok", "reason": None, "wall_s": wall, **found}
  reason = (sg.failure_reason(rc, text, timed_out, o.timeout) if rc or timed_out else
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


def run_and_record(o: SweepOptions, plan: Plan, pt: Point, runs: str, peak: dict) -> dict:
  key = sg.point_key(plan, pt)
  workdir = os.path.join(runs, key)
  n = sg.devices(plan, pt)
  row = {"key": key, "date": datetime.date.today().isoformat(),
         "device": device_name(o, plan, pt), "launcher": plan.launcher, "tag": plan.tag,
         **dataclasses.asdict(pt), "model_sets": dict(pt.model_sets), "devices": n,
         "global_batch": pt.batch * pt.accum * n, "steps": plan.steps,
         "log_every": plan.log_every, "sets": dict(plan.sets), "env": list(plan.env),
         "data": os.path.abspath(plan.data), "peak_bytes": None, "param_count": None, **peak,
         "workdir": os.path.abspath(workdir)}
  if o.budget_gb and row["peak_bytes"] and row["peak_bytes"] > o.budget_gb * 2**30:
    row.update(status="failed", reason=(
        f"out-of-memory: compiled peak {row['peak_bytes'] / 2**30:.3g} GiB per device > "
        f"--budget-gb {o.budget_gb:g} (not run)"))
  else:
    # The 1-minute load average around the run: on a shared machine, what the rates shared.
    load = os.getloadavg()[0]
    row.update(run_point(o, plan, pt, workdir))
    row["load_avg"] = [round(load, 2), round(os.getloadavg()[0], 2)]
  sg.save_row(o.output, row)
  return row


# ----------------------------------------------------------------------------- the sweep
def plan_points(o: SweepOptions) -> tuple[Plan, list[Point]]:
  """The plan and its points; every config and override loads (and Slurm's node counts are
  whole) before anything runs."""
  plan = Plan(data=o.data, steps=o.steps, log_every=o.log_every, sets=tuple(o.sets),
              env=tuple(o.env), launcher=o.launcher,
              devices_per_process=o.devices_per_process,
              gpus=gpu_count() if o.launcher == "local" else 0, tag=o.tag)
  points = sg.grid(o.config, o.model, o.processes, o.workers, o.batch, o.accum)
  for pt in points:
    with checkout_importable():
      sg.load_config(pt.config, sg.point_sets(plan, pt), root=ROOT)
    if o.launcher == "slurm" and pt.processes > o.gpus_per_node and (
        pt.processes % o.gpus_per_node):
      raise SweepError(f"--processes {pt.processes}: not a whole number of nodes of "
                       f"--gpus-per-node {o.gpus_per_node}")
  return plan, points


def runs_dir(o: SweepOptions) -> str:
  return o.runs or os.path.join(ROOT, "runs", "sweep-" + os.path.splitext(
      os.path.basename(o.output))[0])


def dry_run(o: SweepOptions) -> list[str]:
  """Every point's command line (its added environment first), shell-quoted; runs nothing."""
  plan, points = plan_points(o)
  lines = []
  for pt in points:
    cmd, env = command(o, plan, pt, os.path.join(runs_dir(o), sg.point_key(plan, pt)))
    lines.append(" ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()),
                           *map(shlex.quote, cmd)]))
  return lines


def sweep(o: SweepOptions, log: Callable[[str], None] = say) -> list[dict]:
  """Runs the points the results file does not hold yet (and, with ``retry_failed``, the
  failed ones), recording each row as it finishes; returns the rows of every point."""
  plan, points = plan_points(o)
  runs = runs_dir(o)
  done = {r["key"]: r for r in sg.read_rows(o.output)}
  todo = [pt for pt in points if sg.point_key(plan, pt) not in done or (
      o.retry_failed and done[sg.point_key(plan, pt)]["status"] != "ok")]
  log(f"sweep: {len(points)} point(s), {len(points) - len(todo)} already in {o.output}")
  peaks = probe(o, plan, todo, os.path.join(runs, "probe"), log) if o.probe and todo else {}
  for i, pt in enumerate(todo, 1):
    row = run_and_record(o, plan, pt, runs, peaks.get(pt, {}))
    log(f"sweep: [{i}/{len(todo)}] {pt.model} processes={pt.processes} "
        f"workers={pt.workers} batch={pt.batch} accum={pt.accum}: {row['status']}"
        + (f" ({row['reason']})" if row["reason"] else
           f", {row['samples_per_sec']:.1f} samples/s, step {row['step_time']:.3f} s"))
  keys = {sg.point_key(plan, pt) for pt in points}
  return [r for r in sg.read_rows(o.output) if r["key"] in keys]


def root_relative(path: str) -> str:
  """``path`` relative to the checkout where it lies inside it (the runs start there)."""
  full = os.path.abspath(path)
  return os.path.relpath(full, ROOT) if full.startswith(ROOT + os.sep) else full
