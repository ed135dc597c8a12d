"""The one process start-up of every run (``python -m lmscale_jax.main``, ``lmscale train``,
``lmscale finetune``), and the one mapping of every way a run ends to its exit code:

  0    finished, or preempted (SIGTERM/SIGUSR1) with a checkpoint saved
  1    one ``error:`` line: a bad command line, input, data or config, a busy workdir, a full
       disk (in a multi-process job: naming the process and its host)
  75   a process of a multi-process job was lost (``cluster.supervisor``'s one line)
  130  Ctrl-C (the last complete checkpoint is kept: rerun to resume)
  143  SIGTERM before the run could checkpoint (128 + N for another signal)

A traceback only for a bug. :func:`run`: the checks that need no runtime
(:func:`check_before_runtime` for a training run), then the runtime
(``cluster.distributed.initialize``), preemption signals (``cluster.preemption``), the workdir
lock (process 0 takes it, the others learn the outcome: ``distributed.agree``) and
``train.preflight``, then the run's body.
"""

from __future__ import annotations

import logging as std_logging
import os
import signal
import socket
import sys
import threading
import traceback
from typing import Any, Callable

from absl import logging

from lmscale_jax import errors
from lmscale_jax.config import checks as config_checks

EXIT_ERROR, EXIT_LOST_PROCESS, EXIT_INTERRUPTED = 1, 75, 130
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143: a shell's code for a process SIGTERM ended


class Terminated(KeyboardInterrupt):
  """SIGTERM before preemption's handler is installed (during the checks and start-up),
  raised in the main thread as Ctrl-C's KeyboardInterrupt is, so it unwinds the same way."""


def run(config, workdir: str, body: Callable[[Any], int | None], *,
        checks: Callable[[], Any] | None = None, runtime: bool = True,
        exit_at_once: bool = False) -> int:
  """``checks()`` (no runtime, nothing created), the start-up (:func:`start`; skipped when
  not ``runtime``: a dry run), then ``body(checks' result)``; returns the exit code
  (``body``'s, else 0). Every failure is one ``error:`` line and its code (a bug re-raises).
  ``exit_at_once``: leave the process at once after that line, without the interpreter's
  shutdown (see :func:`_leave`); a multi-process job always does."""
  quiet_libraries()
  hold_log()
  here = threading.current_thread() is threading.main_thread()  # where signal handlers run
  before = signal.signal(signal.SIGTERM, _terminated) if here else None
  try:
    checked = checks() if checks else None
    took = start(config, workdir) if runtime else False
    try:
      return body(checked) or 0
    finally:
      if took:  # for callers in-process (tests); a process's exit releases it anyway
        from lmscale_jax.train import workdir as workdir_lib

        workdir_lib.unlock_workdir(workdir)
  except (Exception, KeyboardInterrupt) as e:
    return _failure(e, config, workdir, exit_at_once)
  finally:
    show_log()  # a body that never said it started (a dry run): its lines, now
    if here:
      signal.signal(signal.SIGTERM, before)


def check_before_runtime(config) -> None:
  """Step 1 of :mod:`lmscale_jax.config.checks` (one ``ConfigError`` line naming the key):
  every value on its own, then the Hugging Face directory of ``init_from`` holds a BERT of
  ``config.model``'s shape. Nothing here imports jax (1.4 s): a typo is refused in under a
  second, before the runtime, the workdir lock or staging."""
  config_checks.check_config(config)
  if config.init_from:
    from lmscale_jax.model import hf_convert

    hf_convert.check_matches_model_config(str(config.init_from), config.model)


def start(config, workdir: str) -> bool:
  """The runtime, preemption signals, the workdir lock and preflight; returns whether this
  process took the lock (process 0)."""
  from lmscale_jax.cluster import distributed, preemption
  from lmscale_jax.train import preflight
  from lmscale_jax.train import workdir as workdir_lib

  import jax  # here, not at module level: Grain's worker processes re-import __main__

  distributed.initialize(config)  # before anything touches a JAX backend
  preemption.install()  # after: the runtime installs its own SIGTERM handler
  # Before anything in the workdir is touched (preflight's token file, Orbax's clean-up of
  # tmp directories): process 0 holds the lock for the job, the others learn its outcome.
  took = distributed.agree("workdir lock", lambda: workdir_lib.lock_workdir(workdir)
                           if jax.process_index() == 0 else None)
  preflight.preflight(config, workdir)
  return bool(took)


