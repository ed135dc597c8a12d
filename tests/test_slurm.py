"""The Slurm path with real processes: launch/slurm.sbatch under a fake Slurm (srun/scontrol on
PATH that record their calls and run the real tasks: lmscale stage, python -m lmscale_jax.main
on a tiny model), and two jobs whose derived coordinator ports collide.

Signals are real and go where Slurm sends them: SIGUSR1 (--signal=USR1@120) to the training
task only; SIGTERM (time limit, preemption, scancel) to the batch shell and its step alike.
Every subprocess has a timeout and runs in its own session, killed whole on failure.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from lmscale_jax.cluster import run_state
from lmscale_jax.store import dataset, file_io
from tests.helpers import communicate, make_synthetic_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH = os.path.join(ROOT, "launch", "slurm.sbatch")
# Test-only: halves XLA:CPU compile time; every run here compiles the same program.
FAST_XLA = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
JOB = "777"

FAKE_SRUN = r"""#!/bin/bash
# Records the call, drops srun's options and runs the command as one task of a step (Slurm's
# step variables set), outliving a SIGTERM until its task exits, as srun does.
echo "srun $*" >> "$FAKE_SLURM/calls.log"
while [[ "${1:-}" == -* ]]; do shift; done
step=$(cat "$FAKE_SLURM/next_step" 2>/dev/null || echo 0)
echo $((step + 1)) > "$FAKE_SLURM/next_step"
trap ':' TERM
SLURM_STEP_ID=$step SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NODEID=0 SLURM_STEP_NUM_TASKS=1 \
  SLURM_STEP_NODELIST=localhost SLURM_STEP_TASKS_PER_NODE=1 "$@" &
task=$!
echo "$task" > "$FAKE_SLURM/task.pid"
while :; do
  rc=0
  wait "$task" || rc=$?
  kill -0 "$task" 2>/dev/null || break
done
exit $rc
"""
FAKE_SCONTROL = r"""#!/bin/bash
echo "scontrol $*" >> "$FAKE_SLURM/calls.log"
if [[ "$1" == show ]]; then echo "JobId=$3 JobName=lmscale JobState=${FAKE_JOB_STATE:-RUNNING}"; fi
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  d = tmp_path_factory.mktemp("shared") / "bin"
  make_synthetic_dataset(str(d), seq_len=32, vocab_size=64, n_train=64, n_val=16)
  return str(d)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  """One persistent XLA cache: every run after the first skips compiling the same program."""
  return str(tmp_path_factory.mktemp("xla_cache"))


def train_args(workdir, steps) -> list[str]:
  opts = {"model.layers": 1, "model.hidden": 32, "model.heads": 2, "model.ffn": 64,
          "train.batch_size": 8, "train.steps": steps, "train.warmup_steps": 1,
          "train.log_every": 1, "train.eval_every": 100000, "train.eval_batches": 1,
          "checkpoint.every": 100000}
  return [f"--config={ROOT}/configs/tiny.py", f"--workdir={workdir}",
          *(f"--config.{k}={v}" for k, v in opts.items())]


def clean_env(cache, **extra) -> dict:
  env = {k: v for k, v in os.environ.items() if not k.startswith(("LMSCALE_", "SLURM_"))}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_XLA, PYTHONUNBUFFERED="1",
             JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
  env.pop("JAX_NUM_CPU_DEVICES", None)
  env.update(extra)
  return env


def last_step(workdir) -> int:
  try:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      steps = [json.loads(line).get("step", 0) for line in f if line.endswith("\n")]
  except OSError:
    return 0
  return max(steps, default=0)


def wait_for(procs, condition, timeout=120.0):
  deadline = time.monotonic() + timeout
  while not condition():
    for p in procs:
      if p.poll() is not None:
        raise AssertionError(f"exited early ({p.returncode}): {p.communicate()[1][-3000:]}")
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.02)


