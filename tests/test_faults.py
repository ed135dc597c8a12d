"""Faults a cluster run meets: kill -9 at any moment, preemption signals, non-finite losses.

Runs are real ``python -m lmscale_jax.main`` processes on a real dataset, killed with real
signals; each has a timeout and is killed (whole process group) on failure, so nothing here can
hang CI. Corrupt shards are covered in tests/test_faults_data.py, a lost peer in
tests/test_distributed.py (test_killed_process_stops_the_others).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers import make_synthetic_dataset, small_train_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 24
# Test-only: halves XLA:CPU compile time. Every run compared here uses the same flags.
FAST_XLA = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  d = tmp_path_factory.mktemp("fdata") / "ds"
  make_synthetic_dataset(str(d), seq_len=64, vocab_size=128, n_train=256, n_val=32)
  return d


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  """A persistent XLA compilation cache shared by this module's runs: the program is the same,
  so every run after the first skips compilation (the executable, hence the numbers, are the
  same)."""
  return tmp_path_factory.mktemp("xla_cache")


def args(data, workdir, **over) -> list[str]:
  opts = {"model.layers": 1, "model.hidden": 64, "model.heads": 2, "model.ffn": 128,
          "train.batch_size": 8, "train.steps": STEPS, "train.warmup_steps": 2,
          "train.log_every": 1, "train.eval_every": 8, "train.eval_batches": 2,
          "checkpoint.every": 4, "checkpoint.keep": 2, "data.path": data}
  opts.update(over)
  return [f"--config={ROOT}/configs/tiny.py", f"--workdir={workdir}",
          *(f"--config.{k}={v}" for k, v in opts.items())]


def env(cache, **extra) -> dict:
  e = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_XLA, PYTHONUNBUFFERED="1",
           JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
           JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
  e.pop("JAX_NUM_CPU_DEVICES", None)
  e.update(extra)
  return e


def start(cmd_args, cache, **extra) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, "-m", "lmscale_jax.main", *cmd_args], cwd=ROOT,
                          env=env(cache, **extra), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(p: subprocess.Popen, timeout: float = 240) -> str:
  try:
    _, err = p.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(p.pid, signal.SIGKILL)
    _, err = p.communicate()
    raise AssertionError(f"timed out after {timeout} s:\n{err[-4000:]}")
  return err


def kill(p: subprocess.Popen, sig=signal.SIGKILL) -> None:
  if p.poll() is None:
    os.killpg(p.pid, sig)


def run(cmd_args, cache, **extra) -> str:
  p = start(cmd_args, cache, **extra)
  err = finish(p)
  assert p.returncode == 0, err[-5000:]
  return err


def rows(workdir) -> list[dict]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  out = []
  with open(path) as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except ValueError:  # the line being written right now
        pass
  return out


def series(workdir, key="loss") -> dict:
  out = {}
  for r in rows(workdir):
    if key in r:
      assert r["step"] not in out, f"two rows for step {r['step']} in metrics.jsonl"
      out[r["step"]] = r[key]
  return out


def last_step(workdir) -> int:
  return max((r["step"] for r in rows(workdir)), default=0)


def saving(workdir) -> bool:
  """An Orbax save in progress: its temporary directory exists."""
  d = os.path.join(workdir, "checkpoints")
  return os.path.isdir(d) and any("tmp" in name for name in os.listdir(d))


def wait_for(p: subprocess.Popen, cond, timeout: float = 180, poll: float = 0.05) -> None:
  deadline = time.monotonic() + timeout
  while not cond():
    if p.poll() is not None:
      raise AssertionError(f"run ended (rc {p.returncode}) before the fault could be injected:"
                           f"\n{p.communicate()[1][-4000:]}")
    assert time.monotonic() < deadline, "run made no progress"
    time.sleep(poll)


@pytest.fixture(scope="module")
def reference(data, cache, tmp_path_factory):
  """The uninterrupted run every faulted run must reproduce."""
  workdir = tmp_path_factory.mktemp("ref") / "w"
  run(args(data, workdir), cache)
  assert sorted(series(workdir)) == list(range(1, STEPS + 1))
  return workdir


def assert_same_run(workdir, ref) -> None:
  """Bitwise: the same float32 losses, accuracies and eval losses at every step."""
  for key in ("loss", "mlm_accuracy", "eval_loss"):
    assert series(workdir, key) == series(ref, key), key


# ----------------------------------------------------------------------------- kill -9
def test_kill9_at_random_times_resumes_bitwise(data, cache, reference, tmp_path):
  """Five kill -9 of the same run (three between checkpoints at random steps, two while a
  checkpoint is being written), each followed by a rerun of the same command: the final
  trajectory equals the uninterrupted run bit for bit, and no incomplete checkpoint
  survives."""
  seed = int(os.environ.get("LMSCALE_FAULT_SEED", time.time_ns() % 10**6))
  rng = random.Random(seed)
  workdir = tmp_path / "w"
  trials = []
  for trial in range(5):
    p = start(args(data, workdir), cache)
    try:
      during_save = trial in (1, 3)
      if during_save:
        # Poll fast: a save of this model keeps its temporary directory for a few ms only.
        wait_for(p, lambda: saving(workdir), poll=0.0005)
      else:
        target = min(STEPS - 4, last_step(workdir) + rng.randint(1, 4))
        time.sleep(rng.uniform(0.0, 0.3))
        # Between checkpoints: no save in progress (saves of this tiny model take longer
        # than its steps, so an unconditioned kill would nearly always land in one).
        wait_for(p, lambda: last_step(workdir) >= target and not saving(workdir), poll=0.002)
      kill(p)
      caught = saving(workdir)
    finally:
      kill(p)
      p.communicate()
    trials.append({"killed_at_step": last_step(workdir), "during_save": during_save,
                   "tmp_dir_left": caught})
  run(args(data, workdir), cache)
  print(f"kill -9 trials (seed {seed}): {trials}")
  assert_same_run(workdir, reference)
  assert not saving(workdir), os.listdir(workdir / "checkpoints")
  assert any(t["tmp_dir_left"] for t in trials), f"no kill landed inside a save: {trials}"
  with open(workdir / "run_state.json") as f:
    assert json.load(f)["state"] == "finished"


# ----------------------------------------------------------------------------- preemption
def test_sigterm_checkpoints_and_exits_0(data, cache, reference, tmp_path):
  """SIGTERM to the whole process group (as Slurm sends it; the Grain worker gets it too):
  the current step finishes, a checkpoint of it is written, exit 0; the rerun loses no step."""
  workdir = tmp_path / "w"
  p = start(args(data, workdir, **{"data.workers": 1}), cache)
  try:
    wait_for(p, lambda: last_step(workdir) >= 6)
    kill(p, signal.SIGTERM)
    signalled = time.monotonic()
    err = finish(p, timeout=90)
    took = time.monotonic() - signalled
  finally:
    kill(p)
  print(f"SIGTERM -> exit {p.returncode} in {took:.1f} s")
  assert p.returncode == 0, err[-4000:]
  assert took < 60
  with open(workdir / "run_state.json") as f:
    state = json.load(f)
  assert state["state"] == "preempted" and 6 <= state["step"] < STEPS, state
  assert str(state["step"]) in os.listdir(workdir / "checkpoints")
  assert "SIGTERM received" in err and "preempted: stopped after step" in err
  assert last_step(workdir) == state["step"]  # every step up to the checkpoint was logged
  run(args(data, workdir), cache)  # in-process loader now: the loader state is worker-agnostic
  assert_same_run(workdir, reference)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_sigusr1_to_one_process_stops_both_at_one_step(data, cache, reference, tmp_path):
  """Slurm's time-limit signal reaching one process of two: both checkpoint the same step
  (their agreement is JAX's preemption sync) and exit 0; resuming in 2 processes continues the
  trajectory (equal to 1 process within float32 all-reduce rounding, rtol 1e-5)."""
  workdir = tmp_path / "w"

  def spawn(i, port):
    return start(args(data, workdir), cache, LMSCALE_COORDINATOR=f"localhost:{port}",
                 LMSCALE_NUM_PROCESSES="2", LMSCALE_PROCESS_ID=str(i))

  port = free_port()
  procs = [spawn(i, port) for i in range(2)]
  try:
    wait_for(procs[0], lambda: last_step(workdir) >= 6)
    procs[1].send_signal(signal.SIGUSR1)  # this process only
    signalled = time.monotonic()
    errs = [finish(p, timeout=90) for p in procs]
    took = time.monotonic() - signalled
  finally:
    for p in procs:
      kill(p)
  assert [p.returncode for p in procs] == [0, 0], errs[1][-3000:] + errs[0][-3000:]
  print(f"SIGUSR1 to process 1 -> both exited 0 in {took:.1f} s")
  with open(workdir / "run_state.json") as f:
    state = json.load(f)
  assert state["state"] == "preempted", state
  files = os.listdir(workdir / "checkpoints" / str(state["step"]) / "data")
  assert sorted(f for f in files if f.endswith(".json")) == ["process_0-of-2.json",
                                                             "process_1-of-2.json"]
  port = free_port()
  procs = [spawn(i, port) for i in range(2)]
  errs = [finish(p) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], errs[0][-3000:]
  a, b = series(workdir), series(reference)
  assert sorted(a) == sorted(b)
  np.testing.assert_allclose([a[s] for s in sorted(b)], [b[s] for s in sorted(b)], rtol=1e-5)


# ----------------------------------------------------------------------------- non-finite
def test_nonfinite_error_names_step_and_last_good_checkpoint(data, tmp_path):
  from lmscale_jax.pretrain import trainer as train

  workdir = tmp_path / "w"
  config = small_train_config(data, steps=8, inject_nonfinite_steps="5")
  config.checkpoint.every = 2
  with pytest.raises(train.NonFiniteLoss, match=r"at step 5; last good checkpoint: "
                     r".*/checkpoints/4"):
    train.train_and_evaluate(config, str(workdir))
  # nothing past the bad step was checkpointed
  assert max(int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit()) == 4


def test_nonfinite_skip_counts_and_recovers(data, tmp_path):
  """skip: the poisoned steps are counted and not applied, and the run finishes with finite
  losses; too many in a row is an error."""
  from lmscale_jax.pretrain import trainer as train

  workdir = tmp_path / "w"
  out = train.train_and_evaluate(
      small_train_config(data, steps=6, nonfinite="skip", inject_nonfinite_steps="3,4"),
      str(workdir))
  got = rows(workdir)
  skipped = {r["step"]: r["nonfinite_skipped"] for r in got if "nonfinite_skipped" in r}
  assert skipped == {1: 0, 2: 0, 3: 1, 4: 1, 5: 0, 6: 0}
  assert np.isfinite(out["loss"]) and np.isfinite(out["eval_loss"])
  with pytest.raises(train.NonFiniteLoss, match=r"3 consecutive steps .*steps 2-4"):
    train.train_and_evaluate(
        small_train_config(data, steps=6, nonfinite="skip", inject_nonfinite_steps="2,3,4",
                           max_consecutive_nonfinite=3), str(tmp_path / "w2"))


# ----------------------------------------------------------------------------- requeue
# launch/slurm.sbatch's requeue decisions: tests/test_slurm.py (a fake Slurm running real tasks).


@pytest.mark.parametrize("key,value,match", [
    ("nonfinite", "ignore", r"train.nonfinite='ignore': expected one of \['error', 'skip'\]"),
    ("max_consecutive_nonfinite", 0, r"train.max_consecutive_nonfinite=0: expected a positive"),
    ("inject_nonfinite_steps", "3,x", r"train.inject_nonfinite_steps='3,x': expected "
                                      r"comma-separated step numbers"),
    ("inject_nonfinite_steps", "0", r"train.inject_nonfinite_steps='0': step numbers start at 1"),
])
def test_bad_nonfinite_settings_are_named(data, key, value, match):
  from lmscale_jax.config import checks as config_checks
  from lmscale_jax.errors import ConfigError

  with pytest.raises(ConfigError, match=match):
    config_checks.check_config(small_train_config(data, **{key: value}))
