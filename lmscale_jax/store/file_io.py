"""Reading and writing the files every layer shares, safely: a write is a temp file renamed over
the target (a reader never sees half a file, a crash leaves the old one), and a path a user names
is asked whether it is a regular file before it is opened (a FIFO would block the reader)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from typing import Any

from lmscale_jax.errors import UserError


def not_regular(path: str) -> str | None:
  """What ``path`` is when it exists but is no regular file ("a directory", "a FIFO", …), else
  None. Opening a FIFO to read blocks until something writes to it: every reader of a file a
  user names asks this first, so a FIFO is one line instead of a hang."""
  try:
    mode = os.stat(path).st_mode
  except OSError:
    return None  # missing: the caller's own message says what was expected there
  for test, kind in ((stat.S_ISREG, None), (stat.S_ISDIR, "a directory"),
                     (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                     (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
    if test(mode):
      return kind
  return "not a regular file"


def entry_kind(path: str) -> str:
  """What a directory entry is, in :func:`not_regular`'s words ("a regular file", "a FIFO", "a
  broken symbolic link"), for the lines that refuse an entry of the wrong kind."""
  if not os.path.exists(path):
    return "a broken symbolic link" if os.path.islink(path) else "missing"
  return not_regular(path) or "a regular file"


def error_reason(e: BaseException) -> str:
  """An exception as the reason of a one-line error: its message, or its type where it has
  none (array_record raises ``RuntimeError('')`` for a shard cut at a 64 KiB block boundary)."""
  return str(e).strip() or f"{type(e).__name__} without a message"


def read_json(path: str, what: str, fix: str, error=None):
  """``path`` parsed as JSON; anything else (missing, not a regular file, unreadable, not JSON)
  is one line of ``error`` (a UserError subclass; UserError by default): ``PATH: not a JSON
  file (why): expected WHAT; FIX``. A FIFO is refused unopened (it would block the read)."""
  error = error or UserError
  if kind := not_regular(path):
    raise error(f"{path} is {kind}: expected {what}; {fix}")
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
    raise error(f"{path}: not a JSON file ({error_reason(e)}): expected {what}; {fix}") from None


def read_jsonl(path: str, what: str, error=None) -> list[dict]:
  """Each non-blank line of a JSON-lines results file as a dict; a missing or unreadable file,
  a line that is not JSON or not an object is one line of ``error`` (UserError by default)
  naming the file (and the line) and ``what`` was expected."""
  error = error or UserError
  if kind := not_regular(path):
    raise error(f"{path} is {kind}: expected {what}")
  try:
    with open(path) as f:
      lines = f.read().splitlines()
  except (OSError, ValueError) as e:
    raise error(f"{path}: cannot read it ({error_reason(e)}): expected {what}") from None
  rows = []
  for n, line in enumerate(lines, 1):
    try:
      row = json.loads(line) if line.strip() else None
    except ValueError:
      raise error(f"{path}:{n}: not a JSON line: expected {what}") from None
    if line.strip() and not isinstance(row, dict):
      raise error(f"{path}:{n}: expected a JSON object per line ({what})")
    if row is not None:
      rows.append(row)
  return rows


def sha256_file(path: str, chunk: int = 1 << 22) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(chunk):
      h.update(block)
  return h.hexdigest()


def fsync_dir(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def atomic_write_bytes(path: str, data: bytes) -> None:
  """Write to a temp file in the same directory, fsync, rename: never a partial file."""
  d = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(dir=d, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
  try:
    os.fchmod(fd, 0o644)  # mkstemp creates 0600; datasets are shared between users/nodes
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException as e:
    if os.path.exists(tmp):
      os.unlink(tmp)
    if isinstance(e, OSError) and e.filename is None:
      # A write, flush or fsync names no file: a full disk was "no space left on the device
      # (output)". The file it was to become names it.
      raise OSError(e.errno, e.strerror, path) from e
    raise
  fsync_dir(d)


def atomic_write_json(path: str, obj: Any) -> None:
  atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())