def _terminated(signum, frame):
  signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one unwinding: a second would interrupt it
  raise Terminated


def _failure(e: BaseException, config, workdir: str, exit_at_once: bool) -> int:
  resume = (f"the last complete checkpoint in {workdir}/checkpoints is kept: rerun the same "
            "command to resume from it")
  if isinstance(e, Terminated):
    return _leave(f"error: terminated (SIGTERM); {resume}", EXIT_TERMINATED, exit_at_once)
  if isinstance(e, KeyboardInterrupt):
    # A train.Interrupted has cleaned up (loader stopped, a save in flight finished, metrics
    # closed); any other (a second Ctrl-C during that clean-up, or one during start-up) has
    # nothing worth waiting for. Leaving without the interpreter's shutdown: joining Grain's
    # stopped worker processes there hung for 240 s in one CI run (data.workers=1).
    return _leave(f"error: interrupted (Ctrl-C); {resume}", EXIT_INTERRUPTED, exit_at_once)
  if multi_process():
    _multi_process_failure(e, config, workdir)
  line = one_line(e, workdir)
  if line is None:
    show_log()  # what led up to it
    raise e  # a bug: keep its traceback
  logging.vlog(1, "traceback", exc_info=e)
  # A save that failed (a full disk mid-save) leaves its writer threads' coroutines, which
  # printed 50-110 "Event loop is closed" tracebacks under the interpreter's shutdown.
  return _leave(line, EXIT_ERROR, exit_at_once)


def multi_process() -> bool:
  jax = sys.modules.get("jax")  # not imported yet: no runtime either
  return jax is not None and jax.distributed.is_initialized()


def one_line(e: BaseException, workdir: str) -> str | None:
  """The ``error:`` line for a user error or a full disk; None for a bug."""
  if isinstance(e, errors.UserError):
    return f"error: {e}"
  full = errors.disk_full(e)
  if full is not None:
    where = f" writing {full.filename}" if full.filename else ""
    return (f"error: {full.reason}{where} (workdir {workdir}): free space or give a "
            f"--workdir with room; {_last_checkpoint(workdir)}")
  return None


def _last_checkpoint(workdir: str) -> str:
  """What a rerun resumes from, for the disk-full line."""
  from lmscale_jax.train import checkpoint

  try:
    step = checkpoint.latest_complete_step(workdir)
  except OSError:
    step = None
  if step is None:
    return "no checkpoint was complete yet: a rerun starts afresh"
  return (f"the last complete checkpoint, {checkpoint.step_dir(workdir, step)}, is kept: a "
          "rerun resumes from it")


def _process_prefix() -> str:
  import jax

  return f"error: process {jax.process_index()}: on {socket.gethostname()}:"


def _leave(line: str, code: int, exit_at_once: bool) -> int:
  """Prints ``line``; with ``exit_at_once`` (or in a multi-process job) exits at once, without
  the interpreter's shutdown: an async checkpoint save still in flight (a second Ctrl-C) or
  one that failed leaves threads that print tracebacks when the interpreter goes down under
  them. Orbax never takes a save's tmp directory for a checkpoint, and the next run removes
  it. Peers of a multi-process job may be blocked in a collective (``distributed.exit_now``)."""
  drop_log()
  multi = multi_process()
  if multi:
    line = line.replace("error:", _process_prefix(), 1)
  print(line, file=sys.stderr, flush=True)
  if multi:
    from lmscale_jax.cluster import distributed

    distributed.exit_now(code)
  if exit_at_once:  # one process: no runtime to shut down, no peers to wait for
    from lmscale_jax.cluster import supervisor  # not distributed: it imports jax (1.4 s)

    supervisor.leave(code)
  return code


def _multi_process_failure(e: BaseException, config, workdir: str) -> None:
  """A failure in a multi-process job: report and leave now (see distributed.exit_now); the
  other processes stop within distributed.heartbeat_timeout. A collective that failed because
  a peer is gone is the runtime's to report (cluster.supervisor: one line, exit 75)."""
  import jax

  from lmscale_jax.cluster import distributed

  distributed.await_runtime(e, config.distributed.heartbeat_timeout)
  line = one_line(e, workdir)
  (drop_log if line else show_log)()
  if line is None:
    logging.exception("process %d failed", jax.process_index())
    line = f"error: {type(e).__name__}: {e}"
  print(line.replace("error:", _process_prefix(), 1), file=sys.stderr, flush=True)
  distributed.exit_now(EXIT_ERROR)


