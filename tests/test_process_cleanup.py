"""Processes we start end with the process that started them, however it ends: kill -9 (the OOM
killer) of a training run leaves none of its loader workers nor multiprocessing's resource
tracker behind (they lived on under ppid 1), and the rerun resumes; the mechanism
(``lmscale_jax/child_process.py``) on its own. The preparation pool's own cases are in
tests/test_worker_pool.py, a sweep's runs in tests/test_sweep.py.

Real processes, found by walking /proc; each is killed (whole process group) whatever a test
finds, so nothing is left behind and nothing can hang.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.helpers import ROOT, make_synthetic_dataset
from tests.test_faults import args, assert_same_run, finish, last_step, run, start, wait_for


# ----------------------------------------------------------------------------- /proc
def _stat(pid: str) -> list[str]:
  """/proc/PID/stat's fields from the state on: [0] state, [1] ppid, [2] process group,
  [3] session, [19] start time."""
  with open(f"/proc/{pid}/stat") as f:
    return f.read().rsplit(")", 1)[1].split()


def _command(pid: str) -> str:
  with open(f"/proc/{pid}/cmdline", "rb") as f:
    return f.read().replace(b"\0", b" ").decode(errors="replace")[:160]


def process_tree(root: int) -> dict[int, str]:
  """``root`` and its descendants now, ``{pid: start time}`` (what identifies a process once
  its pid may have been reused)."""
  parents, starts = {}, {}
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      fields = _stat(pid)
    except OSError:
      continue  # ended meanwhile
    parents[int(pid)], starts[int(pid)] = int(fields[1]), fields[19]
  tree, grew = {root}, True
  while grew:
    more = {pid for pid, parent in parents.items() if parent in tree} - tree
    tree |= more
    grew = bool(more)
  return {pid: starts[pid] for pid in tree if pid in starts}


def left_of(tree: dict[int, str]) -> list[str]:
  """What is still alive of a process tree (as :func:`process_tree` saw it), and of the
  sessions and process groups its processes were in, as "pid command line". A zombie has
  ended: only its pid is left, for a parent to reap."""
  groups = set()
  for pid in tree:
    try:
      fields = _stat(str(pid))
    except OSError:
      continue
    groups |= {int(fields[2]), int(fields[3])}
  out = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      fields = _stat(pid)
      command = _command(pid)
    except OSError:
      continue
    ours = tree.get(int(pid)) == fields[19] or {int(fields[2]), int(fields[3])} & groups
    if ours and fields[0] != "Z":
      out.append(f"{pid} {command}")
  return out


def wait_until_gone(tree: dict[int, str], timeout: float) -> tuple[list[str], float]:
  """Waits up to ``timeout`` s for every process of ``tree`` to end; returns those left and
  the seconds it took."""
  start_s = time.monotonic()
  while (left := left_of(tree)) and time.monotonic() - start_s < timeout:
    time.sleep(0.05)
  return left, time.monotonic() - start_s


def kill_all(tree: dict[int, str]) -> None:
  """What a test started goes, whatever it found: every process group of the tree."""
  for line in left_of(tree):
    pid = int(line.split()[0])
    try:
      os.killpg(int(_stat(str(pid))[2]), signal.SIGKILL)
    except (OSError, ValueError):
      pass


# ----------------------------------------------------------------------------- the mechanism
@pytest.mark.parametrize("call", ["die_with_parent(-1)", "watch_parent(-1)",
                                  "_watch(-1, 1.0)"])
def test_a_child_whose_parent_is_already_gone_ends_at_once(call):
  """The parent can end between the child's start and prctl (no signal would ever come), and
  where prctl is missing a thread watches the parent's pid: each ends the child, exit 1."""
  code = f"from lmscale_jax import child_process; child_process.{call}; " \
         "import time; time.sleep(5); print('lived on')"
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                     cwd=ROOT)
  assert (r.returncode, r.stdout, r.stderr) == (1, "", "")


