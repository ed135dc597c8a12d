"""lmscale_jax entry point: parse flags, then one call, ``train.startup.run``, that starts the
process and runs ``pretrain.trainer.train_and_evaluate``.

  python -m lmscale_jax.main --config=configs/bert350m.py --workdir=DIR
      --config.data.path=DATASET [--config.train.batch_size=256 …] [--dry_run]
      [--verify_data] [--allow_config_change]

``lmscale train`` takes the same arguments and runs this code (``--config FILE``, ``--dry-run``
spellings too). ``--config.a.b=v`` values are typed by the key's default
(``lmscale_jax.config.loader``). Several processes (launch/local.sh, launch/node.sh,
launch/slurm.sbatch) find each other through ``lmscale_jax.cluster.distributed`` (config
``distributed.*``, ``LMSCALE_*`` or Slurm variables); ``--config.data.stage_from=SHARED``
first copies the dataset to ``data.path`` on every node (``lmscale_jax.input.staging``).

Exits (``lmscale_jax.train.startup``): 0 finished or preempted (checkpoint saved); 1 with one
``error:`` line for a user error (bad flag or value, bad data, incompatible or busy workdir,
disk full); 75 with one ``error:`` line naming the process and host that was lost from a
multi-process job (killed, crashed, node failed: rerun to resume;
lmscale_jax/cluster/supervisor.py); 130 on Ctrl-C (the last complete checkpoint is kept: rerun
to resume); 143 on SIGTERM before the run could checkpoint; a traceback only for a bug.
"""

import re
import sys
import textwrap
import time

from absl import app, flags, logging

from lmscale_jax import exits
from lmscale_jax.config import loader
from lmscale_jax.errors import ConfigError
from lmscale_jax.train import startup

FLAGS = flags.FLAGS
flags.DEFINE_string("config", None, "A shipped config by name or a file of your own with a "
                    "get_config().")
flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics.jsonl and config.json; "
                    "rerun the same command to resume the run in it.")
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
_USAGE = ("usage: {prog} --config=configs/<name>.py --workdir=DIR [--config.data.path=DATASET] "
          "[--config.<section>.<key>=VALUE …] (--help for more)")
# What --help prints: what a user types first; the developer's account is this module's
# docstring and docs/design.md.
_HELP = """\
usage: {prog} --config CONFIG --workdir DIR [--config.SECTION.KEY=VALUE …]
           [--dry-run] [--verify-data] [--allow-config-change]

Pretrain a BERT masked-language model on a dataset that lmscale prepare wrote. Every key,
resuming, several GPUs and nodes, and the exit codes: docs/training.md.

{options}

  e.g.  {prog} --config tiny --workdir runs/tiny --config.data.path=data/text
        {prog} --config bert350m --workdir runs/350m --config.data.path=data/bin \\
            --config.train.batch_size=256 --dry-run

Exit 0: finished, or preempted with a checkpoint saved (rerun to resume); 1: one error: line
naming what to fix; 130: Ctrl-C (rerun to resume)."""
_OVERRIDES = ("Set any key of the config, typed by its default: --config.data.path=DATASET "
              "(the dataset directory), --config.train.batch_size=256, --config.train.steps=N; "
              "a key the config does not have is an error naming the closest.")
_SPELLINGS = {f"--{flag.replace('_', '-')}": f"--{flag}"
              for flag in ("dry_run", "verify_data", "allow_config_change")}
_config = None  # the run's config: parse_flags loads it (the loader), main runs it


def main(argv):
  if len(argv) > 1:
    sys.exit(f"error: unexpected arguments {argv[1:]} (flags are --name=value). "
             f"{_usage(argv)}")
  config, workdir = _config, FLAGS.workdir
  if FLAGS.dry_run:  # this process only: no runtime to start, nothing to stage or lock
    return startup.run(config, workdir, lambda _: _describe(config, workdir), runtime=False,
                       exit_at_once=True)
  # The checks before any data is read, in order: lmscale_jax/config/checks.py.
  return startup.run(config, workdir, lambda _: _train(config, workdir),
                     checks=lambda: _checks(config), exit_at_once=True)


def _checks(config) -> None:
  """Before the runtime and the workdir lock: a run refused here leaves nothing behind."""
  if not str(config.data.path):  # not a dataset '' that does not exist
    raise ConfigError("config.data.path is not set: give --config.data.path=DATASET, the "
                      "directory lmscale prepare wrote (or set data.path in the config file)")
  startup.check_before_runtime(config)


def _describe(config, workdir: str) -> None:
  from lmscale_jax.pretrain import trainer

  setup = trainer.build_setup(config, workdir=workdir)
  print(config)
  print(trainer.describe(setup))


def _train(config, workdir: str) -> None:
  """The run, once the process has started (``startup.start``): staging, the dataset check,
  ``--verify_data``, training."""
  from lmscale_jax.cluster import distributed
  from lmscale_jax.input import dataset_checks, staging
  from lmscale_jax.pretrain import trainer

  import jax  # here, not at module level: Grain's worker processes re-import __main__

  if config.data.stage_from:
    staging.stage_per_node(config.data.stage_from, config.data.path,
                           workers=int(config.data.stage_workers),
                           timeout_s=float(config.data.stage_timeout), log=_progress)
  # The shards this process reads (data.process_shards, the loader's read plan).
  reads = dict(num_processes=jax.process_count(), process_id=jax.process_index(),
               plan="by_shard" if config.data.shard_by_process else "interleaved")
  meta = distributed.agree("dataset check",
                           lambda: dataset_checks.check_dataset_dir(config.data.path, **reads))
  if FLAGS.verify_data:
    distributed.agree("data verification", lambda: dataset_checks.verify_shards(
        meta, log=_progress, **reads))
  logging.info("workdir %s", workdir)
  started = time.time()
  # checked: _checks before the runtime, preflight's check_batch after it; each runs once.
  row = trainer.train_and_evaluate(config, workdir, meta=meta, checked=True,
                                   allow_config_change=FLAGS.allow_config_change)
  if jax.process_index() == 0:
    line = summary(row, int(config.train.steps), workdir, time.time() - started)
    if line:
      startup.show_log()
      print(line, flush=True)


