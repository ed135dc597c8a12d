"""The one process start-up of every run (``python -m lmscale_jax.main``, ``lmscale train``,
``lmscale finetune``), and the one mapping of every way a run ends to its exit code (the
codes, ``Terminated`` and the ``error:`` line are ``lmscale_jax.exits``', shared with the tools):

  0    finished, or preempted (SIGTERM/SIGUSR1) with a checkpoint saved
  1    one ``error:`` line: a bad command line, input, data or config, a busy workdir, a full
       disk (in a multi-process job: naming the process and its host)
  75   a process of a multi-process job was lost (``cluster.supervisor``'s one line)
  130  Ctrl-C (the last complete checkpoint is kept: rerun to resume)
  143  SIGTERM before the run could checkpoint (128 + N for another signal)

A traceback only for a bug. :func:`run`: the checks that need no runtime
(:func:`check_before_runtime` for a training run), then the runtime
(``cluster.distributed.initialize``), preemption signals (``cluster.preemption``), the workdir
lock (``workdir.holding_for_job``: process 0 takes it, the others learn the outcome) and
``train.preflight``, then the run's body.
"""

from __future__ import annotations

import contextlib
import logging as std_logging
import os
import socket
import sys
import traceback
from typing import Any, Callable

from absl import logging

from lmscale_jax import errors, exits
from lmscale_jax.config import checks as config_checks

def run(config, workdir: str, body: Callable[[Any], int | None], *,
        checks: Callable[[], Any] | None = None, runtime: bool = True,
        exit_at_once: bool = False) -> int:
  """``checks()`` (no runtime, nothing created), the start-up (:func:`started`; skipped when
  not ``runtime``: a dry run), then ``body(checks' result)``; returns the exit code
  (``body``'s, else 0). Every failure is one ``error:`` line and its code (a bug re-raises).
  ``exit_at_once``: leave the process at once after that line, without the interpreter's
  shutdown (see :func:`_leave`); a multi-process job always does."""
  quiet_libraries()
  hold_log()
  # SIGTERM before preemption's handler is installed (the checks, start-up) is Terminated.
  with exits.sigterm_raises():
    try:
      checked = checks() if checks else None
      with started(config, workdir) if runtime else contextlib.nullcontext():
        return body(checked) or 0
    except (Exception, KeyboardInterrupt) as e:
      return _failure(e, config, workdir, exit_at_once)
    finally:
      show_log()  # a body that never said it started (a dry run): its lines, now


def check_before_runtime(config) -> None:
  """Step 1 of :mod:`lmscale_jax.config.checks` (one ``ConfigError`` line naming the key):
  every value on its own, then the Hugging Face directory of ``init_from`` holds a BERT of
  ``config.model``'s shape. Nothing here imports jax (1.4 s): a typo is refused in under a
  second, before the runtime, the workdir lock or staging."""
  config_checks.check_config(config)
  if config.init_from:
    from lmscale_jax.model import hf_convert

    hf_convert.check_matches_model_config(str(config.init_from), config.model)


@contextlib.contextmanager
def started(config, workdir: str):
  """The runtime, preemption signals, the workdir lock (held for the block) and preflight."""
  from lmscale_jax.cluster import distributed, preemption
  from lmscale_jax.train import preflight
  from lmscale_jax.train import workdir as workdir_lib

  distributed.initialize(config)  # before anything touches a JAX backend
  preemption.install()  # after: the runtime installs its own SIGTERM handler
  # Before anything in the workdir is touched (preflight's token file, Orbax's clean-up of
  # tmp directories): process 0 holds the lock for the job, the others learn its outcome.
  with workdir_lib.holding_for_job(workdir):
    preflight.preflight(config, workdir)
    yield


def _failure(e: BaseException, config, workdir: str, exit_at_once: bool) -> int:
  resume = (f"the last complete checkpoint in {workdir}/checkpoints is kept: rerun the same "
            "command to resume from it")
  if isinstance(e, KeyboardInterrupt):
    # A train.Interrupted has cleaned up (loader stopped, a save in flight finished, metrics
    # closed); any other (a second Ctrl-C during that clean-up, or one during start-up) has
    # nothing worth waiting for. Leaving without the interpreter's shutdown: joining Grain's
    # stopped worker processes there hung for 240 s in one CI run (data.workers=1).
    what, code = exits.stopped(e)
    ctrl_c = "" if isinstance(e, exits.Terminated) else " (Ctrl-C)"
    return _leave(f"{what}{ctrl_c}; {resume}", code, exit_at_once)
  if multi_process():
    _multi_process_failure(e, config, workdir)
  line = one_line(e, workdir)
  if line is None:
    show_log()  # what led up to it
    raise e  # a bug: keep its traceback
  logging.vlog(1, "traceback", exc_info=e)
  # A save that failed (a full disk mid-save) leaves its writer threads' coroutines, which
  # printed 50-110 "Event loop is closed" tracebacks under the interpreter's shutdown.
  return _leave(line, exits.EXIT_ERROR, exit_at_once)


def multi_process() -> bool:
  jax = sys.modules.get("jax")  # not imported yet: no runtime either
  return jax is not None and jax.distributed.is_initialized()


def one_line(e: BaseException, workdir: str) -> str | None:
  """The ``error:`` line's message for a user error or a full disk; None for a bug."""
  if isinstance(e, errors.UserError):
    return str(e)
  full = errors.disk_full(e)
  if full is not None:
    where = f" writing {full.filename}" if full.filename else ""
    return (f"{full.reason}{where} (workdir {workdir}): free space or give a "
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


def _process() -> str:
  """Who failed, in a multi-process job's ``error:`` line."""
  import jax

  return f"process {jax.process_index()}: on {socket.gethostname()}"


def _leave(message: str, code: int, exit_at_once: bool) -> int:
  """The ``error:`` line of ``message`` (``exits.error_line``); with ``exit_at_once`` (or in a
  multi-process job) exits at once, without the interpreter's shutdown: an async checkpoint save still in flight (a second Ctrl-C) or
  one that failed leaves threads that print tracebacks when the interpreter goes down under
  them. Orbax never takes a save's tmp directory for a checkpoint, and the next run removes
  it. Peers of a multi-process job may be blocked in a collective (``distributed.exit_now``)."""
  drop_log()
  multi = multi_process()
  exits.error_line(message, code, _process() if multi else "")
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
    line = f"{type(e).__name__}: {e}"
  exits.error_line(line, exits.EXIT_ERROR, _process())
  distributed.exit_now(exits.EXIT_ERROR)


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
