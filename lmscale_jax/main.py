"""lmscale_jax entry point: parse flags, start the runtime, call
``train.trainer.train_and_evaluate``.

  python -m lmscale_jax.main --config=configs/bert350m.py --workdir=DIR
      --config.data.path=DATASET [--config.train.batch_size=256 …] [--dry_run]
      [--verify_data] [--allow_config_change]

Several processes (launch/local.sh, launch/node.sh, launch/slurm.sbatch) find each other
through ``lmscale_jax.cluster.distributed`` (config ``distributed.*``, ``LMSCALE_*`` or Slurm
variables); ``--config.data.stage_from=SHARED`` first copies the dataset to ``data.path`` on
every node (``lmscale_jax.input.staging``).

Exits: 0 finished or preempted (checkpoint saved); 1 with one ``error:`` line for a user error
(bad flag or value, bad data, incompatible or busy workdir, disk full); 75 with one ``error:``
line naming the process and host that was lost from a multi-process job (killed, crashed, node
failed: rerun to resume; lmscale_jax/cluster/supervisor.py); 130 on Ctrl-C (the last complete
checkpoint is kept: rerun to resume); a traceback only for a bug.
"""

import logging as std_logging
import os
import re
import sys
import traceback

from absl import app, flags, logging
from ml_collections import config_flags

from lmscale_jax import errors

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py).", lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and config.json.")
flags.DEFINE_bool("dry_run", False, "Print the resolved config, parameter count, FLOPs per "
                  "step and a memory estimate, then exit.")
flags.DEFINE_bool("verify_data", False, "Before training, check the sha256 of every shard "
                  "this process reads against the dataset's metadata.json (logs MB/s).")
flags.DEFINE_bool("allow_config_change", False, "Resume a checkpoint under a config whose "
                  "data stream or optimisation keys (train.batch_size, data.seed, "
                  "train.learning_rate, …) differ from the workdir's config.json; the change "
                  "is logged and recorded there with the step it took effect.")
# Required flags are checked in parse_flags (one line), not by absl's validators (a traceback).
_REQUIRED = ("config", "workdir")
_USAGE = ("usage: python -m lmscale_jax.main --config=configs/<name>.py --workdir=DIR "
          "[--config.data.path=DATASET] [--config.<section>.<key>=VALUE …] (--help for more)")
_INTERRUPTED = 130  # the shell's code for a process ended by SIGINT


class _QuietLibraries(std_logging.Filter):
  """Orbax and Grain log every save/restore phase at INFO: keep their warnings and errors,
  except the errors of a full disk. A save that fails for lack of space logs one error with a
  traceback per writer thread (5-8 on a full tmpfs, 500-950 lines); the run reports it in its
  one disk-full line (:func:`_one_line`), and ``--v=1`` still shows them."""

  def filter(self, record):
    if not any(f"/{lib}/" in record.pathname for lib in ("orbax", "grain")):
      return True
    if record.levelno < std_logging.WARNING:
      return False
    cause = record.exc_info[1] if record.exc_info else RuntimeError(record.getMessage())
    return errors.disk_full(cause) is None or logging.vlog_is_on(1)


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

  return unraisablehook


def main(argv):
  if len(argv) > 1:
    sys.exit(f"error: unexpected arguments {argv[1:]} (flags are --name=value). {_USAGE}")
  logging.get_absl_handler().addFilter(_QuietLibraries())
  sys.unraisablehook = _without_closed_loop_callbacks(sys.unraisablehook)
  try:
    _run(FLAGS.config, FLAGS.workdir)
  except KeyboardInterrupt:
    # train.Interrupted: training has cleaned up (loader stopped, a save in flight finished,
    # metrics closed); any other KeyboardInterrupt (a second Ctrl-C during that clean-up, or
    # one during start-up) has nothing worth waiting for. Either way the process leaves at
    # once, without the interpreter's shutdown: joining Grain's stopped worker processes there
    # hung for 240 s in one CI run (data.workers=1).
    _leave("error: interrupted (Ctrl-C); the last complete checkpoint in "
           f"{FLAGS.workdir}/checkpoints is kept: rerun the same command to resume from it",
           _INTERRUPTED)
  except Exception as e:
    if _multi_process():
      _multi_process_failure(e, FLAGS.config)
    line = _one_line(e)
    if line is None:
      raise  # a bug: keep its traceback
    logging.vlog(1, "traceback", exc_info=True)
    # Training has finished or abandoned any save in flight and stopped its loader workers
    # (train.trainer); a save that failed (a full disk mid-save) leaves its writer threads'
    # coroutines, which printed 50-110 "Event loop is closed" tracebacks under the
    # interpreter's shutdown: _leave exits without it.
    _leave(line, 1)


