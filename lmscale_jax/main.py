"""lmscale_jax entry point: parse flags, start the runtime, call ``train.train_and_evaluate``.

  python -m lmscale_jax.main --config=configs/bert350m.py --workdir=DIR \
      --config.data.path=DATASET [--config.train.batch_size=256 …] [--dry_run]
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
  from lmscale_jax import train

  config = FLAGS.config
  if FLAGS.dry_run:
    setup = train.build_setup(config)
    print(config)
    print(train.describe(setup))
    return
  logging.info("workdir %s", FLAGS.workdir)
  train.train_and_evaluate(config, FLAGS.workdir)


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
