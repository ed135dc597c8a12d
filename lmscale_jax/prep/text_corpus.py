"""Text files → documents: ``.txt`` (one per line, or blank-line separated) and ``.jsonl``.

Files are read as bytes, line by line with a bounded line length, and decoded per line, so a
file with no newline cannot exhaust memory and an encoding error names the line and the byte
offset in the file (not in some internal buffer).
"""

from __future__ import annotations

import json
import os
import stat
import sys
from typing import Iterator

from lmscale_jax.prep.elf.elf_corpus import FileResult
from lmscale_jax.prep.elf.elf_corpus import InputError
from lmscale_jax.prep.elf.elf_corpus import describe_non_regular
from lmscale_jax.prep.elf.elf_corpus import function_digest
from lmscale_jax.prep.elf.elf_corpus import nothing_fits
from lmscale_jax.prep.elf.elf_corpus import over_limit_note

TEXT_SUFFIXES = (".txt", ".jsonl")
# One document is one corpus line, tokenized as a whole: bound it so memory stays bounded.
MAX_DOC_BYTES = 16 << 20


def check_inputs(paths: list[str], max_input_bytes: int = 0, skipped: dict | None = None,
                 notes: list | None = None) -> list[str]:
  """The input files that fit in ``max_input_bytes`` (0: all), in order, every path checked;
  as ``elf_corpus.list_inputs``, one that would not fit is skipped, the first too, counted in
  ``skipped["over_max_input_bytes"]`` and told in ``notes`` (neither was: nothing said it)."""
  out, total, smallest = [], 0, None
  skipped = skipped if skipped is not None else {}
  notes = notes if notes is not None else []
  for p in paths:
    size = _input_size(p)
    if max_input_bytes and total + size > max_input_bytes:
      if smallest is None or size < smallest[0]:  # the first of equals
        smallest = (size, p)
      skipped["over_max_input_bytes"] = skipped.get("over_max_input_bytes", 0) + 1
      notes.append(over_limit_note(p, size, max_input_bytes))
      continue
    out.append(p)
    total += size
  if not out and smallest:
    raise nothing_fits(max_input_bytes, "file", *smallest)
  return out


def _input_size(p: str) -> int:
  """The size of a regular .txt / .jsonl file, or one InputError saying what it is instead."""
  try:
    st = os.stat(p)
  except FileNotFoundError:
    raise InputError(f"input file {p!r} does not exist") from None
  except OSError as e:
    raise InputError(f"input file {p!r}: cannot be read ({e.strerror})") from None
  if not stat.S_ISREG(st.st_mode):
    raise InputError(f"input {p!r} is {describe_non_regular(st.st_mode)}: expected a regular "
                     ".txt or .jsonl file")
  if not p.endswith(TEXT_SUFFIXES):
    raise InputError(f"input file {p!r}: expected a .txt or .jsonl file")
  return st.st_size


def _lines(path: str) -> Iterator[tuple[int, int, str]]:
  """(line number, byte offset of the line in the file, decoded line), each line bounded."""
  offset = 0
  with open(path, "rb") as f:
    for lineno in range(1, 1 << 62):
      raw = f.readline(MAX_DOC_BYTES + 1)
      if not raw:
        return
      if len(raw) > MAX_DOC_BYTES:
        raise InputError(f"{path}:{lineno}: line longer than {MAX_DOC_BYTES >> 20} MiB (from "
                         f"byte {offset}); a document is one line (.txt --txt-docs line, "
                         ".jsonl) or a paragraph (--txt-docs blank): split the file into lines")
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise InputError(f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte "
                         f"{offset + e.start} of the file)") from None
      yield lineno, offset, line
      offset += len(raw)


def _json_line(path: str, lineno: int, line: str):
  """One .jsonl line's value; whatever json cannot parse is one InputError naming the line."""
  try:
    return json.loads(line)
  except json.JSONDecodeError as e:
    raise InputError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
  except RecursionError:  # valid JSON, but nested deeper than Python's parser goes (~1,000)
    raise InputError(f"{path}:{lineno}: JSON nested too deeply to read (over "
                     f"{sys.getrecursionlimit():,} levels); flatten or drop the line") from None


def _documents(path: str, txt_docs: str, text_field: str) -> Iterator[tuple[int, str]]:
  """(line number where it starts, text) of each document."""
  if path.endswith(".jsonl"):
    for lineno, _, line in _lines(path):
      if not line.strip():
        continue
      obj = _json_line(path, lineno, line)
      if not isinstance(obj, dict) or not isinstance(obj.get(text_field), str):
        raise InputError(f"{path}:{lineno}: expected an object with a string field "
                         f"{text_field!r} (--text-field)")
      yield lineno, obj[text_field]
  elif txt_docs == "line":
    for lineno, _, line in _lines(path):
      yield lineno, line
  else:  # paragraphs
    para, size, first = [], 0, 0
    for lineno, offset, line in _lines(path):
      if line.strip():
        if not para:
          first = lineno
        para.append(line)
        size += len(line)
        if size > MAX_DOC_BYTES:
          raise InputError(f"{path}:{first}: paragraph longer than {MAX_DOC_BYTES >> 20} MiB "
                           f"(lines {first}..{lineno}); separate documents by blank lines or "
                           "use --txt-docs line")
      elif para:
        yield first, "".join(para)
        para, size = [], 0
    if para:
      yield first, "".join(para)


def iter_documents(path: str, res: FileResult, txt_docs: str = "line",
                   text_field: str = "text") -> Iterator[tuple[bytes, str]]:
  """Yields (digest, text) per non-empty document; whitespace runs become single spaces."""
  for lineno, doc in _documents(path, txt_docs, text_field):
    text = " ".join(doc.split())  # the corpus format is one line per document
    if not text:
      continue
    try:
      raw = text.encode()
    except UnicodeEncodeError as e:  # only JSON makes one: "\ud800" is a valid escape
      raise InputError(f"{path}:{lineno}: the text holds a lone surrogate "
                       f"({text[e.start].encode('unicode_escape').decode()}, half of a "
                       "UTF-16 pair: no character); fix or drop the line") from None
    res.functions += 1
    res.code_bytes += len(raw)
    yield function_digest(text), text
  if not res.functions:
    res.skip = "no_documents"