def _multi_process() -> bool:
  jax = sys.modules.get("jax")  # not imported yet: no runtime either
  return jax is not None and jax.distributed.is_initialized()


def _run(config, workdir: str) -> None:
  from lmscale_jax.cluster import distributed, preemption
  from lmscale_jax.input import dataset_checks, staging
  from lmscale_jax.train import preflight, trainer
  from lmscale_jax.train import workdir as workdir_lib

  # Imported here, not at module level: Grain's worker processes re-import __main__.
  import jax

  if FLAGS.dry_run:  # this process only: no runtime to start, nothing to stage or lock
    setup = trainer.build_setup(config)
    print(config)
    print(trainer.describe(setup))
    return

  # The checks before any data is read, in order: lmscale_jax/config/checks.py.
  preflight.check_before_runtime(config)
  distributed.initialize(config)  # before anything touches a JAX backend
  preemption.install()  # after: the runtime installs its own SIGTERM handler
  # Before anything in the workdir is touched (preflight's token file, Orbax's clean-up of
  # tmp directories): process 0 holds the lock for the job, the others learn its outcome.
  distributed.agree("workdir lock", lambda: workdir_lib.lock_workdir(workdir)
                    if jax.process_index() == 0 else None)
  preflight.preflight(config, workdir)
  if config.data.stage_from:
    staging.stage_per_node(config.data.stage_from, config.data.path,
                           workers=int(config.data.stage_workers),
                           timeout_s=float(config.data.stage_timeout), log=logging.info)
  # The shards this process reads (data.process_shards, the loader's read plan).
  reads = dict(num_processes=jax.process_count(), process_id=jax.process_index(),
               plan="by_shard" if config.data.shard_by_process else "interleaved")
  meta = distributed.agree("dataset check",
                           lambda: dataset_checks.check_dataset_dir(config.data.path, **reads))
  if FLAGS.verify_data:
    distributed.agree("data verification", lambda: dataset_checks.verify_shards(
        meta, log=logging.info, **reads))
  logging.info("workdir %s", workdir)
  trainer.train_and_evaluate(config, workdir, meta=meta,
                           allow_config_change=FLAGS.allow_config_change)


def _one_line(e: Exception) -> str | None:
  """The ``error:`` line for a user error or a full disk; None for a bug."""
  if isinstance(e, errors.UserError):
    return f"error: {e}"
  full = errors.disk_full(e)
  if full is not None:
    where = f" writing {full.filename}" if full.filename else ""
    return (f"error: {full.reason}{where} (workdir {FLAGS.workdir}): free space or give a "
            f"--workdir with room; {_last_checkpoint(FLAGS.workdir)}")
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


def _leave(line: str, code: int) -> None:
  """Prints ``line`` and exits at once, without the interpreter's shutdown: an async checkpoint
  save still in flight (a second Ctrl-C) or one that failed leaves threads that print
  tracebacks when the interpreter goes down under them. Orbax never takes a save's tmp
  directory for a checkpoint, and the next run removes it. Peers of a multi-process job may be
  blocked in a collective (see ``distributed.exit_now``)."""
  from lmscale_jax.cluster import distributed

  if _multi_process():
    import jax

    line = line.replace("error:", f"error: process {jax.process_index()}:", 1)
  print(line, file=sys.stderr, flush=True)
  distributed.exit_now(code)


def _multi_process_failure(e: Exception, config) -> None:
  """A failure in a multi-process job: report and leave now (see distributed.exit_now); the
  other processes stop within distributed.heartbeat_timeout. A collective that failed because
  a peer is gone is the runtime's to report (lmscale_jax.cluster.supervisor: one line, exit 75)."""
  import jax

  from lmscale_jax.cluster import distributed

  distributed.await_runtime(e, config.distributed.heartbeat_timeout)
  me = f"error: process {jax.process_index()}:"
  if _one_line(e) is None:
    logging.exception("process %d failed", jax.process_index())
  full = errors.disk_full(e)
  text = _one_line(e).removeprefix("error: ") if full else f"{type(e).__name__}: {e}"
  print(f"{me} {text}", file=sys.stderr, flush=True)
  distributed.exit_now(1)


