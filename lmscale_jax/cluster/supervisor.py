"""A parent process for each process of a multi-process job: the runtime's abort becomes one line.

When a process of the job is lost (killed, crashed, its node failed), JAX's coordination service
ends every other process itself, from one of its own threads: ``LOG(FATAL)`` ("Terminating
process because the JAX distributed service detected fatal errors"), a C++ stack trace, then
SIGABRT. The runtime's hook for that moment, the distributed client's
``missed_heartbeat_callback``, cannot be used from Python with jaxlib 0.10.2: its binding hands
the (never OK) ``absl::Status`` to a caster that only raises, nanobind throws ``std::bad_cast``
on the runtime's thread and the process terminates just the same (measured; ``jax.distributed.
initialize`` does not pass a callback either). Racing the abort from Python (asking which peer
is gone before the runtime ends us) lost on a loaded machine: the abort comes 0.3 s after the
coordinator dies, on whichever thread polls the service.

So the runtime keeps its own decision, and :func:`start` forks before the runtime starts: the
child runs the job; this parent forwards the child's stderr line by line and signals to it.
When the runtime's fatal report appears, the parent holds it back (``--v=1`` shows it), reads
from it which process was lost (the service names the task whose heartbeats stopped; when the
service itself is gone, the coordinator, confirmed by a refused connection), and once the
child is gone prints one line and exits :data:`exits.EXIT_LOST_PROCESS`:

  error: process 1: lost process 0 on node07 (the coordinator, node07:61440): it stopped …

Any other end of the child is passed on unchanged: its exit code, or 128 + the signal that
ended it (one line naming the signal).
"""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import sys
import time

from absl import logging

from lmscale_jax import child_process, exits
from lmscale_jax.cluster import rendezvous
from lmscale_jax.cluster.topology import Topology

# Set in the child: it is supervised (a second start() is a no-op). "0" in the environment
# turns supervision off (the runtime's abort is then what ends a survivor).
ENV_SUPERVISED = "LMSCALE_SUPERVISED"
# The first line of the runtime's fatal report (xla/pjrt/distributed/client.h).
_FATAL_MARK = b"Terminating process because the JAX distributed service detected fatal errors"
# The runtime's report names the lost task in one of these forms (service-side heartbeat
# check, or a barrier that failed because of it).
_LOST_TASKS = (re.compile(r"stopped sending heartbeats\):\s*((?:\d+[\s,]*)+)"),
               re.compile(r"Task (\d+) heartbeat timeout"))
# A warning or error of the coordination service, its agent or the preemption sync manager
# (absl's format), which the fatal report may follow within _HOLD_S.
_RUNTIME_ERROR = re.compile(rb"[WE]\d{4} [\d:.]+\s+\d+ (coordination_service|preemption_sync)")
_HOLD_S = 2.0
_FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
_DRAIN_S = 0.5  # after the child ended: what it (or a worker) still has in the pipe
_PARTIAL_LINE_S = 0.2  # a line without its newline yet (a progress bar) is passed on after this

_info_fd: int | None = None


def start(topo: Topology) -> None:
  """In a multi-process job, forks: returns in the child (which runs the job); the parent
  supervises it and never returns. A no-op for one process, in the child itself, or with
  ``LMSCALE_SUPERVISED=0``. Call before the runtime or any thread starts."""
  global _info_fd
  if not topo.multi or os.environ.get(ENV_SUPERVISED) in ("0", "1"):
    return
  err_r, err_w = os.pipe()
  info_r, info_w = os.pipe()
  sys.stdout.flush()
  sys.stderr.flush()
  parent = os.getpid()
  child = os.fork()
  if child == 0:
    os.environ[ENV_SUPERVISED] = "1"
    # Killed with its parent (kill -9 of the process a launcher started); a thread watching
    # would outlive nothing here: the parent's main thread supervises until the child ends.
    child_process.die_with_parent(parent, watch=False, orphan_status=exits.EXIT_LOST_PROCESS)
    os.dup2(err_w, 2)  # sys.stderr, absl's C++ logs and Grain's workers all write to fd 2
    for fd in (err_r, err_w, info_r):
      os.close(fd)
    _info_fd = info_w
    return
  os.close(err_w)
  os.close(info_w)
  _supervise(child, err_r, info_r, topo)


def report_hosts(hosts: list[str]) -> None:
  """The child tells its parent the job's hosts (by process id), for the lost-process line."""
  if _info_fd is not None:
    os.write(_info_fd, (json.dumps({"hosts": hosts}) + "\n").encode())


# --------------------------------------------------------------------------- the parent
class _Stderr:
  """The child's stderr, passed on line by line until the runtime's fatal report begins.

  The runtime logs the error it is about to act on (``E… coordination_service…``) just before
  the fatal report: such lines are held for up to :data:`_HOLD_S` and become part of the report
  if it follows, else they are passed on."""

  def __init__(self):
    self.pending = b""
    self.pending_since = 0.0
    self.held: list[bytes] = []
    self.held_since = 0.0
    self.report: bytes | None = None  # the runtime's fatal report, from its first line on

  def feed(self, data: bytes) -> None:
    lines = (self.pending + data).split(b"\n")
    self.pending = lines.pop()
    self.pending_since = time.monotonic()
    for line in lines:
      self._line(line + b"\n")

  def flush(self, force: bool = False) -> None:
    """Passes on a partial line waiting longer than _PARTIAL_LINE_S and held lines older than
    _HOLD_S (any, when forced)."""
    now = time.monotonic()
    if self.pending and (force or now - self.pending_since > _PARTIAL_LINE_S):
      line, self.pending = self.pending, b""
      self._line(line)
    if self.held and (force or now - self.held_since > _HOLD_S):
      os.write(2, b"".join(self.held))
      self.held = []

  def _line(self, line: bytes) -> None:
    if self.report is not None:
      self.report += line
    elif _FATAL_MARK in line:
      self.report = b"".join(self.held) + line
      self.held = []
    elif self.held:
      self.held.append(line)
    elif _RUNTIME_ERROR.match(line):
      self.held, self.held_since = [line], time.monotonic()
    else:
      os.write(2, line)