# ----------------------------------------------------------------------------- slurm.sbatch
class FakeSlurm:
  """A job of launch/slurm.sbatch on this machine: one node, one training task."""

  def __init__(self, tmp_path, data, cache, restart_count=0, job_state="RUNNING", **env):
    self.dir = tmp_path / "slurm"
    (self.dir / "bin").mkdir(parents=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
      (self.dir / "bin" / name).write_text(text)
      os.chmod(self.dir / "bin" / name, 0o755)
    self.env = clean_env(
        cache, PATH=f"{self.dir / 'bin'}:{os.environ['PATH']}", FAKE_SLURM=str(self.dir),
        FAKE_JOB_STATE=job_state, SLURM_SUBMIT_DIR=ROOT, SLURM_JOB_ID=JOB,
        SLURM_RESTART_COUNT=str(restart_count), SLURM_JOB_NUM_NODES="1",
        SLURM_JOB_NODELIST="localhost", SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1",
        SLURM_CPUS_PER_TASK="2", SLURM_JOB_CPUS_PER_NODE="6(x1)", DATA_SRC=data,
        DATA_DIR=str(tmp_path / "local" / "bin"), PYTHON=sys.executable, **env)

  def start(self, args) -> subprocess.Popen:
    return subprocess.Popen(["bash", SBATCH, *args], cwd=ROOT, env=self.env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)

  def calls(self) -> list[str]:
    return (self.dir / "calls.log").read_text().splitlines()

  def requeues(self) -> int:
    return self.calls().count(f"scontrol requeue {JOB}")

  def task_pid(self) -> int:
    return int((self.dir / "task.pid").read_text())


def run_job(job: FakeSlurm, args, signal_when_training=None) -> str:
  """The batch script to its end; ``signal_when_training(batch, job)`` once step 2 is logged."""
  batch = job.start(args)
  try:
    if signal_when_training:
      workdir = next(a.split("=", 1)[1] for a in args if a.startswith("--workdir="))
      wait_for([batch], lambda: last_step(workdir) >= 2)
      signal_when_training(batch, job)
    out, err = communicate(batch)
  finally:
    if batch.poll() is None:
      os.killpg(batch.pid, signal.SIGKILL)
  assert batch.returncode == 0, out[-3000:] + err[-3000:]
  return out


def usr1_to_the_task(batch, job):  # --signal=USR1@120: the tasks only, not the batch shell
  os.kill(job.task_pid(), signal.SIGUSR1)


def sigterm_to_the_job(batch, job):  # time limit / preemption: batch shell and step alike
  os.killpg(batch.pid, signal.SIGTERM)


def preempted_state(workdir) -> dict:
  state = run_state.read(str(workdir))
  assert state["state"] == "preempted" and 2 <= state["step"] < 5000, state
  return state


@pytest.mark.parametrize("restarts,requeued", [(0, 1), (20, 0)], ids=["requeues", "cap"])
def test_usr1_to_the_task_requeues_once_below_the_cap(tmp_path, data, cache, restarts,
                                                      requeued):
  """The time-limit signal: the task checkpoints and exits 0; run_state.json names this
  allocation; one requeue, none once MAX_REQUEUES (20) requeues were made."""
  job = FakeSlurm(tmp_path, data, cache, restart_count=restarts)
  workdir = tmp_path / "w"
  out = run_job(job, train_args(workdir, steps=5000), usr1_to_the_task)
  state = preempted_state(workdir)
  assert (state["slurm_job_id"], state["slurm_restart_count"]) == (JOB, restarts)
  assert job.requeues() == requeued, out
  if not requeued:
    assert "requeued 20 times already (MAX_REQUEUES=20)" in out, out


@pytest.mark.parametrize("job_state,requeued", [("RUNNING", 1), ("CANCELLED", 0)],
                         ids=["preempted", "scancel"])
def test_sigterm_to_the_batch_shell_waits_for_the_checkpoint_then_decides(
    tmp_path, data, cache, job_state, requeued):
  """SIGTERM to the batch shell and its step: the trap keeps the shell alive until the task
  has checkpointed and exited; then one requeue (none for a cancelled job)."""
  job = FakeSlurm(tmp_path, data, cache, job_state=job_state)
  workdir = tmp_path / "w"
  out = run_job(job, train_args(workdir, steps=5000), sigterm_to_the_job)
  preempted_state(workdir)
  assert "batch shell: SIGTERM; waiting for the training step" in out
  assert job.requeues() == requeued, out


def test_a_finished_run_is_not_requeued_and_srun_gets_cpus(tmp_path, data, cache):
  """Also: --cpus-per-task given to srun explicitly (the job's for training, the whole node
  for staging), and the default DATA_DIR carries a hash of the source's real path."""
  user = f"lmscale-test-{uuid.uuid4().hex[:8]}"
  job = FakeSlurm(tmp_path, data, cache, USER=user)
  del job.env["DATA_DIR"]
  workdir = tmp_path / "w"
  try:
    out = run_job(job, train_args(workdir, steps=3))
    real = os.path.realpath(data)
    expected_dir = (f"/tmp/{user}/lmscale/bin-"
                    f"{hashlib.sha256(real.encode()).hexdigest()[:8]}")
    assert dataset.DatasetMeta.load(expected_dir).verify() == []
  finally:
    shutil.rmtree(f"/tmp/{user}", ignore_errors=True)
  assert run_state.read(str(workdir))["state"] == "finished"
  assert job.requeues() == 0 and "no requeue: the run finished at step 3" in out, out
  stage, train = [c for c in job.calls() if c.startswith("srun")]
  assert "lmscale_jax.cli.lmscale stage" in stage and "--ntasks-per-node=1" in stage
  assert "--cpus-per-task=6" in stage and f"{data} {expected_dir}" in stage
  assert "lmscale_jax.main" in train and "--cpus-per-task=2" in train
  assert f"--config.data.path={expected_dir}" in train


def test_a_stale_preempted_state_is_not_requeued(tmp_path, data, cache):
  """run_state.json says "preempted", written by the previous allocation of this job; this one
  trains nothing (--dry_run): no requeue, or every allocation would requeue the next."""
  workdir = tmp_path / "w"
  os.makedirs(workdir)
  file_io.atomic_write_json(str(workdir / "run_state.json"), run_state.record(
      "preempted", 40, 100, str(workdir / "checkpoints" / "40"),
      env={"SLURM_JOB_ID": JOB, "SLURM_RESTART_COUNT": "0"}))
  job = FakeSlurm(tmp_path, data, cache, restart_count=1)
  out = run_job(job, [*train_args(workdir, steps=100), "--dry_run"])
  assert job.requeues() == 0, out
  assert (f"written by job {JOB} restart 0, not by this allocation (job {JOB} restart 1): "
          "stale") in out, out


@pytest.mark.parametrize("argv", [[], ["bogus", "w"], ["step"], ["requeue", "w"],
                                  ["requeue", "w", "--since-step", "x"]])
def test_a_bad_run_state_command_line_is_exit_1_and_one_line(argv, capsys):
  """Every entry point's code for a bad command line (not argparse's 2 and usage block); to
  the batch script's requeue call, 1 is "no requeue" as well."""
  with pytest.raises(SystemExit) as e:
    run_state.main(argv)
  err = capsys.readouterr().err
  assert e.value.code == 1 and err.count("\n") == 1 and err.startswith("error: "), err


def test_the_batch_scripts_run_state_call_with_a_bad_argument_is_one_line(tmp_path):
  r = subprocess.run([sys.executable, "-m", "lmscale_jax.cluster.run_state", "requeue",
                      str(tmp_path), "--since-step", "x"], cwd=ROOT, capture_output=True,
                     text=True, timeout=60, stdin=subprocess.DEVNULL)
  assert (r.returncode, r.stdout) == (1, "")
  assert r.stderr.splitlines() == ["error: argument --since-step: invalid int value: 'x' (see "
                                   "python -m lmscale_jax.cluster.run_state requeue --help)"]


# ----------------------------------------------------------------------------- port clash
def free(port: int) -> bool:
  with socket.socket() as s:
    try:
      s.bind(("", port))
      return True
    except OSError:
      return False


def test_second_job_on_a_taken_coordinator_port_refuses_and_the_first_finishes(
    tmp_path, data, cache):
  """Jobs 1000 and 5096 derive the same port (61440 + id % 4096) and share a first node. The
  second job's process 0 finds the port taken and says so; its process 1 never registers with
  the first job's coordinator (which would abort that job); the first job trains on and ends
  cleanly (SIGTERM: checkpoint, exit 0)."""
  from lmscale_jax.cluster import topology

  first_id = next(j for j in range(1000, 1100) if free(topology.slurm_port(
      {"SLURM_JOB_ID": str(j)})))
  second_id = first_id + 4096
  port = topology.slurm_port({"SLURM_JOB_ID": str(first_id), "SLURM_STEP_ID": "0"})
  assert port == topology.slurm_port({"SLURM_JOB_ID": str(second_id), "SLURM_STEP_ID": "0"})

  def task(job_id, i, workdir):
    env = clean_env(cache, SLURM_JOB_ID=str(job_id), SLURM_STEP_ID="0", SLURM_PROCID=str(i),
                    SLURM_LOCALID=str(i), SLURM_NODEID="0", SLURM_NTASKS="2",
                    SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST="localhost",
                    SLURM_STEP_TASKS_PER_NODE="2", JAX_NUM_CPU_DEVICES="1")
    args = [*train_args(workdir, steps=100000), f"--config.data.path={data}",
            "--config.distributed.initialization_timeout=60"]
    return subprocess.Popen([sys.executable, "-m", "lmscale_jax.main", *args], cwd=ROOT,
                            env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)

  first_dir, second_dir = tmp_path / "first", tmp_path / "second"
  first = [task(first_id, i, first_dir) for i in range(2)]
  second = []
  try:
    # Its runtime is up once preflight has written its shared-workdir check file.
    wait_for(first, lambda: os.path.exists(first_dir / ".lmscale_shared_check"))
    second = [task(second_id, i, second_dir) for i in range(2)]
    second_err = [communicate(p, 90)[1] for p in second]
    after = last_step(first_dir)
    wait_for(first, lambda: last_step(first_dir) >= after + 3)  # trains on after the second
    for p in first:
      p.send_signal(signal.SIGTERM)
    first_err = [communicate(p, 90)[1] for p in first]
  finally:
    for p in first + second:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
  assert [p.returncode for p in second] == [1, 1], second_err
  assert (f"coordinator port {port} on {socket.gethostname()} is already in use" in
          second_err[0] and "LMSCALE_COORDINATOR_PORT" in second_err[0]), second_err[0][-3000:]
  assert ("not as this job's process 0" in second_err[1]
          or "held by another job" in second_err[1]), second_err[1][-3000:]
  assert [p.returncode for p in first] == [0, 0], first_err[0][-3000:] + first_err[1][-3000:]
  assert run_state.read(str(first_dir))["state"] == "preempted"
  assert not os.path.exists(second_dir / "metrics.jsonl")
