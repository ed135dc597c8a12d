"""Which command wrote a file: the mark every replace-type output file carries, so that a
rerun recognises its own earlier output (and replaces it) and refuses any other file unless
the user gives --overwrite (the rule: lmscale_jax/cli/args.py's ``OutputFile``).

The marks, each found in the file's first bytes or one zip member (cheap at any size, and
never a whole multi-gigabyte file read to learn that it is an ELF):

* a JSON report (``search --json``, ``eval-similarity --json``, ``classify --json`` …): its
  first key is ``"tool": "lmscale search"``; the rest is as before (keys sorted), so what read
  the old files reads the new ones, and a file reformatted by hand or by ``jq`` (which keeps
  the order of keys) is still recognised;
* an ``.npz`` (``embed --output``): an array ``tool`` holding the same string.

A file written before the marks carries none: the first rerun over it needs --overwrite once.
Function-groups files are recognised by their header's format instead (only
``similarity-build`` writes that format: :func:`lmscale_jax.similarity.function_groups.is_file`).
"""

from __future__ import annotations

import io
import json
import re
import zipfile

from lmscale_jax.store import file_io

KEY = "tool"
_HEAD = 4096  # the mark is the first key: it ends within the first few dozen bytes
_JSON_MARK = re.compile(rb'\A\s*\{\s*"tool"\s*:\s*("(?:[^"\\]|\\.)*")')


def json_bytes(tool: str, obj: dict) -> bytes:
  """``obj`` as an indented JSON object with the mark as its first key, every other key
  sorted (nested objects too), as :func:`file_io.atomic_write_json` sorts them."""
  # A round trip sorts the nested keys; the top level is rebuilt with the mark in front.
  body = json.loads(json.dumps(obj, sort_keys=True))
  return (json.dumps({KEY: tool, **body}, indent=2) + "\n").encode()


def write_json(path: str, tool: str, obj: dict) -> None:
  file_io.atomic_write_bytes(path, json_bytes(tool, obj))


def write_npz(path: str, tool: str, arrays: dict) -> None:
  import numpy as np  # store's other modules need none: only an .npz writer

  buf = io.BytesIO()
  np.savez(buf, **{KEY: np.array(tool)}, **arrays)
  file_io.atomic_write_bytes(path, buf.getvalue())


def written_by(path: str, tool: str) -> bool:
  """Whether the file at ``path`` carries ``tool``'s mark (a JSON report or an .npz)."""
  try:
    with open(path, "rb") as f:
      head = f.read(_HEAD)
  except OSError:
    return False
  if head.startswith(b"PK"):
    return _npz_tool(path) == tool
  found = _JSON_MARK.match(head)
  try:
    return found is not None and json.loads(found.group(1)) == tool
  except ValueError:
    return False


def _npz_tool(path: str) -> str | None:
  import numpy as np

  try:
    with zipfile.ZipFile(path) as z:
      if KEY + ".npy" not in z.namelist():
        return None
      with z.open(KEY + ".npy") as f:
        return str(np.lib.format.read_array(f, allow_pickle=False))
  except (OSError, ValueError, zipfile.BadZipFile):
    return None
