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

from lmscale_jax import exits
from lmscale_jax.errors import UserError, disk_full
from lmscale_jax.prep import options as prep_options
from lmscale_jax.store import dataset, file_io, output_marks, user_text


class Parser(argparse.ArgumentParser):
  """argparse, but a bad argument is one line (its usage block is what --help is for), and
  every file output (an option of type :class:`OutputFile`) is checked against the others
  once all are parsed: :func:`check_outputs`. A parser with a file output that replaces gets
  --overwrite here, so no command can have one without the other."""

  def error(self, message):
    self.exit(exits.EXIT_USAGE, f"error: {message} (see {self.prog} --help)\n")

  def parse_known_args(self, args=None, namespace=None):
    if replacing_outputs(self) and "--overwrite" not in self._option_string_actions:
      self.add_argument("--overwrite", action="store_true",
                        help="replace an existing output file that this command did not write")
    namespace, extras = super().parse_known_args(args, namespace)
    if problem := check_outputs(self, namespace):
      self.error(problem)
    return namespace, extras


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


class OutputFile:
  """An argparse type: a file to write, checked before any work (a build that ran 34 s then
  failed on a missing directory did): its directory exists and is writable, it is no
  directory, FIFO or device. Once every option is parsed (:func:`check_outputs`): it is none
  of the command's inputs, and an existing file is replaced only where it is the command's
  own earlier output (``owns(path, tool)``; default: its mark, store/output_marks.py) or
  --overwrite is given. ``append``: a results file, appended to and never replaced (only the
  first rule). ``stdout``: "-" is standard output."""

  def __init__(self, owns=output_marks.written_by, append: bool = False, stdout: bool = False):
    self.owns, self.append, self.stdout = owns, append, stdout

  def __call__(self, text: str) -> str:
    if not text or (self.stdout and text == "-"):
      return text  # "" is argparse parsing a default of "" (not given)
    where = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
      raise argparse.ArgumentTypeError(f"{text!r} is a directory: expected a file name")
    if not os.path.isdir(where):
      raise argparse.ArgumentTypeError(f"{text!r}: directory {where!r} does not exist "
                                       "(create it first)")
    if not os.access(where, os.W_OK | os.X_OK):
      raise argparse.ArgumentTypeError(f"{text!r}: directory {where!r} is not writable")
    if kind := file_io.not_regular(text):
      how = "append to" if self.append else "write"
      raise argparse.ArgumentTypeError(f"{text!r} is {kind}: expected a file to {how}")
    if self.append and os.path.exists(text) and not os.access(text, os.W_OK):
      raise argparse.ArgumentTypeError(f"{text!r} is not writable")
    return text


output_file = OutputFile()  # a file written whole (temp file, then renamed over it)
append_file = OutputFile(append=True)  # a results file: lines appended, earlier ones kept


def replacing_outputs(p: argparse.ArgumentParser) -> list:
  return [a for a in p._actions if isinstance(a.type, OutputFile) and not a.type.append]


def check_outputs(p: argparse.ArgumentParser, ns: argparse.Namespace) -> str | None:
  """The problem with the file outputs of ``ns``, else None: one that is the same file as
  another option's (an input, through a symlink or a hard link too: device and inode), or an
  existing file that is not the command's own earlier output, without --overwrite."""
  for action in p._actions:
    path = getattr(ns, action.dest, None) if isinstance(action.type, OutputFile) else None
    if not path or (action.type.stdout and path == "-"):
      continue
    flag = action.option_strings[0] if action.option_strings else action.dest
    if other := same_file_as(p, ns, action, path):
      return (f"argument {flag}: {path!r} is the same file as {other}: an output never "
              "replaces a file the command reads or writes; give another name (nothing was "
              "written)")
    if (not action.type.append and os.path.exists(path) and not getattr(ns, "overwrite", False)
        and not action.type.owns(path, p.prog)):
      return (f"argument {flag}: {path!r} exists and is not an earlier output of {p.prog}: "
              "give --overwrite to replace it, or another name (nothing was written)")
  return None


def same_file_as(p: argparse.ArgumentParser, ns: argparse.Namespace, output, path: str):
  """The first other option (``--elf 'x.so'``) whose value names the file ``path`` is, else
  None: the same device and inode where both exist, the same real path where two outputs
  name one file that does not exist yet."""
  me = file_identity(path)
  for action in p._actions:
    if action is output or action.dest == argparse.SUPPRESS:
      continue
    both_outputs = isinstance(action.type, OutputFile)
    for value in flat(getattr(ns, action.dest, None)):
      other = file_identity(value)
      if other == me and (both_outputs or other[0] == "inode"):
        flag = action.option_strings[0] if action.option_strings else action.dest
        return f"{flag} {value!r}"
  return None


def file_identity(path: str) -> tuple:
  """("inode", device, inode) of an existing file (a symlink or hard link to it is it too),
  else ("path", its real path)."""
  try:
    st = os.stat(path)
    return ("inode", st.st_dev, st.st_ino)
  except (OSError, ValueError):  # missing, or not a path (a NUL byte)
    try:
      return ("path", os.path.realpath(path))
    except ValueError:
      return ("path", None)


def flat(value) -> list[str]:
  """The strings of an option's value: itself, or those of a list (nargs, action="append")."""
  if isinstance(value, str):
    return [value] if value else []
  if isinstance(value, (list, tuple)):
    return [s for v in value for s in flat(v)]
  return []


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


def text(value: str) -> str:
  """An argparse type: text the model reads (--text), valid Unicode (store/user_text's rule:
  invalid UTF-8 in argv arrives as lone surrogates, which the tokenizer refuses mid-run)."""
  try:
    return user_text.check(value)
  except user_text.TextError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


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


def guarded(fn, interrupted: str) -> int:
  """Runs ``fn() -> exit status``; a user error, a full disk, Ctrl-C or SIGTERM becomes one
  line (``lmscale_jax.exits``: the codes, the SIGTERM handler, the line)."""
  with exits.sigterm_raises():
    try:
      return fn()
    except UserError as e:  # bad input: one line; a bug keeps its traceback
      return exits.error_line(str(e), exits.EXIT_USAGE)
    except KeyboardInterrupt as e:  # exits.Terminated too
      what, code = exits.stopped(e)
      return exits.error_line(f"{what}; {interrupted}", code)
    except (OSError, RuntimeError, ValueError) as e:
      full = disk_full(e)  # outside prepare() (writing the summary); anything else is a bug
      if full is None:
        raise
      # The file's name: OSError's, or the one a storage library's message names (errors.py);
      # a write that names none (file_io's writes name theirs) is said to be one.
      where = f"writing {full.filename}" if full.filename else "while writing its output"
      return exits.error_line(f"{full.reason.lower()} {where}; {interrupted}",
                              exits.EXIT_ERROR)
