"""Shared argument parsing and error handling of the ``lmscale`` subcommands.

Every numeric option is checked where it is parsed (type, finite, range; the bounds are
``lmscale_jax.prep.options``'), and every way a run ends badly is one line on stderr: a user
error or a bad argument or a full disk (exit 1), Ctrl-C (exit 130) or SIGTERM (exit 143;
the rerun resumes after either). A bug keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading

from lmscale_jax.errors import UserError, disk_full
from lmscale_jax.prep import options as prep_options
from lmscale_jax.store import dataset, file_io

EXIT_USAGE, EXIT_INTERRUPTED = 1, 130  # usage and user errors alike (docs/design.md "Exit codes")
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143: what a shell reports for a process SIGTERM ended


class Parser(argparse.ArgumentParser):
  """argparse, but a bad argument is one line (its usage block is what --help is for)."""

  def error(self, message):
    self.exit(EXIT_USAGE, f"error: {message} (see {self.prog} --help)\n")


def env_int(name: str, default: int) -> int:
  """An integer from the environment (Slurm's SLURM_ARRAY_TASK_ID …), else ``default``."""
  try:
    return int(os.environ.get(name, default))
  except ValueError:
    return default


def add_array_task(p: argparse.ArgumentParser, what: str = "") -> None:
  """--task/--tasks of a Slurm job array's task (lmscale prepare cluster, lmscale index):
  defaults from SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT, else 0 of 1."""
  p.add_argument("--task", type=number(int, 0, 1 << 20), default=env_int("SLURM_ARRAY_TASK_ID", 0),
                 help="this array task, 0-based (default: SLURM_ARRAY_TASK_ID, else 0)")
  p.add_argument("--tasks", type=number(int, 1, 1 << 20),
                 default=env_int("SLURM_ARRAY_TASK_COUNT", 1),
                 help="array tasks (default: SLURM_ARRAY_TASK_COUNT, else 1)" + what)


def number(kind, lo, hi):
  """An argparse type: an int or float in lo..hi (never inf/nan, whatever float() accepts)."""

  def parse(text: str):
    what = "an integer" if kind is int else "a finite number"
    try:
      value = kind(text)
    except ValueError:
      value = None
    if value is None or not (math.isfinite(value) and lo <= value <= hi):
      raise argparse.ArgumentTypeError(
          f"{text!r}: expected {what} in {prep_options.show_range(lo, hi)}")
    return value

  return parse


def output_file(text: str) -> str:
  """An argparse type: a file to write, checked before any work (a build that ran 34 s then
  failed on a missing directory did): its directory exists and is writable, it is no
  directory."""
  where = os.path.dirname(os.path.abspath(text))
  if os.path.isdir(text):
    raise argparse.ArgumentTypeError(f"{text!r} is a directory: expected a file name")
  if not os.path.isdir(where):
    raise argparse.ArgumentTypeError(f"{text!r}: directory {where!r} does not exist "
                                     "(create it first)")
  if not os.access(where, os.W_OK | os.X_OK):
    raise argparse.ArgumentTypeError(f"{text!r}: directory {where!r} is not writable")
  return text


def append_file(text: str) -> str:
  """An argparse type: a file to append to (a results file), checked as :func:`output_file`
  and, when it exists, a regular file this process may write."""
  output_file(text)
  if kind := file_io.not_regular(text):
    raise argparse.ArgumentTypeError(f"{text!r} is {kind}: expected a file to append to")
  if os.path.exists(text) and not os.access(text, os.W_OK):
    raise argparse.ArgumentTypeError(f"{text!r} is not writable")
  return text


def output_dir(text: str) -> str:
  """An argparse type: a directory to create or write into, checked before any work (an
  export restored its checkpoint, then failed on a parent that is a file): it is no file, and
  it or its nearest existing parent is a directory this process may write."""
  if os.path.exists(text) and not os.path.isdir(text):
    raise argparse.ArgumentTypeError(f"{text!r} exists and is not a directory: expected a "
                                     "directory to create or write into")
  where = os.path.abspath(text)
  while not os.path.exists(where):
    where = os.path.dirname(where)
  if not os.path.isdir(where):
    raise argparse.ArgumentTypeError(f"{text!r}: {where!r} is a file, not a directory")
  if not os.access(where, os.W_OK | os.X_OK):
    raise argparse.ArgumentTypeError(f"{text!r}: directory {where!r} is not writable")
  return text


def input_file(text: str) -> str:
  """An argparse type: a file to read, checked before any work: it exists and is a regular
  file (a FIFO would block its reader forever, a device never end; preparation skips both)
  this process may read. "" passes: argparse parses a default of "" (not given) too."""
  if not text:
    return text
  if not os.path.exists(text):
    raise argparse.ArgumentTypeError(f"{text!r}: no such file")
  if kind := file_io.not_regular(text):
    raise argparse.ArgumentTypeError(f"{text!r} is {kind}: expected a regular file to read")
  if not os.access(text, os.R_OK):
    raise argparse.ArgumentTypeError(f"{text!r} is not readable (permissions)")
  return text


def check_split(meta: dataset.DatasetMeta, split: str) -> None:
  """Every shard of ``split`` is there, a regular file of its size and record count (no
  checksums: seconds for any dataset), before a tool restores a model to read it: a damaged
  shard is its one line now, not once the restore is done."""
  meta.shard_paths(split)  # a split without shards: its own line
  for shard in meta.splits[split]["shards"]:
    if problem := meta.shard_problem(shard, checksums=False):
      raise dataset.DatasetError(f"{problem} (lmscale inspect-data --verify checks every shard)")


def add_model_source(p: argparse.ArgumentParser) -> None:
  """The trained model a tool reads (lmscale_jax.inference.trained_model): a run's workdir
  (latest or --step checkpoint, the dataset's tokenizer) or a directory lmscale export-hf
  wrote."""
  p.add_argument("--workdir", default="", help="a training run's --workdir")
  p.add_argument("--step", type=number(int, 0, 1 << 62), default=None)
  p.add_argument("--tokenizer", default="", type=input_file,
                 help="(--workdir) the dataset's tokenizer.json")
  p.add_argument("--hf", default="", metavar="OUT", help="a directory lmscale export-hf wrote")


class Terminated(KeyboardInterrupt):
  """SIGTERM (``timeout``, systemd, a batch system), raised in the main thread as Ctrl-C's
  KeyboardInterrupt is, so it unwinds the same way (process pools stopped, locks released);
  Python's default ended the process at once: exit 143, no line, the workers left running."""


def _terminated(signum, frame):
  signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one unwinding: a second would interrupt it
  raise Terminated


def guarded(fn, interrupted: str) -> int:
  """Runs ``fn() -> exit status``; a user error, a full disk, Ctrl-C or SIGTERM becomes one
  line."""
  here = threading.current_thread() is threading.main_thread()  # where signal handlers run
  before = signal.signal(signal.SIGTERM, _terminated) if here else None
  try:
    return fn()
  except UserError as e:  # bad input: one line; a bug keeps its traceback
    print(f"error: {e}", file=sys.stderr)
    return EXIT_USAGE
  except Terminated:
    print(f"error: terminated (SIGTERM); {interrupted}", file=sys.stderr)
    return EXIT_TERMINATED
  except KeyboardInterrupt:
    print(f"error: interrupted; {interrupted}", file=sys.stderr)
    return EXIT_INTERRUPTED
  except (OSError, RuntimeError, ValueError) as e:
    full = disk_full(e)  # outside prepare() (writing the summary); anything else is a bug
    if full is None:
      raise
    print(f"error: no space left on the device ({full.filename or 'output'})", file=sys.stderr)
    return 1
  finally:
    if here:
      signal.signal(signal.SIGTERM, before)