def summary(row: dict, total: int, workdir: str, seconds: float) -> str:
  """The run's last line: a finished run's step, losses, time and checkpoint; a rerun of a
  finished run, that there was nothing to do; "" for a preempted run (it said so)."""
  from lmscale_jax.train import checkpoint as ckpt_lib

  step = int(row.get("step", 0))
  checkpoint = ckpt_lib.step_dir(workdir, step)
  if "loss" not in row and step >= total:
    return (f"{workdir} is finished: step {step} of train.steps={total}, nothing to do "
            f"(checkpoint {checkpoint}; a larger --config.train.steps continues it)")
  if step < total:
    return ""
  evaluated = (f", eval loss {_number(row['eval_loss'])}" if "eval_loss" in row else "")
  return (f"done: step {step} of {total}, loss {_number(row.get('loss'))}{evaluated}, "
          f"{_duration(seconds)}; checkpoint {checkpoint} (lmscale evaluate, fill-mask, embed, "
          f"export-hf --workdir {workdir})")


def _number(value) -> str:
  return "non-finite" if value is None else f"{value:.4f}"


def _duration(seconds: float) -> str:
  minutes, s = divmod(round(seconds), 60)
  return f"{minutes} min {s} s" if minutes else f"{seconds:.1f} s"


def _progress(line: str) -> None:
  """A line of work the user waits for (staging, --verify_data: minutes): the lines start-up
  held back (startup.hold_log) come out with it, not when training starts."""
  startup.show_log()
  logging.info("%s", line)


def _usage(argv) -> str:
  return _USAGE.format(prog=_prog(argv))


def _prog(argv) -> str:
  """The command as the user typed it: ``lmscale train``, or ``python -m lmscale_jax.main``."""
  return argv[0] if argv[0].startswith("lmscale ") else "python -m lmscale_jax.main"


def parse_flags(argv):
  """absl parsing of the flags and the loader's (``config.loader``) of ``--config`` and
  ``--config.a.b=v``, but every mistake on the command line is one ``error:`` line (exit 1),
  not a traceback, and ``--help`` prints the usage and exits 0."""
  global _config
  if any(a in ("--help", "-h", "--helpshort", "-?") for a in argv[1:]):
    print(help_text(_prog(argv)))
    sys.exit(0)
  args = [_SPELLINGS.get(a.split("=")[0], a.split("=")[0]) + a[len(a.split("=")[0]):]
          for a in argv[1:]]
  try:
    overrides, args = loader.split_overrides(args)
  except ConfigError as e:
    sys.exit(f"error: {e}")
  try:
    rest = FLAGS([argv[0], *args], known_only=False)
  except flags.UnrecognizedFlagError as e:
    hint = re.search(r"Did you mean: (\S+) \?", str(e))
    sys.exit(f"error: unknown flag --{e.flagname}"
             + (f" (did you mean --{hint.group(1).split(',')[0]}?)" if hint else "")
             + f". {_usage(argv)}")
  except flags.Error as e:  # a flag's value (--dry_run=maybe), a flag without one
    sys.exit(f"error: {_first_line(e)}. {_usage(argv)}")
  missing = [f"--{name}" for name in _REQUIRED if FLAGS[name].value is None]
  if missing:
    sys.exit(f"error: {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
             f"required. {_usage(argv)}")
  try:
    _config = loader.load(FLAGS.config, overrides)
  except ConfigError as e:
    sys.exit(f"error: {e}")
  _config.lock()  # a key the config does not have is a typo, also in library code
  return rest


def help_text(prog: str) -> str:
  """``--help``: the usage, each option with its flag's own help, an example, the exits."""
  names = f"by name ({', '.join(loader.shipped())})"
  rows = [("--config CONFIG", FLAGS["config"].help.replace("by name", names, 1)),
          ("--workdir DIR", FLAGS["workdir"].help),
          ("--config.SECTION.KEY=VALUE", _OVERRIDES)]
  rows += [(flag, FLAGS[name[2:]].help) for flag, name in _SPELLINGS.items()]
  return _HELP.format(prog=prog, options="\n".join(_option(*row) for row in rows))


def _option(flag: str, text: str) -> str:
  body = textwrap.wrap(text, 92 - 30)
  lines = [f"  {flag:<28}{body[0]}" if len(flag) < 28 else f"  {flag}\n{' ' * 30}{body[0]}"]
  return "\n".join(lines + [" " * 30 + line for line in body[1:]])


def _first_line(e: BaseException) -> str:
  return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def run_command(argv: list[str], prog: str = "lmscale train") -> int:
  """The command line ``argv`` (without the program) run as ``python -m lmscale_jax.main``
  runs it; returns its exit code (``lmscale train``)."""
  try:
    app.run(main, argv=[prog, *argv], flags_parser=parse_flags)
  except SystemExit as e:
    if isinstance(e.code, str):
      print(e.code, file=sys.stderr, flush=True)
      return exits.EXIT_ERROR
    return e.code or 0
  return 0


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
