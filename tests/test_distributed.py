"""Multi-process training on CPU over localhost: topology resolution (config > LMSCALE_* >
Slurm > single), the checkpoint's process count, loss equality of 1/2/4 processes
(launch/local.sh), a resume in 2 processes, per-node staging inside the job, a killed peer, and
start-up errors.

Every subprocess runs in its own session with a timeout and is killed (whole group) on failure:
nothing here can hang CI.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import ml_collections
import numpy as np
import pytest

from lmscale_jax import exits
from lmscale_jax.cluster import run_state, supervisor
from tests.helpers import communicate, make_config, make_synthetic_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Test-only: halves XLA:CPU compile time (LLVM optimisation off). Every run compared here uses
# the same flags, so the comparisons are unaffected.
FAST_XLA = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


# ----------------------------------------------------------------------------- resolution
def dcfg(**overrides) -> ml_collections.ConfigDict:
  """``config.distributed`` of the shared test config, with ``overrides``."""
  return make_config(distributed=overrides).distributed


LM = {"LMSCALE_COORDINATOR": "10.0.0.1:1234", "LMSCALE_NUM_PROCESSES": "4",
      "LMSCALE_PROCESS_ID": "3"}
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "5", "SLURM_NTASKS": "8",
         "SLURM_STEP_NODELIST": "gpu[007-010]", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
         "SLURM_STEP_TASKS_PER_NODE": "2(x4)"}


def test_resolution_order():
  from lmscale_jax.cluster.topology import Topology, resolve

  assert resolve(dcfg(), {}) == Topology()  # nothing set: one process
  t = resolve(dcfg(), LM)
  assert (t.coordinator, t.num_processes, t.process_id, t.multi) == ("10.0.0.1:1234", 4, 3, True)
  assert t.sources["process_id"] == "LMSCALE_PROCESS_ID"
  # config beats env, per field; env beats Slurm, per field
  t = resolve(dcfg(coordinator="head:99", process_id=0), {**SLURM, **LM})
  assert (t.coordinator, t.num_processes, t.process_id) == ("head:99", 4, 0)
  # (Slurm is not consulted at all once config and env name the whole job)
  assert t.sources == {"coordinator": "config", "process_id": "config",
                       "num_processes": "LMSCALE_NUM_PROCESSES"}
  t = resolve(dcfg(), {**SLURM, "LMSCALE_COORDINATOR": "other:1"})
  assert (t.coordinator, t.num_processes, t.process_id) == ("other:1", 8, 5)
  assert resolve(dcfg(mode="single"), {**SLURM, **LM}).multi is False
  # a 1-process job needs no coordinator and never starts the runtime
  assert resolve(dcfg(), {"LMSCALE_NUM_PROCESSES": "1"}).multi is False
  t = resolve(dcfg(local_device_ids="2,3"), {})
  assert t.local_device_ids == (2, 3) and not t.multi


def test_slurm_layouts():
  from lmscale_jax.cluster.topology import expand_hostlist, resolve, slurm_port

  assert expand_hostlist("gpu[007-010]") == ["gpu007", "gpu008", "gpu009", "gpu010"]
  assert expand_hostlist("a-1,r[1-2]n[01,03],x") == ["a-1", "r1n01", "r1n03", "r2n01", "r2n03",
                                                      "x"]
  port = slurm_port(SLURM)
  assert port == 4242 % 4096 + 61440  # JAX's own choice, so both agree
  # one task per GPU (2 tasks on this node, both see its 2 GPUs): the task takes GPU
  # SLURM_LOCALID (more layouts: tests/test_topology.py)
  t = resolve(dcfg(), {**SLURM, "CUDA_VISIBLE_DEVICES": "0,1"})
  assert (t.coordinator, t.num_processes, t.process_id) == (f"gpu007:{port}", 8, 5)
  assert t.local_device_ids == (1,)
  # one task per node: it drives every GPU
  per_node = {**SLURM, "SLURM_NTASKS": "4", "SLURM_PROCID": "2",
              "SLURM_STEP_TASKS_PER_NODE": "1(x4)", "SLURM_LOCALID": "0"}
  t = resolve(dcfg(), per_node)
  assert (t.num_processes, t.process_id, t.local_device_ids) == (4, 2, None)
  # Slurm bound one GPU per task (--gpus-per-task=1): the only visible one
  t = resolve(dcfg(), {**SLURM, "CUDA_VISIBLE_DEVICES": "1"})
  assert t.local_device_ids is None
  # uneven tasks per node ("3,1"): the node with one task owns its GPUs
  t = resolve(dcfg(), {**SLURM, "SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_NODEID": "1",
                       "SLURM_LOCALID": "0", "SLURM_STEP_TASKS_PER_NODE": "3,1",
                       "SLURM_STEP_NODELIST": "n[1-2]"})
  assert t.local_device_ids is None
  assert resolve(dcfg(), {**SLURM, "LMSCALE_COORDINATOR_PORT": "5000"}).coordinator == \
      "gpu007:5000"
  # inside salloc but outside srun (no step variables): a single process
  no_step = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"}
  assert resolve(dcfg(), no_step).multi is False


@pytest.mark.parametrize("env,cfg,match", [
    ({"LMSCALE_NUM_PROCESSES": "2"}, {},
     r"num_processes from LMSCALE_NUM_PROCESSES, but no coordinator .* and no process_id"),
    ({**LM, "LMSCALE_PROCESS_ID": "4"}, {}, r"process id 4 .* is not in \[0, 4\)"),
    (LM, {"coordinator": "nohostport"}, r"coordinator 'nohostport' \(from config\): expected"),
    ({**LM, "LMSCALE_NUM_PROCESSES": "two"}, {}, r"LMSCALE_NUM_PROCESSES='two': expected an int"),
    ({"LMSCALE_LOCAL_DEVICE_IDS": "0,x"}, {}, r"LMSCALE_LOCAL_DEVICE_IDS='0,x'"),
    ({"LMSCALE_NUM_PROCESSES": "1", "LMSCALE_PROCESS_ID": "1"}, {}, r"1-process job"),
    ({}, {"mode": "mpi"}, r"distributed.mode='mpi'"),
    ({**SLURM, "LMSCALE_COORDINATOR_PORT": "x"}, {},
     r"LMSCALE_COORDINATOR_PORT='x': expected an integer"),
    ({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "2(x"}, {},
     r"Slurm tasks-per-node SLURM_STEP_TASKS_PER_NODE='2\(x' \(expected e.g. 2\(x3\),1\)"),
])
def test_bad_settings(env, cfg, match):
  from lmscale_jax.cluster.topology import DistributedError, resolve

  with pytest.raises(DistributedError, match=match):
    resolve(dcfg(**cfg), env)


def test_checkpoint_process_count(tmp_path):
  """checkpoint.check_process_count reads the latest complete step only (Orbax's temporary
  step names are not checkpoints) and creates nothing when there is no checkpoint."""
  from lmscale_jax.train import checkpoint

  for name, writers in (("3", 2), ("6.orbax-checkpoint-tmp-1700000000", 4)):
    data_dir = tmp_path / "w" / "checkpoints" / name / "data"
    data_dir.mkdir(parents=True)
    for p in range(writers):
      (data_dir / f"process_{p}-of-{writers}.json").write_text("{}")
  checkpoint.check_process_count(str(tmp_path / "w"), 2)
  with pytest.raises(checkpoint.IncompatibleCheckpoint,
                     match=r"w/checkpoints/3 was written by 2 process\(es\); this job has 4"):
    checkpoint.check_process_count(str(tmp_path / "w"), 4)
  checkpoint.check_process_count(str(tmp_path / "fresh"), 4)
  assert not (tmp_path / "fresh").exists()


# What the runtime printed (jaxlib 0.10.2) when it ended a survivor, one per kind of loss
# (cut to the part that matters).
PEER_LOST_REPORT = (
    "E1202 06:06:23.469022    3501 coordination_service.cc:1549] [5082623266677572600] Use error "
    "polling to propagate the following error to all tasks: UNAVAILABLE: The following tasks "
    "are unhealthy (stopped sending heartbeats):\n2\nThe tasks have crashed.\n"
    "F1202 06:06:23.470280    3516 client.h:80] Terminating process because the JAX "
    "distributed service detected fatal errors. This most likely indicates that another task "
    "died\n")
BARRIER_REPORT = (
    "F1202 06:00:41.429388    2545 client.h:80] Terminating process because the JAX "
    "distributed service detected fatal errors. absl::Status: INTERNAL: Shutdown barrier has "
    "failed.\nBarrier result: 'INTERNAL: Barrier failed because: task is set to ERROR: "
    "UNAVAILABLE: Task 1 heartbeat timeout. This indicates that the remote task has failed\n")
SERVICE_LOST_REPORT = (
    "F1202 06:02:25.443575    2652 client.h:80] Terminating process because the JAX "
    "distributed service detected fatal errors.\nAdditional GRPC error information from remote "
    "target coordination_service while calling /xla.coordination.CoordinationService/"
    "PollForError:\n:UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:\"Socket "
    "closed\"}\n*** Check failure stack trace: ***\n")


def test_the_lost_process_is_read_from_the_runtimes_report():
  """The service names the task whose heartbeats stopped (directly, or in a failed barrier);
  when the service itself is gone, the coordinator is named if it refuses connections."""
  from lmscale_jax.cluster.topology import Topology

  closed = f"localhost:{free_port()}"  # nothing listens there
  assert supervisor.lost_processes(PEER_LOST_REPORT, 0, closed) == [2]
  assert supervisor.lost_processes(BARRIER_REPORT, 0, closed) == [1]
  assert supervisor.lost_processes(SERVICE_LOST_REPORT, 1, closed) == [0]
  with socket.create_server(("localhost", 0)) as alive:
    listening = f"localhost:{alive.getsockname()[1]}"
    assert supervisor.lost_processes(SERVICE_LOST_REPORT, 1, listening) == []
    line = supervisor.lost_line(SERVICE_LOST_REPORT, Topology(2, 1, listening), ["a", "b"])
  assert line.startswith("the runtime ended this process (exit 75) without naming"), line
  line = supervisor.lost_line(SERVICE_LOST_REPORT, Topology(2, 1, closed), ["n0", "n1"])
  assert line.startswith(f"lost process 0 on n0 (the coordinator, {closed}): it stopped"), line


def test_job_errors_are_user_errors():
  """main prints one line for these (a UserError), and callers catching the builtin base they
  always had still catch them."""
  from lmscale_jax.cluster import distributed
  from lmscale_jax.errors import UserError
  from lmscale_jax.input import staging
  from lmscale_jax.train import checkpoint

  for error, builtin in ((distributed.DistributedError, RuntimeError),
                         (staging.StagingError, RuntimeError),
                         (checkpoint.IncompatibleCheckpoint, ValueError)):
    assert issubclass(error, UserError) and issubclass(error, builtin), error


# ----------------------------------------------------------------------------- processes
def free_port() -> int:
  with socket.socket() as s:
    s.bind(("", 0))
    return s.getsockname()[1]


def base_env(**extra) -> dict:
  env = {k: v for k, v in os.environ.items() if not k.startswith(("LMSCALE_", "SLURM_"))}
  env.update({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": FAST_XLA, "PYTHONUNBUFFERED": "1", **extra})
  return env


def local_sh(n: int, args: list[str], timeout: float = 200, **env) -> subprocess.CompletedProcess:
  p = subprocess.Popen(["bash", os.path.join(ROOT, "launch", "local.sh"), str(n), "--", *args],
                       cwd=ROOT, env=base_env(GRACE_S="15", **env), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, start_new_session=True)
  out, err = communicate(p, timeout)
  return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def spawn(process_id: int, num_processes: int, port: int, args: list[str],
          program: tuple[str, ...] = ("-m", "lmscale_jax.main"), **env) -> subprocess.Popen:
  """Process ``process_id`` of a job on localhost:``port`` (1 CPU device), running ``program``
  (main by default; a tool's script path for the tools that start the same way)."""
  env = base_env(LMSCALE_COORDINATOR=f"localhost:{port}", LMSCALE_NUM_PROCESSES=str(num_processes),
                 LMSCALE_PROCESS_ID=str(process_id), JAX_NUM_CPU_DEVICES="1", **env)
  return subprocess.Popen([sys.executable, *program, *args], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True)


_stderr: dict = {}


def kill_all(procs):
  for p in procs:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGKILL)
  for p in procs:
    _stderr[p.pid] = p.communicate()[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  d = tmp_path_factory.mktemp("ddata") / "ds"
  make_synthetic_dataset(str(d), seq_len=64, vocab_size=128, n_train=256, n_val=32)
  return d


def train_args(data, workdir, **over) -> list[str]:
  """configs/tiny.py cut to 1 layer × 64: 4 processes compiling at once on 2 cores is what
  these tests spend their time on."""
  opts = {"model.layers": 1, "model.hidden": 64, "model.ffn": 128, "train.batch_size": 8,
          "train.steps": 6,
          "train.warmup_steps": 2, "train.log_every": 1, "train.eval_every": 3,
          "train.eval_batches": 2, "checkpoint.every": 3, "data.path": data}
  opts.update(over)
  return [f"--config={ROOT}/configs/tiny.py", f"--workdir={workdir}",
          *(f"--config.{k}={v}" for k, v in opts.items())]


def rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def series(workdir, key="loss"):
  return {row["step"]: row[key] for row in rows(workdir) if key in row}


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
  """The same 6 steps (global batch 8) in 1, 2 and 4 processes. The 2-process run stages the
  dataset itself (data.stage_from): one process per host copies, the other waits."""
  base = tmp_path_factory.mktemp("runs")
  out = {}
  for n in (1, 2, 4):
    workdir = base / f"p{n}"
    extra = {}
    if n == 2:
      extra = {"data.path": base / "local_ds", "data.stage_from": data}
    t0 = time.monotonic()
    result = local_sh(n, train_args(data, workdir, **extra))
    print(f"{n} process(es): {time.monotonic() - t0:.1f} s")
    assert result.returncode == 0, f"{n} processes:\n{result.stderr[-5000:]}"
    out[n] = (workdir, result)
  out["local_ds"] = base / "local_ds"
  return out


def test_losses_match_one_process(runs):
  """Same global batch in 1, 2 and 4 processes (1 CPU device each): the same loss trajectory.

  Tolerance rtol 1e-5: float32 gradient all-reduce over processes sums in another order than
  one device's reduction; measured differences are far smaller (often 0).
  """
  one = series(runs[1][0])
  assert sorted(one) == [1, 2, 3, 4, 5, 6]
  for n in (2, 4):
    other = series(runs[n][0])
    assert sorted(other) == sorted(one)
    np.testing.assert_allclose([other[s] for s in one], [one[s] for s in one], rtol=1e-5)
    rel = max(abs(other[s] - one[s]) / abs(one[s]) for s in one)
    print(f"{n} processes vs 1: max relative loss difference {rel:.2e} over {len(one)} steps")
    ev1, evn = series(runs[1][0], "eval_loss"), series(runs[n][0], "eval_loss")
    assert sorted(evn) == [3, 6]
    np.testing.assert_allclose([evn[s] for s in ev1], [ev1[s] for s in ev1], rtol=1e-5)
  # CPU processes reduce their gradients as one buffer (steps.resolve_grad_allreduce)
  assert "gradient all-reduce: flat (train.grad_allreduce=auto)" in runs[2][1].stderr
  # process 0 logged the topology once
  err4 = runs[4][1].stderr
  assert err4.count("topology: 4 processes × 1 cpu device = 4 global devices; mesh "
                    "{'data': 4}") == 1
  assert "[0] " in err4 and "[3] " in err4


def test_staging_inside_the_job(runs, data):
  """data.stage_from: exactly one process of the host staged; the copy is complete."""
  from lmscale_jax.input import staging
  from lmscale_jax.store import dataset

  err = runs[2][1].stderr
  staged = [line for line in err.splitlines() if "staged " in line]
  assert len(staged) == 1 and staged[0].startswith("[0] "), staged
  local = runs["local_ds"]
  assert staging.read_state(str(local))["status"] == "complete"
  assert dataset.DatasetMeta.load(str(local)).verify() == []


def test_two_process_checkpoint_resumes_exactly(runs, data, tmp_path):
  """A checkpoint written by 2 processes resumes in 2 processes with bit-identical losses."""
  straight = runs[2][0]
  ckpt = straight / "checkpoints" / "3" / "data"
  assert sorted(f for f in os.listdir(ckpt) if f.endswith(".json")) == [
      "process_0-of-2.json", "process_1-of-2.json"]
  workdir = tmp_path / "resumed"
  shutil.copytree(straight, workdir)
  # as if the run had stopped after step 3's checkpoint
  shutil.rmtree(workdir / "checkpoints" / "6")
  with open(workdir / "metrics.jsonl", "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows(straight) if row["step"] <= 3)
  result = local_sh(2, train_args(data, workdir, **{"data.path": runs["local_ds"]}))
  assert result.returncode == 0, result.stderr[-5000:]
  assert "resumed from" in result.stderr
  a, b = series(straight), series(workdir)
  assert [a[s] for s in (4, 5, 6)] == [b[s] for s in (4, 5, 6)]  # bitwise
  # a different process count is refused before any step, in every process
  longer = {"data.path": runs["local_ds"], "train.steps": 9}
  result = local_sh(4, train_args(data, workdir, **longer))
  assert result.returncode != 0
  assert result.stderr.count("was written by 2 process(es); this job has 4") >= 4, \
      result.stderr[-3000:]
  result = local_sh(1, train_args(data, workdir, **longer))
  assert result.returncode != 0 and "was written by 2 process(es); this job has 1" in result.stderr


def start_and_kill(data, workdir, processes: int, victim: int, heartbeat: int, **over):
  """``processes`` processes train until a step is logged (and ``over``'s checkpoint, if
  any, is written); then ``kill -9`` of ``victim``. Returns (procs, stderr by process,
  seconds from the kill to each survivor's exit)."""
  port = free_port()
  opts = {"train.steps": 100000, "train.eval_every": 100000, "checkpoint.every": 100000,
          "train.batch_size": 12, "distributed.heartbeat_timeout": heartbeat, **over}
  args = train_args(data, workdir, **opts)
  procs = [spawn(i, processes, port, args) for i in range(processes)]
  ready = (lambda: (workdir / "checkpoints" / str(over["checkpoint.every"])).exists()) \
      if "checkpoint.every" in over else (lambda: bool(series(workdir)))
  elapsed = {}
  try:
    deadline = time.monotonic() + 150
    while not (workdir / "metrics.jsonl").exists() or not ready():
      assert time.monotonic() < deadline, "training did not start"
      assert all(p.poll() is None for p in procs), procs[0].communicate()[1][-3000:]
      time.sleep(0.2)
    procs[victim].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    for i, p in enumerate(procs):
      if i != victim:
        p.wait(timeout=heartbeat + 30)
        elapsed[i] = time.monotonic() - killed
  finally:
    kill_all(procs)
  return procs, {i: _stderr[p.pid] for i, p in enumerate(procs)}, elapsed


@pytest.mark.parametrize("processes,victim", [(2, 1), (2, 0), (3, 0), (3, 1), (3, 2)])
def test_a_lost_process_ends_every_other_with_one_line(data, tmp_path, processes, victim):
  """kill -9 of one process mid-run (victim 0 is the coordinator: the survivors lose the
  runtime's service itself): every survivor exits 75 within the heartbeat timeout with one
  ``error:`` line naming the lost process and its host, and no C++ or Python trace
  (lmscale_jax/cluster/supervisor.py turns the runtime's abort into that line)."""
  heartbeat = 5
  procs, err, elapsed = start_and_kill(data, tmp_path / "w", processes, victim, heartbeat)
  host = socket.gethostname()
  for i, p in enumerate(procs):
    if i == victim:
      continue
    print(f"{processes} processes, process {victim} killed: process {i} exited "
          f"{p.returncode} after {elapsed[i]:.1f} s (heartbeat timeout {heartbeat} s)")
    assert p.returncode == exits.EXIT_LOST_PROCESS, err[i][-3000:]
    assert elapsed[i] < heartbeat + 10
    errors = [line for line in err[i].splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err[i][-3000:]
    assert errors[0].startswith(f"error: process {i}: lost process {victim} on {host}"), errors
    for trace in ("Check failure stack trace", "Fatal Python error", "Traceback", "F1", "@ 0x"):
      assert trace not in err[i], err[i][-3000:]
  assert run_state.read(str(tmp_path / "w"))["state"] == "running"  # as a crash leaves it


def test_a_job_that_lost_a_process_resumes(data, tmp_path):
  """After the loss of the coordinator, run_state.json still says ``running`` (so
  launch/slurm.sbatch does not requeue on its own, as after any crash) and the same job,
  rerun (resubmitted, or requeued by Slurm after a node failure), resumes from the last
  checkpoint."""
  workdir = tmp_path / "w"
  procs, err, _ = start_and_kill(data, workdir, 2, 0, 5, **{"checkpoint.every": 2})
  assert procs[1].returncode == exits.EXIT_LOST_PROCESS, err[1][-3000:]
  state = run_state.read(str(workdir))
  assert state["state"] == "running"
  requeue, why = run_state.requeue_decision(state, since_step=-1, job_id="1", restart_count=0)
  assert not requeue and "crashed or was killed" in why
  saved = max(int(name) for name in os.listdir(workdir / "checkpoints") if name.isdigit())
  result = local_sh(2, train_args(data, workdir, **{"train.steps": saved + 2,
                                                    "train.batch_size": 12}))
  assert result.returncode == 0, result.stderr[-3000:]
  assert "resumed from" in result.stderr and run_state.read(str(workdir))["state"] == "finished"
  assert sorted(series(workdir))[-1] == saved + 2


# ----------------------------------------------------------------------------- bad start-up
def test_coordinator_unreachable(data, tmp_path):
  port = free_port()
  p = spawn(1, 2, port, train_args(data, tmp_path / "w",
                                   **{"distributed.initialization_timeout": 3}))
  t0 = time.monotonic()
  out, err = communicate(p, 90)
  assert p.returncode != 0
  assert f"cannot reach the coordinator localhost:{port}" in err, err[-3000:]
  assert "within 3 s (distributed.initialization_timeout)" in err
  assert time.monotonic() - t0 < 60


def test_processes_disagree(data, tmp_path):
  """Process 1 thinks the job has 3 processes; two processes both claim id 0."""
  port = free_port()
  args = train_args(data, tmp_path / "w", **{"distributed.initialization_timeout": 30})
  p0 = spawn(0, 2, port, args)
  p1 = spawn(1, 3, port, args)
  try:
    results = [communicate(p, 90) for p in (p0, p1)]
  finally:
    kill_all([p0, p1])
  for p, (out, err) in zip((p0, p1), results):
    assert p.returncode != 0
    assert "the processes disagree about the job: process 0 on" in err, err[-3000:]
    assert "says 3 processes, id 1" in err

  port = free_port()
  args = train_args(data, tmp_path / "w2", **{"distributed.initialization_timeout": 4})
  twins = [spawn(0, 2, port, args) for _ in range(2)]
  try:
    results = [communicate(p, 90) for p in twins]
  finally:
    kill_all(twins)
  # The runtime may abort the twin it saw first itself ("newer incarnation"); the other one
  # waits for a process 1 that never comes, and our start-up watchdog names the problem.
  assert all(p.returncode != 0 for p in twins)
  ours = [err for out, err in results if "not all 2 processes registered" in err]
  assert ours, results[0][1][-3000:]
  assert all("not all 2 processes registered" in err or "newer incarnation" in err
             or "is already in use" in err for out, err in results)  # (the port: rendezvous)


def test_batch_not_divisible_and_config_mismatch(data, tmp_path):
  result = local_sh(2, train_args(data, tmp_path / "w", **{"train.batch_size": 6}),
                    DEVICES_PER_PROCESS="2")
  assert result.returncode != 0
  msg = "train.batch_size=6 is not divisible by the 4 global devices (2 processes × 2)"
  assert result.stderr.count(msg) >= 2, result.stderr[-3000:]  # both processes say it

  port = free_port()
  procs = [spawn(i, 2, port, train_args(data, tmp_path / "w2", **{"train.steps": 6 + i}))
           for i in range(2)]
  try:
    results = [communicate(p, 90) for p in procs]
  finally:
    kill_all(procs)
  for p, (out, err) in zip(procs, results):
    assert p.returncode != 0
    assert "started with different configs" in err and "train.steps=" in err, err[-3000:]


def test_by_shard_dataset_check(data, tmp_path):
  """data.shard_by_process: main.py checks the node-local copy against the by-shard plan. A
  copy staged for process 0 only (--only-needed --plan by_shard) stops the 2-process job
  before any step, and both processes name process 1's missing shards."""
  from lmscale_jax.input import staging

  local = tmp_path / "local_ds"
  staging.stage(str(data), str(local), only_needed=True, num_processes=2, process_ids=[0],
                plan="by_shard", progress=False, log=lambda m: None)
  result = local_sh(2, train_args(str(local), tmp_path / "w", **{"data.shard_by_process": True}),
                    timeout=120)
  assert result.returncode != 0
  msg = "With data.shard_by_process=True process 1 of 2 reads shards 1::2 of every split"
  assert result.stderr.count(msg) >= 2, result.stderr[-3000:]  # process 1's error, reported by both
  assert "dataset check failed in 1 of 2 processes: process 1 on" in result.stderr
  # Staged for both processes: the by-shard job trains, every process reading its own shards.
  staging.stage(str(data), str(local), only_needed=True, num_processes=2, process_ids=[0, 1],
                plan="by_shard", progress=False, log=lambda m: None)
  workdir = tmp_path / "w2"
  result = local_sh(2, train_args(str(local), workdir, **{"data.shard_by_process": True}),
                    timeout=200)
  assert result.returncode == 0, result.stderr[-5000:]
  losses, evals = series(workdir), series(workdir, "eval_loss")
  assert sorted(losses) == [1, 2, 3, 4, 5, 6] and sorted(evals) == [3, 6]
  assert all(np.isfinite(v) for v in [*losses.values(), *evals.values()])


def test_a_library_error_from_a_lost_peer_is_left_to_the_supervisors_one_line(monkeypatch):
  """An Orbax save in flight when a peer was killed logged its barrier's traceback ("Gloo
  AllGather failed … Connection reset by peer") beside the supervisor's one line (seen once in
  tests/test_finetune.py's lost-process test); the filter drops it in a multi-process job only,
  and keeps any other library error."""
  import logging as std_logging

  from lmscale_jax.cluster import distributed
  from lmscale_jax.train import startup

  def record(message: str) -> std_logging.LogRecord:
    error = ValueError(message)
    return std_logging.LogRecord("absl", std_logging.ERROR, "/x/orbax/checkpoint/_src/a.py",
                                 1, "save failed", (), (ValueError, error, None))

  lost = "UNKNOWN: Gloo AllGather failed: pair.cc:538 Read error: Connection reset by peer"
  quiet = startup._QuietLibraries()
  assert quiet.filter(record(lost))  # one process: nobody else reports it
  monkeypatch.setattr(distributed._job, "coordinator", "127.0.0.1:1234")
  assert not quiet.filter(record(lost))
  assert quiet.filter(record("tensorstore: bad checksum in file d/0"))
