"""How every command ends (docs/design.md "Exit codes"): the exit codes, SIGTERM raised as
:class:`Terminated` while a command runs (:func:`sigterm_raises`), and the one ``error:`` line
(:func:`error_line`). One owner for the tools (``cli/args.guarded``) and the runs
(``train/startup.run``), which differ only in what they add to a line: a run names its
checkpoint, process and host. A base like ``errors``: nothing here imports numpy or jax, so
``lmscale``'s own front (cli/lmscale.py) uses the codes too.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

from lmscale_jax import progress

EXIT_ERROR = 1  # one error: line: a bad command line, input, data or config alike
EXIT_USAGE = EXIT_ERROR  # argparse's usage errors are user errors too: the same code
# A process of a multi-process job was lost and the runtime ended this one (cluster/supervisor;
# sysexits' EX_TEMPFAIL: rerun the same command, it resumes from the last complete checkpoint).
# Distinct from 1 (a user error) and from a traceback's exit code (a bug).
EXIT_LOST_PROCESS = 75
EXIT_INTERRUPTED = 130  # Ctrl-C
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143: what a shell reports for a process SIGTERM ended


class Terminated(KeyboardInterrupt):
  """SIGTERM (``timeout``, systemd, a batch system), raised in the main thread as Ctrl-C's
  KeyboardInterrupt is, so it unwinds the same way (process pools stopped, locks released);
  Python's default ended the process at once: exit 143, no line, the workers left running.
  A run's preemption handler (``cluster/preemption``) replaces this once the run can save."""


def _terminated(signum, frame):
  signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one unwinding: a second would interrupt it
  raise Terminated


@contextlib.contextmanager
def sigterm_raises():
  """SIGTERM raises :class:`Terminated` inside the block (main thread only: where signal
  handlers run; elsewhere nothing changes), and the handler before it is back after."""
  here = threading.current_thread() is threading.main_thread()
  before = signal.signal(signal.SIGTERM, _terminated) if here else None
  try:
    yield
  finally:
    if here:
      signal.signal(signal.SIGTERM, before)


def stopped(e: KeyboardInterrupt) -> tuple[str, int]:
  """What stopped a command and its exit code: SIGTERM (143) or Ctrl-C (130)."""
  if isinstance(e, Terminated):
    return "terminated (SIGTERM)", EXIT_TERMINATED
  return "interrupted", EXIT_INTERRUPTED


def error_line(message: str, code: int, who: str = "") -> int:
  """Prints ``error: [who: ]message`` on a line of its own (a progress bar still drawn is
  closed first: its line has no newline) and returns ``code``. ``who``: the process and host
  of a multi-process job."""
  progress.end_bars()
  print(f"error: {who}: {message}" if who else f"error: {message}", file=sys.stderr,
        flush=True)
  return code
