"""Text a user gives — an argument, standard input, a JSON request body, a line of a labels,
pairs or benchmark file — checked where it enters, by one set of rules: it is valid Unicode,
and JSON is no deeper than the parser reads. Every entry that takes such text calls this module
(``lmscale fill-mask``/``search`` --text, serve's JSON bodies, finetune's labels and pairs
files); a failure is one :class:`TextError` naming the argument, field or ``FILE:LINE``.

Why: Python hands invalid UTF-8 in argv (and stdin under a C locale) over as lone surrogates
(``surrogateescape``), and JSON's ``"\\ud800"`` decodes to one; the tokenizer refuses such a
string with a TypeError deep inside a command (a traceback; HTTP 500 in the server), and a file
read with ``errors="replace"`` silently trained on U+FFFD. JSON nested a few thousand levels
deep is a RecursionError in the standard parser, which no ``except ValueError`` catches.
"""

from __future__ import annotations

import json
import re
import sys

from lmscale_jax.errors import UserError

_SURROGATE = re.compile("[\ud800-\udfff]")
EXPECTED = "expected UTF-8 text"
NEWLINE, BOM = b"\n", "\ufeff"


class TextError(UserError):
  """Text that is not valid Unicode, or JSON nested too deeply. Not a ValueError: a caller's
  ``except ValueError`` for malformed JSON must not swallow it into its own message."""


def _at(where: str, what: str) -> str:
  return f"{where}: {what}" if where else what


def check(text: str, where: str = "") -> str:
  """``text`` itself when it holds no lone surrogate (what invalid UTF-8 bytes become in argv,
  an unpaired ``\\u`` escape in JSON); else TextError naming ``where`` and the position."""
  if text.isascii():  # CPython keeps this flag: no scan (the search was 40 µs on a function)
    return text
  found = _SURROGATE.search(text)
  if found:
    code = ord(found.group())
    raise TextError(_at(where, f"not valid Unicode: character {found.start()} is U+{code:04X}, "
                           "a lone surrogate (invalid UTF-8 bytes, or an unpaired \\u escape "
                           f"in JSON); {EXPECTED}"))
  return text


def decode(data: bytes, where: str, lines: bool = True) -> str:
  """``data`` decoded as UTF-8, strictly (nothing replaced; a leading byte-order mark dropped,
  as json.loads of bytes did); else TextError naming the line
  (``where:LINE``; ``lines`` False: ``where`` alone, a request body) and byte offset."""
  try:
    return data.decode("utf-8").removeprefix(BOM)  # an editor's byte-order mark is no text
  except UnicodeDecodeError as e:
    line = f":{data.count(NEWLINE, 0, e.start) + 1}" if lines else ""
    raise TextError(f"{where}{line}: not valid UTF-8 (byte {data[e.start]:#04x} at offset "
                    f"{e.start}: {e.reason}); {EXPECTED}") from None


def read_stdin(where: str = "standard input") -> str:
  """All of standard input as text, decoded strictly whatever the locale (Python's own text
  layer replaces bad bytes by surrogates under a C locale, fails mid-read under UTF-8)."""
  binary = getattr(sys.stdin, "buffer", None)
  if binary is None:  # a text stream set in its place (a program embedding the CLI, a test)
    return check(sys.stdin.read(), where)
  return decode(binary.read(), where)


def read_file(path: str) -> str:
  """A text file's contents, decoded strictly (a labels or pairs file; errors: ``path:LINE``)."""
  with open(path, "rb") as f:
    return decode(f.read(), path)


def parse_json(text: str | bytes, where: str = ""):
  """The JSON value of ``text`` with every string in it (keys too) checked by :func:`check`,
  the first bad one named by its path (``texts[2]``, ``variants.gcc-O0.text``). Too deep a
  document is a TextError; malformed JSON stays ``json.JSONDecodeError`` (a ValueError) for
  the caller, which knows what it expected there."""
  if isinstance(text, bytes):
    text = decode(text, where or "JSON", lines=False)
  try:
    doc = json.loads(text)
  except RecursionError:
    raise TextError(_at(where, "JSON nested too deeply (over the reader's limit of about "
                           f"{sys.getrecursionlimit()} levels)")) from None
  for path, value in _strings(doc):
    check(value, _at(where, path) if path else where)
  return doc


def _strings(doc):
  """(path, string) of every string in ``doc``, in document order; a key is reported under its
  object's path. Iterative: ``doc`` may be as deep as the parser allowed."""
  stack = [("", doc)]
  while stack:
    path, value = stack.pop()
    if isinstance(value, str):
      yield path, value
    elif isinstance(value, dict):
      for key in value:
        yield (f"a key of {path}" if path else "a key"), key
      stack.extend(reversed([(_join(path, key), v) for key, v in value.items()]))
    elif isinstance(value, list):
      stack.extend(reversed([(f"{path}[{i}]", v) for i, v in enumerate(value)]))


def _join(path: str, key: str) -> str:
  """``path.key``, the key shown escaped where it is itself no valid text (so a message
  naming it can be printed and sent as JSON)."""
  shown = key.encode("utf-8", "backslashreplace").decode() if _SURROGATE.search(key) else key
  return f"{path}.{shown}" if path else shown