def _supervise(child: int, err_r: int, info_r: int, topo: Topology) -> None:
  for signum in _FORWARDED:
    signal.signal(signum, lambda signum, frame: _signal_child(child, signum))
  # A terminal's Ctrl-C reaches the child directly (same process group); the parent must not
  # die of it, or the child would be killed with it (die_with_parent).
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  stderr, hosts, status = _Stderr(), [], None
  selector = selectors.DefaultSelector()
  selector.register(err_r, selectors.EVENT_READ)
  selector.register(info_r, selectors.EVENT_READ)
  ended_at = None
  while selector.get_map() and (ended_at is None or time.monotonic() - ended_at < _DRAIN_S):
    for key, _ in selector.select(timeout=0.05):
      data = os.read(key.fd, 1 << 16)
      if not data:
        selector.unregister(key.fd)
      elif key.fd == err_r:
        stderr.feed(data)
      else:
        hosts = _hosts(data, hosts)
    stderr.flush()
    if status is None:
      pid, wait_status = os.waitpid(child, os.WNOHANG)
      if pid:
        status, ended_at = wait_status, time.monotonic()
  stderr.flush(force=True)
  if status is None:  # every pipe closed: the child is ending
    status = os.waitpid(child, 0)[1]
  line, code = _outcome(status, stderr.report, topo, hosts)
  if line:
    os.write(2, (line + "\n").encode())
  os._exit(code)


def flush_output() -> None:
  """absl's log, stdout and stderr, best effort (on the way out)."""
  try:
    logging.flush()
  except Exception:  # flushing is best effort on the way out
    pass
  sys.stdout.flush()
  sys.stderr.flush()


def leave(code: int) -> None:
  """Ends this process now, its output flushed, without the interpreter's shutdown (threads of
  a failed save, JAX's shutdown barrier). Here, without jax: a one-process run's config typo
  leaves through it without importing jax (1.4 s; ``distributed.exit_now`` adds what a job
  of several processes needs)."""
  flush_output()
  os._exit(code)


def _signal_child(child: int, signum: int) -> None:
  try:
    os.kill(child, signum)
  except ProcessLookupError:  # already gone: its end is reported as usual
    pass


def _hosts(data: bytes, hosts: list[str]) -> list[str]:
  for line in data.decode(errors="replace").splitlines():
    try:
      hosts = list(json.loads(line)["hosts"])
    except (ValueError, KeyError, TypeError):  # a torn write: keep what was known
      continue
  return hosts


def _outcome(status: int, report: bytes | None, topo: Topology,
             hosts: list[str]) -> tuple[str | None, int]:
  """(the line to print or None, the exit code) for a child that ended with ``status``."""
  me = f"error: process {topo.process_id}:"
  if report is not None:
    if logging.get_verbosity() >= 1:
      os.write(2, b"the runtime's report (shown with --v=1):\n" + report)
    return (f"{me} {lost_line(report.decode(errors='replace'), topo, hosts)}",
            exits.EXIT_LOST_PROCESS)
  if os.WIFSIGNALED(status):
    signum = os.WTERMSIG(status)
    why = " (out of memory? the kernel's OOM killer sends it: see dmesg)" \
        if signum == signal.SIGKILL else ""
    return f"{me} ended by {signal.Signals(signum).name}{why}", 128 + signum
  return None, os.waitstatus_to_exitcode(status)


def lost_processes(report: str, me: int, coordinator: str | None) -> list[int]:
  """The processes the runtime's fatal ``report`` says were lost (never ``me``); the
  coordinator (0) when the report names none and the coordinator refuses connections."""
  for pattern in _LOST_TASKS:
    found = sorted({int(n) for m in pattern.finditer(report) for n in re.findall(r"\d+",
                                                                               m.group(1))}
                   - {me})
    if found:
      return found
  if me != 0 and coordinator and rendezvous.probe(coordinator, timeout=0.5) is not None:
    return [0]
  return []


def lost_line(report: str, topo: Topology, hosts: list[str]) -> str:
  """The text of the one line a survivor prints (after ``error: process N:``)."""

  def where(p: int) -> str:
    host = f" on {hosts[p]}" if p < len(hosts) else ""
    return f"process {p}{host}" + (f" (the coordinator, {topo.coordinator})" if p == 0 else "")

  lost = lost_processes(report, topo.process_id, topo.coordinator)
  if not lost:
    first = next((line.strip() for line in report.splitlines()
                  if "absl::Status" in line or "Status:" in line), report.strip()[:200])
    return (f"the runtime ended this process (exit {exits.EXIT_LOST_PROCESS}) without naming a "
            f"lost process: {first[:300]}; see the other processes' logs, rerun with --v=1 for its "
            "full report")
  return (f"lost {', '.join(where(p) for p in lost)}: it stopped (crashed, killed, or its node "
          f"failed), so every process stops (exit {exits.EXIT_LOST_PROCESS}). Rerun the job: it "
          "resumes from the last checkpoint")
