"""Copying a file with its bytes hashed as they pass: the primitive of staging
(``lmscale_jax/input/staging.py``), with the file signatures, the progress bar and the destination
lock it uses."""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import threading
import time
from typing import Callable

from lmscale_jax.errors import UserError
from lmscale_jax.store import destination, file_io
from lmscale_jax.store import dir_lock as store_lock

TMP_SUFFIX = destination.STAGE_TEMP_SUFFIX  # a copy in progress: ``.{name}.staging``
CHUNK = 8 << 20


def temp_name(path: str) -> str:
  return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}{TMP_SUFFIX}")


def hash_file(path: str) -> str:
  return file_io.sha256_file(path, chunk=CHUNK)


def signature(path: str) -> list | None:
  """(size, mtime_ns, inode): changes whenever the file is rewritten or replaced."""
  try:
    st = os.stat(path)
  except OSError:
    return None
  return [st.st_size, st.st_mtime_ns, st.st_ino]


class Progress:
  """A byte counter behind a tqdm bar (MB/s); thread-safe; silent when disabled."""

  def __init__(self, total: int, enabled: bool, desc: str):
    self.lock = threading.Lock()
    self.bar = None
    if enabled and total:
      from tqdm import tqdm

      self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr,
                      mininterval=0.5, smoothing=0.1)

  def update(self, n: int) -> None:
    if self.bar is not None:
      with self.lock:
        self.bar.update(n)

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()


def copy_hashed(src: str, dst: str, expected_sha: str, expected_bytes: int,
              progress: Progress) -> str:
  """Copies ``src`` to ``dst`` via a temp name; returns the sha256 of the bytes copied.

  The hash is of the bytes as read from the source and written; the temp file is renamed to
  ``dst`` only when hash and size are the expected ones, else deleted.
  """
  tmp = temp_name(dst)
  hasher = hashlib.sha256()
  buf = bytearray(CHUNK)
  view = memoryview(buf)
  size = 0
  try:
    with open(src, "rb", buffering=0) as fin, open(tmp, "wb", buffering=0) as fout:
      while count := fin.readinto(buf):
        chunk = view[:count]
        hasher.update(chunk)
        written = 0
        while written < count:  # unbuffered writes may be partial
          written += fout.write(chunk[written:])
        size += count
        progress.update(count)
      os.fsync(fout.fileno())
    os.chmod(tmp, 0o644)
    digest = hasher.hexdigest()
    if digest != expected_sha or size != expected_bytes:
      os.unlink(tmp)
      return digest
    os.replace(tmp, dst)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise
  return digest


class LockTimeout(UserError, RuntimeError):
  """Another process held a directory's lock for longer than the caller waits."""


class LockUnusable(UserError, RuntimeError):
  """A directory's lock file cannot be opened or locked (a file system without flock)."""


@contextlib.contextmanager
def dir_lock(directory: str, name: str, timeout_s: float, log: Callable[[str], None],
             doing: str, timeout_key: str, poll_s: float = 0.2):
  """Holds ``directory/name`` exclusively (``store/dir_lock``: ``fcntl.flock``, this pid and
  host written in it); waits up to ``timeout_s`` for another holder, logging once whom it
  waits for. The kernel releases the lock when its holder exits, however it ends: no stale
  lock after a crash. The file is kept (a holder that removed it would race the next one)."""
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, name)
  deadline, said = time.monotonic() + timeout_s, False
  while True:
    try:
      fd = store_lock.acquire(path, doing=doing)
      break
    except store_lock.Busy as e:
      holder = f"pid {e.record['pid']} on {e.record['host']}" if e.record else "a process"
      if time.monotonic() >= deadline:
        raise LockTimeout(
            f"{holder} has been {doing} {directory} for longer than {timeout_s:.0f} s "
            f"({timeout_key}): wait for it to finish, or raise the timeout") from None
      if not said:
        log(f"waiting for {holder}, which is {doing} {directory} (up to {timeout_s:.0f} s)")
        said = True
      time.sleep(poll_s)
    except store_lock.Unusable as e:
      hint = ": its file system may not support flock" if e.step == "lock" else ""
      raise LockUnusable(f"{e}, needed for {doing} {directory}{hint}") from None
  try:
    yield
  finally:
    store_lock.release(fd)