@pytest.mark.parametrize("grace_s", [0.5, 30])
def test_stop_group_ends_a_child_and_what_it_started(grace_s):
  """``child_process.stop_group`` (what ends a server a benchmark or a test started): the
  child and its own child end, by SIGTERM, or by SIGKILL after the grace when SIGTERM is
  ignored."""
  from lmscale_jax import child_process

  trap = "trap '' TERM; " if grace_s < 1 else ""
  p = subprocess.Popen(["bash", "-c", f"{trap}sleep 300 & wait"], start_new_session=True)
  time.sleep(0.3)  # the sleep started
  tree = process_tree(p.pid)
  try:
    assert len(tree) == 2
    rc = child_process.stop_group(p, grace_s=grace_s)
    assert rc == (-signal.SIGKILL if trap else -signal.SIGTERM)
    assert wait_until_gone(tree, 10)[0] == []
  finally:
    kill_all(tree)


@pytest.mark.parametrize("how", ["die_with_parent", "watch_parent"])
def test_a_child_ends_with_its_parents_kill_9(tmp_path, how):
  """Armed either way, a child ends within about a second of its parent's kill -9."""
  child = ("import os, time; from lmscale_jax import child_process; "
           f"child_process.{how}(os.getppid()); print('armed', flush=True); time.sleep(600)")
  out = tmp_path / "out"
  parent = textwrap.dedent(f"""
      import subprocess, sys, time
      subprocess.Popen([sys.executable, "-c", {child!r}], stdout=open({str(out)!r}, "w"))
      time.sleep(600)
  """)
  p = subprocess.Popen([sys.executable, "-c", parent], cwd=ROOT, start_new_session=True)
  tree = {}
  try:
    deadline = time.monotonic() + 60
    while not (out.exists() and "armed" in out.read_text()):
      assert p.poll() is None and time.monotonic() < deadline
      time.sleep(0.05)
    tree = process_tree(p.pid)
    assert len(tree) == 2, tree
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    left, took = wait_until_gone(tree, timeout=10)
    print(f"{how}: the child ended {took:.2f} s after its parent's kill -9")
    assert left == [] and took < 3
  finally:
    kill_all(tree)
    os.killpg(p.pid, signal.SIGKILL) if p.poll() is None else None
    p.wait(timeout=30)


# ----------------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def data(tmp_path_factory):
  d = tmp_path_factory.mktemp("cdata") / "ds"
  make_synthetic_dataset(str(d), seq_len=64, vocab_size=128, n_train=256, n_val=32)
  return d


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  """A shared XLA compilation cache (see tests/test_faults.py: same program, same numbers)."""
  return tmp_path_factory.mktemp("cxla")


def complete_checkpoint(workdir) -> bool:
  """A checkpoint to resume from: its step directory renamed into place (a save of this model
  takes longer than its steps)."""
  d = os.path.join(workdir, "checkpoints")
  return os.path.isdir(d) and any(name.isdigit() for name in os.listdir(d))


def test_kill_9_of_training_ends_its_loader_workers_and_the_resource_tracker_and_resumes(
    data, cache, tmp_path):
  """kill -9 of the training process alone (what the OOM killer does): its two Grain workers
  and the resource tracker end within seconds (they lived on under ppid 1, for good), and a
  rerun resumes from the last checkpoint to the same losses as an uninterrupted run."""
  reference = tmp_path / "reference"
  run(args(data, reference), cache)
  workdir = tmp_path / "w"
  with_workers = args(data, workdir, **{"data.workers": 2})
  p = start(with_workers, cache)
  tree = {}
  try:
    wait_for(p, lambda: last_step(workdir) >= 6 and complete_checkpoint(workdir))
    tree = process_tree(p.pid)
    commands = "\n".join(left_of(tree))
    assert commands.count("--multiprocessing-fork") == 2 and "resource_tracker" in commands, commands
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    left, took = wait_until_gone(tree, timeout=10)
    print(f"kill -9 at step {last_step(workdir)}: every process gone after {took:.2f} s")
    assert left == [], "\n".join(left)
  finally:
    kill_all(tree)
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGKILL)
    p.communicate(timeout=30)
  again = start(with_workers, cache)
  err = finish(again)
  assert again.returncode == 0, err[-4000:]
  assert "resumed from" in err, err[-4000:]
  assert_same_run(workdir, reference)
