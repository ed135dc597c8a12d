"""Text files → documents: ``.txt`` (one per line, or blank-line separated) and ``.jsonl``."""

from __future__ import annotations

import json
import os
from typing import Iterator

from lmscale_jax.elf_corpus import FileResult, InputError, function_digest

TEXT_SUFFIXES = (".txt", ".jsonl")


def check_inputs(paths: list[str], max_input_bytes: int = 0) -> list[str]:
  out, total = [], 0
  for p in paths:
    if not os.path.isfile(p):
      raise InputError(f"input file {p!r} does not exist")
    if not p.endswith(TEXT_SUFFIXES):
      raise InputError(f"input file {p!r}: expected a .txt or .jsonl file")
    size = os.path.getsize(p)
    if max_input_bytes and total + size > max_input_bytes and out:
      break
    out.append(p)
    total += size
  return out


def _documents(path: str, txt_docs: str, text_field: str) -> Iterator[str]:
  with open(path, encoding="utf-8", errors="strict") as f:
    try:
      if path.endswith(".jsonl"):
        for lineno, line in enumerate(f, 1):
          if not line.strip():
            continue
          try:
            obj = json.loads(line)
          except json.JSONDecodeError as e:
            raise InputError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
          if not isinstance(obj, dict) or not isinstance(obj.get(text_field), str):
            raise InputError(f"{path}:{lineno}: expected an object with a string field "
                             f"{text_field!r} (--text-field)")
          yield obj[text_field]
      elif txt_docs == "line":
        for line in f:
          yield line
      else:  # paragraphs
        para = []
        for line in f:
          if line.strip():
            para.append(line)
          elif para:
            yield "".join(para)
            para = []
        if para:
          yield "".join(para)
    except UnicodeDecodeError as e:
      raise InputError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def iter_documents(path: str, res: FileResult, txt_docs: str = "line",
                   text_field: str = "text") -> Iterator[tuple[bytes, str]]:
  """Yields (digest, text) per non-empty document; whitespace runs become single spaces."""
  for doc in _documents(path, txt_docs, text_field):
    text = " ".join(doc.split())  # the corpus format is one line per document
    if not text:
      continue
    res.functions += 1
    res.code_bytes += len(text.encode())
    yield function_digest(text), text
  if not res.functions:
    res.skip = "no_documents"