# ----------------------------------------------------------------------------- held lines
class _Held(std_logging.Filter):
  """The log lines below ERROR of a run not started yet, kept back (:func:`hold_log`)."""

  def __init__(self):
    super().__init__()
    self.records: list[std_logging.LogRecord] = []

  def filter(self, record):
    if record.levelno >= std_logging.ERROR:
      return True
    self.records.append(record)
    return False


_held: _Held | None = None


def hold_log() -> None:
  """Keeps absl's log lines back until the run is accepted (:func:`show_log`): a run refused
  after the runtime started (a missing dataset, a batch that does not split, a changed config)
  printed the topology, the workdir and the model's size at INFO before its one ``error:``
  line; now it prints that line alone (:func:`drop_log`; with ``--v=1`` the lines too)."""
  global _held
  if _held is None:
    _held = _Held()
    logging.get_absl_handler().addFilter(_held)


def show_log() -> None:
  """The run is accepted, or begins work the user waits on (staging, ``--verify_data``): the
  lines held so far, with their own times, then every later one as it comes."""
  global _held
  held, _held = _held, None
  if held is not None:
    handler = logging.get_absl_handler()
    handler.removeFilter(held)
    for record in held.records:
      handler.handle(record)


def drop_log() -> None:
  """The run is refused: its one line is the report (``--v=1`` keeps the lines held)."""
  global _held
  if logging.vlog_is_on(1):
    return show_log()
  held, _held = _held, None
  if held is not None:
    logging.get_absl_handler().removeFilter(held)


# ----------------------------------------------------------------------------- the process
class _QuietLibraries(std_logging.Filter):
  """Orbax and Grain log every save/restore phase at INFO: keep their warnings and errors,
  except two kinds the run reports in one line of its own (``--v=1`` still shows them): a
  full disk (a failed save logs one error with a traceback per writer thread, 5-8 on a full
  tmpfs, 500-950 lines; :func:`one_line`), and a lost peer of a multi-process job (a save in
  flight when a process was killed logged its barrier's "Gloo AllGather failed … Connection
  reset by peer" traceback, seen in tests/test_finetune.py; the supervisor names the lost
  process)."""

  def filter(self, record):
    if not any(f"/{lib}/" in record.pathname for lib in ("orbax", "grain")):
      return True
    if record.levelno < std_logging.WARNING:
      return False
    from lmscale_jax.cluster import distributed

    cause = record.exc_info[1] if record.exc_info else RuntimeError(record.getMessage())
    reported = errors.disk_full(cause) is not None or distributed.peer_failure(cause)
    return not reported or logging.vlog_is_on(1)


def quiet_libraries() -> None:
  """Installs :class:`_QuietLibraries` on absl's handler and logger, and
  :func:`_without_closed_loop_callbacks` as ``sys.unraisablehook`` (once per process)."""
  # On absl's logger too: without absl's app.run (lmscale finetune) its records reach
  # Python's own handlers, which absl's handler filter never sees.
  for where in (logging.get_absl_handler(), std_logging.getLogger("absl")):
    if not any(isinstance(f, _QuietLibraries) for f in where.filters):
      where.addFilter(_QuietLibraries())
  if not getattr(sys.unraisablehook, "lmscale_quiet", False):
    sys.unraisablehook = _without_closed_loop_callbacks(sys.unraisablehook)


def _without_closed_loop_callbacks(hook):
  """``sys.unraisablehook``, without tensorstore's reports of a callback into a closed event
  loop: when a checkpoint save fails (a full disk), Orbax closes its asyncio loop while
  tensorstore's other writes of that save are still running, and each completion was reported
  as an unraisable "RuntimeError: Event loop is closed" (50-110 tracebacks of asyncio frames).
  The failure itself is raised and reported by the run; every other unraisable exception
  still reaches ``hook``."""

  def unraisablehook(report):
    frames = traceback.extract_tb(report.exc_traceback)
    if (report.exc_type is RuntimeError and str(report.exc_value) == "Event loop is closed"
        and frames and all(f"{os.sep}asyncio{os.sep}" in f.filename for f in frames)):
      return
    hook(report)

  unraisablehook.lmscale_quiet = True
  return unraisablehook
