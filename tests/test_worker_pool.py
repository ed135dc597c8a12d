"""Preparation's process pool (prep/worker_pool.py) with real spawned processes: results in
input order, every task run exactly once whether a spawned worker or the parent runs it, errors
in their turn, a killed worker one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from lmscale_jax.prep import worker_pool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _slow_task(args):
  """Pool task: sleeps a little (uneven, so the processes interleave); creates its own marker
  file, which fails if the task already ran; returns (index, pid)."""
  directory, i = args
  time.sleep(0.002 + 0.004 * (i % 5))  # 200 tasks: ~2 s in one process
  with open(os.path.join(directory, f"{i:04d}"), "x"):
    pass
  return i, os.getpid()


def _fails_at_seven(i):
  time.sleep(0.002 * (i % 3))
  if i == 7:
    raise ValueError(f"bad task {i}")
  return i


@pytest.mark.parametrize("workers", [2, 3])
def test_results_come_in_input_order_and_the_parent_runs_tasks_instead_of_waiting(
    tmp_path, workers):
  with worker_pool.ordered_map(workers) as pmap:
    got = list(pmap(_slow_task, [(str(tmp_path), i) for i in range(200)]))
  assert [i for i, _ in got] == list(range(200))
  pids = {pid for _, pid in got}
  # The parent took tasks while it would have waited (at least while the workers started:
  # ~0.3 s of imports), and the spawned workers took the rest.
  assert os.getpid() in pids and len(pids) >= 2
  # Every task ran exactly once: each created its marker with "x" (a second run would fail).
  assert sorted(os.listdir(tmp_path)) == [f"{i:04d}" for i in range(200)]


def test_one_pool_serves_several_maps_each_task_once(tmp_path):
  with worker_pool.ordered_map(2) as pmap:
    for m in range(3):
      d = tmp_path / str(m)
      d.mkdir()
      assert [i for i, _ in pmap(_slow_task, [(str(d), i) for i in range(40)])] == \
          list(range(40))
      assert len(os.listdir(d)) == 40


def test_an_error_comes_in_its_turn_whoever_ran_the_task():
  """The results before the failing task come first, then its error: a run reports the first
  bad input in input order, the same for any number of workers."""
  for _ in range(3):
    got = []
    with pytest.raises(ValueError, match="bad task 7"):
      with worker_pool.ordered_map(2) as pmap:
        for r in pmap(_fails_at_seven, range(40)):
          got.append(r)
    assert got == list(range(7))


def test_a_killed_worker_ends_the_map_with_one_error_and_no_traceback(tmp_path):
  """A worker killed (out of memory, kill -9) while the parent has taken queued tasks: the map
  raises PrepareError and nothing else is printed (Future.cancel() for the parent's share made
  Python 3.11's executor thread print an InvalidStateError traceback here)."""
  script = textwrap.dedent("""
      import os, signal, time
      from lmscale_jax.errors import PrepareError
      from lmscale_jax.prep import worker_pool

      def task(args):
        parent, i = args
        time.sleep(0.01)
        if os.getpid() != parent and i >= 20:
          os.kill(os.getpid(), signal.SIGKILL)
        return i

      if __name__ == "__main__":
        try:
          with worker_pool.ordered_map(2) as pmap:
            list(pmap(task, [(os.getpid(), i) for i in range(400)]))
        except PrepareError as e:
          print("error:", e)
  """)
  path = tmp_path / "kill_a_worker.py"  # a file: spawned workers import its task from it
  path.write_text(script)
  for _ in range(3):
    p = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, start_new_session=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("error: a worker process died"), (p.stdout, p.stderr)
    assert p.stderr == "", p.stderr


def test_one_worker_runs_every_task_in_this_process(tmp_path):
  with worker_pool.ordered_map(1) as pmap:
    got = list(pmap(_slow_task, [(str(tmp_path), i) for i in range(10)]))
  assert got == [(i, os.getpid()) for i in range(10)]


def test_a_map_left_early_skips_its_queued_tasks_and_the_pool_goes_on(tmp_path):
  """A consumer that stops (an error in the parent, a break) leaves tasks queued: they are
  skipped, not run, and the pool serves the next map."""
  first, second = tmp_path / "first", tmp_path / "second"
  first.mkdir()
  second.mkdir()
  with worker_pool.ordered_map(2) as pmap:
    for i, _ in pmap(_slow_task, [(str(first), i) for i in range(100)]):
      if i == 3:
        break
    time.sleep(0.5)  # what was queued has had time to run, had it not been skipped
    assert len(os.listdir(first)) < 40  # 4 consumed + the tasks already running, not 100
    assert [i for i, _ in pmap(_slow_task, [(str(second), i) for i in range(30)])] == \
        list(range(30))


def _loaded(args):
  time.sleep(0.01)
  return os.getpid(), args in sys.modules


def test_the_workers_import_the_preload_modules_as_they_start_and_a_missing_one_is_skipped():
  name = "wave"  # a stdlib module the pool's own imports do not load (the control below)
  for preload, expected in [((), {False}), (("no_such_module_here", name), {True})]:
    with worker_pool.ordered_map(2, preload=preload) as pmap:
      got = list(pmap(_loaded, [name] * 300))  # ~3 s alone: the workers get some
    assert {loaded for pid, loaded in got if pid != os.getpid()} == expected


def _environment_of(i):
  time.sleep(0.01)
  return os.getpid(), os.environ.get("OPENBLAS_NUM_THREADS")


@pytest.mark.parametrize("ours", [None, "3"])
def test_spawned_workers_get_one_blas_thread_unless_the_environment_says_otherwise(
    monkeypatch, ours):
  # Their tasks never call BLAS; OpenBLAS's thread per core cost each one's start 0.08 CPU-s.
  if ours is None:
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
  else:
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", ours)
  with worker_pool.ordered_map(2) as pmap:
    got = set(pmap(_environment_of, range(100)))
  spawned = {value for pid, value in got if pid != os.getpid()}
  assert spawned == {ours or "1"}
  assert {value for pid, value in got if pid == os.getpid()} <= {ours}  # this one's unchanged
  assert os.environ.get("OPENBLAS_NUM_THREADS") == ours


def alive_in_group(pgid: int) -> list[str]:
  """The processes of process group ``pgid`` still alive, as "pid command line", read from
  /proc (a zombie is dead: only its pid is left, for a parent to reap)."""
  out = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/stat") as f:
        state, _, group = f.read().rsplit(")", 1)[1].split()[:3]
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        command = f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
    except (OSError, ValueError):
      continue  # ended meanwhile
    if state != "Z" and int(group) == pgid:
      out.append(f"{pid} {command}")
  return out


def wait_until_gone(pgid: int, timeout: float = 10) -> list[str]:
  """Waits up to ``timeout`` s for every process of the group to end; returns those left."""
  deadline = time.time() + timeout
  while (left := alive_in_group(pgid)) and time.time() < deadline:
    time.sleep(0.05)
  return left


def kill_group(pgid: int) -> None:
  """What a test started goes, whatever the test found (never a process left behind)."""
  try:
    os.killpg(pgid, signal.SIGKILL)
  except ProcessLookupError:
    pass


@pytest.mark.parametrize("how,sig", [("parent", signal.SIGKILL), ("parent", signal.SIGTERM),
                                     ("group", signal.SIGTERM)])
def test_the_workers_and_the_resource_tracker_end_with_the_parent_however_it_ends(
    tmp_path, how, sig):
  """kill -9 (the OOM killer), a SIGTERM to the parent alone (Python's default: it ends at
  once), or to its whole group (`timeout`, systemd): the spawned workers and multiprocessing's
  resource tracker end within seconds. They lived on under ppid 1, each blocked on a pipe it
  held itself."""
  script = textwrap.dedent("""
      import time
      from lmscale_jax.prep import worker_pool

      def task(i):
        time.sleep(0.05)
        return i

      if __name__ == "__main__":
        with worker_pool.ordered_map(3) as pmap:
          for _ in pmap(task, range(100_000)):
            pass
  """)
  path = tmp_path / "pool_forever.py"
  path.write_text(script)
  p = subprocess.Popen([sys.executable, str(path)], cwd=ROOT, start_new_session=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    deadline = time.time() + 60
    while len(alive_in_group(p.pid)) < 4:  # the parent, two workers, the resource tracker
      assert p.poll() is None and time.time() < deadline, alive_in_group(p.pid)
      time.sleep(0.05)
    (os.kill if how == "parent" else os.killpg)(p.pid, sig)
    p.wait(timeout=30)
    assert wait_until_gone(p.pid) == []
  finally:
    kill_group(p.pid)
    p.wait(timeout=30)


def test_the_pool_is_capped_at_the_cpus_this_process_may_use_with_one_warning(capfd):
  cpus = len(os.sched_getaffinity(0))
  assert worker_pool.usable_workers(0) == cpus and capfd.readouterr().err == ""
  assert worker_pool.usable_workers(cpus) == cpus and capfd.readouterr().err == ""
  assert worker_pool.usable_workers(1000) == cpus
  err = capfd.readouterr().err
  assert err.count("\n") == 1 and f"--workers 1000: this process may use {cpus} CPUs" in err
