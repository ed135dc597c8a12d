"""``bench_allreduce.py --train-check``: real 1- and 2-process training step times against the
cluster model's prediction (compute + a calibrated all-reduce of the gradients)."""

from __future__ import annotations

import datetime
import os
import shutil
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RUN_TIMEOUT_S = 900


def _start_train(processes: int, dataset: str, workdir: str, overrides: list[str]):
  cmd = ["bash", os.path.join(ROOT, "launch", "local.sh"), str(processes), "--",
         "--config=configs/tiny.py", f"--config.data.path={dataset}", f"--workdir={workdir}",
         *overrides]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)


def train_runs(processes: int, dataset: str, workdirs: list[str],
               overrides: list[str]) -> list[dict]:
  """Real training runs through launch/local.sh, all started at once (one per workdir); each
  workdir's step time and parameters."""
  from lmscale_jax.study.cluster_model import measured

  started = [(w, _start_train(processes, dataset, w, overrides)) for w in workdirs]
  for workdir, proc in started:
    try:
      _, err = proc.communicate(timeout=_RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
      proc.kill()
      raise RuntimeError(f"training run {workdir} ran past {_RUN_TIMEOUT_S} s") from None
    if proc.returncode != 0:
      tail = err.strip().splitlines()[-1:] or ["(no output)"]
      raise RuntimeError(f"training run {workdir} exited with {proc.returncode}: {tail[0]}")
  return [measured.workdir_step(w) for w in workdirs]


# The runs of one round: (kind, processes, global batch in units of --train-batch, copies).
TRAIN_RUNS = (("1p-shared-a", 1, 2, 1), ("1p-concurrent", 1, 1, 2), ("2p", 2, 2, 1),
              ("1p-shared-b", 1, 2, 1))


def train_check(a, device: str) -> list[dict]:
  """Measured step times of 1 and 2 training processes (global batch 2·--train-batch) against
  the model ``step(P) = compute + all-reduce(float32 gradients, P ranks)``, with the last
  ``fit_of == "all"`` line of --calibration for the all-reduce (one collective: the 2-process
  run reduces its gradients as one buffer, ``train.grad_allreduce=auto`` on CPU processes).

  The compute term is what the cluster model takes as one device's step, without
  communication. The two processes share this machine's two cores (measured: a second
  single-threaded process on the other core halves the first one's speed, so they are not
  independent cores), so it is measured as the 2-process run shares them: ``concurrent`` =
  two 1-process runs at the per-process batch started together (the input of
  ``predicted_step_s``). ``shared`` = one process on all cores at the global batch predicts
  the 1-process run measured by a second ``shared`` run (how well one run predicts another).
  Runs alternate: shared, concurrent, 2 processes, shared; ``--train-rounds`` repeats them
  and each kind's median is used.
  """
  import tempfile

  from lmscale_jax.study.cluster_model import measured

  fit = measured.calibration_fit(a.calibration, "all")
  b = a.train_batch
  common = [f"--config.model.hidden={a.train_hidden}", f"--config.model.ffn={4 * a.train_hidden}",
            "--config.model.heads=4", f"--config.train.steps={a.train_steps}",
            f"--config.train.log_every={a.train_log_every}",
            f"--config.train.eval_every={a.train_steps}", "--config.train.eval_batches=1",
            f"--config.checkpoint.every={a.train_steps}", "--config.checkpoint.async_save=false"]
  now = datetime.datetime.now()
  with tempfile.TemporaryDirectory(prefix="bench_allreduce_") as tmp:
    root = a.train_workdirs or tmp
    seen: dict[str, list[dict]] = {}
    for rnd in range(a.train_rounds):
      for name, procs, batches, copies in TRAIN_RUNS:
        workdirs = [os.path.join(root, f"{name}-{rnd}-{c}") for c in range(copies)]
        for w in workdirs:
          shutil.rmtree(w, ignore_errors=True)  # a fresh run, not a resume
        done = train_runs(procs, a.train_check, workdirs,
                          common + [f"--config.train.batch_size={batches * b}"])
        for run in done:
          run["loadavg_1m"] = os.getloadavg()[0]
          seen.setdefault(name, []).append(run)
        print(f"round {rnd} {name}: step " + ", ".join(
            f"{r['step_time_s'] * 1e3:.1f}" for r in done) + " ms", file=sys.stderr)
  # Each kind's median over the rounds (the machine's load drifts between runs).
  runs = {name: {"step_time_s": statistics.median(r["step_time_s"] for r in rs),
                 "all_step_s": [r["step_time_s"] for r in rs], "params": rs[0]["params"],
                 "windows": sum(r["windows"] for r in rs),
                 "loadavg_1m": statistics.median(r["loadavg_1m"] for r in rs)}
          for name, rs in seen.items()}
  shared, concurrent = runs["1p-shared-a"]["step_time_s"], runs["1p-concurrent"]["step_time_s"]
  grad = 4 * runs["2p"]["params"]
  comm = measured.calibrated_allreduce_s(grad, 2, fit["alpha_s"], fit["beta_bytes_per_s"],
                                              fit.get("cores"))
  rows = []
  for procs, measured, compute in ((1, runs["1p-shared-b"], shared),
                                   (2, runs["2p"], concurrent)):
    predicted = compute + (comm if procs == 2 else 0.0)
    rows.append({"date": now.date().isoformat(), "device": device,
                 "time": now.isoformat(timespec="seconds"), "bench": "allreduce-train-check",
                 "processes": procs, "global_batch": 2 * b, "hidden": a.train_hidden,
                 "params": runs["2p"]["params"], "grad_bytes": grad,
                 "windows": measured["windows"], "rounds": a.train_rounds,
                 "runs_step_s": {k: v["all_step_s"] for k, v in runs.items()},
                 "measured_step_s": measured["step_time_s"],
                 "predicted_step_s": predicted, "error": predicted / measured["step_time_s"] - 1,
                 "predicted_comm_s": comm if procs == 2 else 0.0,
                 "compute_s": compute, "compute_from": "1p-shared-a" if procs == 1 else
                 "1p-concurrent", "shared_compute_s": shared,
                 "concurrent_compute_s": concurrent,
                 "calibration": {"alpha_s": fit["alpha_s"], "beta": fit["beta_bytes_per_s"],
                                 "cores": fit.get("cores"), "time": fit["time"]},
                 "loadavg_1m": measured["loadavg_1m"]})
  return rows
