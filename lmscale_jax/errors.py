"""The project's exception types for user errors: bad settings, bad data, an incompatible
checkpoint, an unusable cluster environment. ``main`` prints one ``error:`` line for a
:class:`UserError` and a full traceback for anything else (a bug must never look like a user
error). Each module raises its own subclass; they keep the builtin base they had before
(``ValueError``/``RuntimeError``) so that callers catching those still work.
"""

import re
from typing import NamedTuple


class UserError(Exception):
  """Something the user can fix: the message names the file/key/value and what was expected."""


class ConfigError(UserError, ValueError):
  """A config value (``--config.a.b=…`` or a configs/*.py) is invalid or inconsistent."""


class IncompatibleCheckpoint(UserError, ValueError):
  """The workdir's checkpoint cannot be resumed by this run (model shape, process count, the
  loader state of another version)."""


class PrepareError(UserError, ValueError):
  """Bad arguments, inputs or output directory of a data preparation (tools/prepare_*.py)."""


# --------------------------------------------------------------------------- a full disk
# The errnos of a full device or quota, and how storage libraries spell them when they do not
# raise an OSError: tensorstore (Orbax's array writer) raises ValueError("RESOURCE_EXHAUSTED:
# Error writing local file \"…\": … No space left on device [os_error_code='28']"), the C++
# ArrayRecord writer a RuntimeError carrying the errno's text (both seen on a full tmpfs).
_FULL_ERRNOS = (28, 122)  # ENOSPC, EDQUOT (Linux)
_FULL_TEXTS = ("No space left on device", "Disk quota exceeded")
_NAMED_FILE = re.compile(r'(?:local file|Failed to open:?|open) "([^"]+)"')


class DiskFull(NamedTuple):
  """A full disk behind an exception: the file being written (None if unknown) and why."""
  filename: str | None
  reason: str


def disk_full(e: BaseException | None) -> DiskFull | None:
  """The full disk (ENOSPC/EDQUOT) behind ``e`` or any exception in its chain (libraries wrap
  them), or None. One owner for the question, so every tool maps the same errors to its one
  disk-full line."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
      return DiskFull(e.filename if isinstance(e.filename, str) else None,
                      e.strerror or _FULL_TEXTS[0])
    text = str(e)
    reason = next((t for t in _FULL_TEXTS if t in text), None)
    if reason is not None and isinstance(e, (RuntimeError, ValueError)):
      named = _NAMED_FILE.findall(text)
      return DiskFull(named[-1].removesuffix(".__lock") if named else None, reason)
    e = e.__cause__ or e.__context__
  return None
