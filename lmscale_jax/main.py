"""lmscale_jax entry point: parse flags, start the runtime, call ``train.train_and_evaluate``.

  python -m lmscale_jax.main --config=configs/bert350m.py --workdir=DIR \
      --config.data.path=DATASET [--config.train.batch_size=256 …] [--dry_run]

Several processes (launch/local.sh, launch/node.sh, launch/slurm.sbatch) find each other
through ``lmscale_jax.distributed`` (config ``distributed.*``, ``LMSCALE_*`` or Slurm
variables); ``--config.data.stage_from=SHARED`` first copies the dataset to ``data.path`` on
every node (``lmscale_jax.staging``).
"""

import logging as std_logging
import re
import sys

from absl import app, flags, logging
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py).", lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and config.json.")
flags.DEFINE_bool("dry_run", False, "Print the resolved config, parameter count, FLOPs per "
                  "step and a memory estimate, then exit.")
flags.DEFINE_bool("verify_data", False, "Before training, check the sha256 of every shard "
                  "this process reads against the dataset's metadata.json (logs MB/s).")
flags.mark_flags_as_required(["config", "workdir"])


class _QuietLibraries(std_logging.Filter):
  """Orbax and Grain log every save/restore phase at INFO; keep their warnings only."""

  def filter(self, record):
    return record.levelno >= std_logging.WARNING or not any(
        f"/{lib}/" in record.pathname for lib in ("orbax", "grain"))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.get_absl_handler().addFilter(_QuietLibraries())
  # Imported here, not at module level: Grain's worker processes re-import __main__.
  import jax

  from lmscale_jax import config_checks, data_checks, distributed, preemption, staging, train
  from lmscale_jax.errors import UserError

  # Bad settings or data (UserError): one line, no traceback (logged with --verbosity=1).
  # Anything else is a bug and keeps its traceback.
  config = FLAGS.config
  if FLAGS.dry_run:  # this process only: no runtime to start, nothing to stage
    try:
      setup = train.build_setup(config)
    except UserError as e:
      logging.vlog(1, "traceback", exc_info=True)
      sys.exit(f"error: {e}")
    print(config)
    print(train.describe(setup))
    return
  try:
    # The checks before any data is read, in order: lmscale_jax/config_checks.py.
    config_checks.check_config(config)
    distributed.initialize(config)  # before anything touches a JAX backend
    preemption.install()  # after: the runtime installs its own SIGTERM handler
    distributed.preflight(config, FLAGS.workdir)
    if config.data.stage_from:
      staging.stage_per_node(config.data.stage_from, config.data.path,
                             workers=int(config.data.stage_workers),
                             timeout_s=float(config.data.stage_timeout), log=logging.info)
    # The shards this process reads (data.process_shards, the loader's read plan).
    reads = dict(num_processes=jax.process_count(), process_id=jax.process_index(),
                 plan="by_shard" if config.data.shard_by_process else "interleaved")
    meta = distributed.agree("dataset check",
                             lambda: data_checks.check_dataset_dir(config.data.path, **reads))
    if FLAGS.verify_data:
      distributed.agree("data verification", lambda: data_checks.verify_shards(
          meta, log=logging.info, **reads))
    logging.info("workdir %s", FLAGS.workdir)
    train.train_and_evaluate(config, FLAGS.workdir, meta=meta)
  except Exception as e:
    if jax.distributed.is_initialized():
      # The other processes may be blocked in a collective with this one: report and leave
      # now (see distributed.exit_now); they stop within distributed.heartbeat_timeout.
      me = f"error: process {jax.process_index()}:"
      collective = isinstance(e, jax.errors.JaxRuntimeError)  # a collective failed: peer died?
      if collective:
        # First and fast: when the coordinator's process is the one lost, the runtime aborts
        # this process within milliseconds of the failed collective.
        gone = distributed.coordinator_gone()
        if gone:
          print(f"{me} {gone}", file=sys.stderr, flush=True)
      logging.exception("process %d failed", jax.process_index())
      print(f"{me} {type(e).__name__}: {e}", file=sys.stderr)
      if collective and not gone:
        print(f"{me} "
              + distributed.explain_collective_failure(config.distributed.heartbeat_timeout),
              file=sys.stderr, flush=True)
      distributed.exit_now(1)
    if isinstance(e, UserError):
      logging.vlog(1, "traceback", exc_info=True)
      sys.exit(f"error: {e}")
    raise


def parse_flags(argv):
  """absl parsing, but an unknown ``--config.x.y`` key is one clear line, not a traceback."""
  try:
    return FLAGS(argv)
  except (AttributeError, KeyError) as e:
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
    sys.exit(msg)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
