"""tools/demo.sh stopped mid-training: the real script, on a small dataset of its own
(DEMO_DIR/data already there, so the script skips preparation), stopped three ways once its
training has started; each stop checkpoints, names the step, prints no final result, exits
non-zero, and the same command continues the run from that step (~35 s a stop on 2 busy cores).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

from tests.helpers import ROOT, make_synthetic_dataset

STEPS = 1000  # far more than a phase trains before its stop
PHASE_TIMEOUT = 150


def _session_pids(sid: int) -> list[int]:
  """The live processes of session ``sid``: the demo and the training it started in a process
  group of its own (set -m), which a kill of the demo's group alone would miss."""
  pids = []
  for name in os.listdir("/proc"):
    if name.isdigit():
      try:
        fields = open(f"/proc/{name}/stat").read().rsplit(")", 1)[1].split()
      except OSError:
        continue
      if int(fields[3]) == sid and fields[0] != "Z":
        pids.append(int(name))
  return pids


def _kill_session(sid: int) -> None:
  for pid in _session_pids(sid):
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass


def _default_sigint():
  # A suite started in the background of a script inherits SIGINT ignored, and a shell cannot
  # trap a signal ignored on entry: the demo would never see this test's Ctrl-C.
  signal.signal(signal.SIGINT, signal.SIG_DFL)


def _run_demo_until_a_step(demo_dir, log_path) -> subprocess.Popen:
  env = dict(os.environ, DEMO_DIR=str(demo_dir), DEMO_STEPS=str(STEPS), JAX_PLATFORMS="cpu")
  with open(log_path, "w") as log:
    proc = subprocess.Popen(["bash", os.path.join(ROOT, "tools", "demo.sh")], cwd=ROOT, env=env,
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True,  # its own session: like a terminal's job
                            preexec_fn=_default_sigint)
  # Training has started once run_state.json says "running" (written before the first step,
  # after the signal handlers): 8 s sooner than its first logged step, at step 20.
  deadline = time.monotonic() + PHASE_TIMEOUT
  while _state(demo_dir / "run") != "running":
    if proc.poll() is not None or time.monotonic() > deadline:
      _kill_session(proc.pid)
      raise AssertionError(f"training did not start (exit {proc.poll()}):\n"
                           f"{open(log_path).read()[-3000:]}")
    time.sleep(0.3)
  return proc


def _state(workdir) -> str | None:
  try:
    return json.load(open(workdir / "run_state.json"))["state"]
  except (OSError, ValueError):  # not yet written, or being replaced
    return None


def _finish(proc, log_path) -> str:
  try:
    proc.wait(timeout=PHASE_TIMEOUT)
  except subprocess.TimeoutExpired:
    _kill_session(proc.pid)
    raise AssertionError(f"the demo did not stop:\n{open(log_path).read()[-3000:]}")
  # Nothing the demo started outlives it (the training used to, after a SIGTERM to the demo).
  deadline = time.monotonic() + 10
  while _session_pids(proc.pid) and time.monotonic() < deadline:
    time.sleep(0.2)
  left = _session_pids(proc.pid)
  _kill_session(proc.pid)
  assert not left, f"left running: {left}"
  return open(log_path).read()


def _stopped_at(out: str, how: str) -> int:
  m = re.search(rf"demo: training stopped at step (\d+) of {STEPS} \({re.escape(how)}\); its "
                r"checkpoint is kept in .*: run the same command again .* to continue from "
                r"step (\d+)", out)
  assert m and m[1] == m[2], out[-3000:]
  assert "final eval MLM loss" not in out
  return int(m[1])


def _run_state(workdir) -> dict:
  return json.load(open(workdir / "run_state.json"))


def test_a_stopped_demo_names_its_step_exits_143_or_130_prints_no_result_and_continues(
    tmp_path):
  demo = tmp_path / "demo"
  make_synthetic_dataset(str(demo / "data"), seq_len=128, vocab_size=128)
  run = demo / "run"

  # SIGTERM to the demo: passed on to the training, which checkpoints where it is.
  proc = _run_demo_until_a_step(demo, tmp_path / "1.log")
  proc.send_signal(signal.SIGTERM)
  out = _finish(proc, tmp_path / "1.log")
  assert proc.returncode == 143, out[-3000:]
  first = _stopped_at(out, "SIGTERM to the demo")
  assert _run_state(run)["state"] == "preempted" and _run_state(run)["step"] == first
  assert (run / "checkpoints" / str(first)).is_dir()

  # The same command continues from that step; Ctrl-C (SIGINT to the demo's process group,
  # as a terminal sends it) stops it the same way.
  proc = _run_demo_until_a_step(demo, tmp_path / "2.log")
  os.killpg(proc.pid, signal.SIGINT)
  out = _finish(proc, tmp_path / "2.log")
  assert proc.returncode == 130, out[-3000:]
  assert f"continuing the run in {run} from step {first}" in out
  assert f"resumed from {run}/checkpoints/{first}" in out
  second = _stopped_at(out, "Ctrl-C")
  assert second > first and _run_state(run)["step"] == second

  # Preempted: SIGTERM to the training process alone (its pid: the workdir lock's holder).
  proc = _run_demo_until_a_step(demo, tmp_path / "3.log")
  training = json.loads(open(run / ".lock").read())["pid"]
  assert training != proc.pid
  os.kill(training, signal.SIGTERM)
  out = _finish(proc, tmp_path / "3.log")
  assert proc.returncode == 143, out[-3000:]
  assert f"resumed from {run}/checkpoints/{second}" in out
  third = _stopped_at(out, "SIGTERM or SIGUSR1 to the training")
  assert third > second and _run_state(run)["state"] == "preempted"