def parse_flags(argv):
  """absl parsing, but every mistake on the command line is one ``error:`` line (exit 1), not
  a traceback, and ``--help`` prints the usage and exits 0."""
  from lmscale_jax.config import checks as config_checks

  if any(a in ("--help", "-h", "--helpshort", "-?") for a in argv[1:]):
    print(f"{(__doc__ or '').strip()}\n\n{FLAGS.module_help(sys.modules[__name__])}")
    sys.exit(0)
  for old, new in config_checks.RENAMED.items():
    if any(a.split("=")[0] == f"--config.{old}" for a in argv[1:]):
      sys.exit(f"error: --config.{old} was renamed --config.{new}")
  try:
    rest = FLAGS(argv, known_only=False)
  except flags.UnrecognizedFlagError as e:
    hint = re.search(r"Did you mean: (\S+) \?", str(e))
    sys.exit(f"error: unknown flag --{e.flagname}"
             + (f" (did you mean --{hint.group(1).split(',')[0]}?)" if hint else "")
             + f". {_USAGE}")
  except flags.IllegalFlagValueError as e:
    sys.exit(_bad_value_line(str(e)))
  except (AttributeError, KeyError) as e:
    sys.exit(_unknown_key_line(e, argv))
  except Exception as e:  # ml_collections: a config file that fails, a key it cannot parse
    sys.exit(_config_file_line(e, argv) or f"error: {_first_line(e)}. {_USAGE}")
  missing = [f"--{name}" for name in _REQUIRED if FLAGS[name].value is None]
  if missing:
    sys.exit(f"error: {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
             f"required. {_USAGE}")
  try:
    FLAGS.config.keys()  # ml_collections reports a config file it could not load only here
  except OSError as e:
    sys.exit(_config_file_line(e, argv))
  return rest


def _config_file_line(e: BaseException, argv) -> str | None:
  """One line for a ``--config`` file that could not be loaded (missing, or its code
  failed), or None if ``e`` is not about it. ml_collections keeps a missing file's error in a
  stand-in config (``_error``), and lets an error in the file's code through or wraps it."""
  name = next((a.split("=", 1)[1] for a in argv[1:] if a.startswith("--config=")), None)
  if name is None:
    return None
  stand_in = FLAGS["config"].value
  stored = vars(stand_in).get("_error") if hasattr(stand_in, "__dict__") else None
  path = os.path.abspath(name.split(":", 1)[0])
  in_file = any(os.path.abspath(frame.filename) == path
                for frame in traceback.extract_tb(e.__traceback__)) or (
                    isinstance(e, SyntaxError) and os.path.abspath(e.filename or "") == path)
  if stored is None and not in_file and path not in str(e) and "config file" not in str(e):
    return None
  why = _last_line(stored) if stored is not None else f"{type(e).__name__}: {_last_line(e)}"
  return (f"error: --config={name}: cannot load the config file ({why}); configs/ holds "
          "tiny.py, bert120m.py, bert350m.py")


def _first_line(e: BaseException) -> str:
  return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _last_line(e: BaseException) -> str:
  lines = [line.strip() for line in str(e).splitlines() if line.strip()]
  return lines[-1] if lines else type(e).__name__


def _bad_value_line(text: str) -> str:
  """absl's ``flag --config.train.steps=abc: invalid literal for int() …`` as one line."""
  m = re.match(r"flag --([\w.\-]+)=(.*?): (.*)", text.strip().splitlines()[0])
  if not m:
    return f"error: {_first_line(ValueError(text))}. {_USAGE}"
  name, value, why = m.groups()
  if "int()" in why:
    why = "expected an integer (no decimal point or exponent)"
  elif "float" in why:
    why = "expected a number"
  elif "bool" in why.lower():
    why = "expected true or false"
  return f"error: --{name}={value}: {why}"


def _unknown_key_line(e: BaseException, argv) -> str:
  """An unknown ``--config.x.y`` key: one line naming the closest valid one."""
  text = str(e).encode().decode("unicode_escape").replace("\n", " ").strip("'\" ")
  key = re.match(r"'?([^'\s]+)'?", text)
  name = key.group(1) if key else ""
  flag = next((a.split("=")[0].removeprefix("--") for a in argv[1:]
               if a.startswith("--config.") and name in a.split("=")[0].split(".")), name)
  hint = re.search(r'Did you mean "([^"]+)"', text)
  msg = f"error: unknown config key {flag!r}"
  if hint:
    parts = flag.split(".")
    parts[parts.index(name) if name in parts else -1] = hint.group(1)
    msg += f"; did you mean {'.'.join(parts)!r}?"
  return msg


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
