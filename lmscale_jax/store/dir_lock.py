"""Advisory locks on directories: ``fcntl.flock`` of a lock file in them, exclusive (one holder)
or shared (many holders, who together keep an exclusive one out), taken without waiting.

Each holder writes its pid, host and start time (and what it is doing) into the file, so a
refused caller can name it. The kernel releases a lock when its holder exits, however it ends
(kill -9 included): a crash never leaves a stale lock. flock works on local disks and on NFSv4,
where Linux emulates it with a POSIX lock on the server, so it holds across nodes.

Users: a training workdir (``train/workdir.py``: exclusive, the file kept), a dataset
directory being prepared (``prep/output_dir.py``: exclusive for a single-node run, shared among a
cluster preparation's array tasks, the file removed by an exclusive holder as it ends) and a
staging destination (``input/file_copy.py``'s ``dir_lock``: exclusive, waited for up to a
timeout, the file kept).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time

# Every holder's record has this length, so shared holders, who write theirs at the same time,
# overwrite a whole record, never part of one.
RECORD_BYTES = 256
# Opened a file another holder removed as we opened it: a lock on nothing, so again (each
# retry means another holder came and went meanwhile: a few are plenty).
ATTEMPTS = 8


class Busy(Exception):
  """Another process holds the lock (exclusively, or shared when we asked for exclusive)."""

  def __init__(self, path: str, record: dict | None):
    self.path, self.record, self.holder = path, record, describe(record)
    super().__init__(f"{path}: held by {self.holder}")


class Unusable(Exception):
  """The lock file cannot be opened (``step`` "open") or locked (``step`` "lock": the file
  system may not support flock)."""

  def __init__(self, path: str, step: str, strerror: str):
    self.path, self.step, self.strerror = path, step, strerror
    super().__init__(f"cannot {step} {path} ({strerror})")


def read_record(text: str) -> dict | None:
  try:
    record = json.loads(text)
  except ValueError:
    return None
  return record if isinstance(record, dict) and {"pid", "host", "since"} <= set(record) else None


def describe(record: dict | None) -> str:
  """"pid P on host H, since T", or what it means that no holder is written yet. Shared holders
  write over each other's record: theirs names the latest to start, which may have ended."""
  if record is None:
    return "its pid and host are not written yet: it is just starting"
  latest = "the latest of its holders to start: " if record.get("shared") else ""
  return f"{latest}pid {record['pid']} on host {record['host']}, since {record['since']}"


def acquire(path: str, *, shared: bool = False, doing: str = "") -> int:
  """Takes the lock of ``path`` (created if missing) without waiting; returns the descriptor
  that holds it. Raises :class:`Busy` naming a holder, or :class:`Unusable`; a failed write of
  this holder's record is an ``OSError`` naming ``path`` (a full disk: one line for callers)."""
  for _ in range(ATTEMPTS):
    fd = _open(path)
    try:
      fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except OSError as e:
      text = os.pread(fd, 4096, 0).decode(errors="replace")
      os.close(fd)
      if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
        raise Unusable(path, "lock", e.strerror) from None
      raise Busy(path, read_record(text)) from None
    if _still_named(fd, path):
      _write_record(fd, path, doing, shared)
      return fd
    os.close(fd)
  raise Unusable(path, "lock", f"it was replaced {ATTEMPTS} times while being locked")


def release(fd: int, remove: str = "") -> None:
  """Releases a lock :func:`acquire` took; ``remove`` (its path, exclusive holders only) is
  unlinked first, while held: a process that opened it meanwhile then locks a file no longer
  named ``remove`` and :func:`acquire` tries again, so two never both hold the lock."""
  if remove:
    try:
      os.unlink(remove)
    except FileNotFoundError:
      pass
  os.close(fd)


def _open(path: str) -> int:
  try:
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  except OSError as e:
    raise Unusable(path, "open", e.strerror) from None


def _still_named(fd: int, path: str) -> bool:
  try:
    named = os.stat(path)
  except FileNotFoundError:
    return False
  held = os.fstat(fd)
  return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)


def _write_record(fd: int, path: str, doing: str, shared: bool) -> None:
  record = {"pid": os.getpid(), "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **({"doing": doing} if doing else {}),
            **({"shared": True} if shared else {})}
  data = (json.dumps(record).ljust(RECORD_BYTES - 1) + "\n").encode()
  try:
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))  # a longer earlier holder's record
  except OSError as e:
    os.close(fd)  # releases the lock: the caller does not start
    raise OSError(e.errno, e.strerror, path) from e
