"""A request's inputs as the API reads them: JSON bodies, k, addresses, texts and uploaded ELF
files, each bad one an :class:`ApiError` with the status the contract gives it (400 bad input,
404 no such function, 413 over a limit) and one line naming what was expected."""

from __future__ import annotations

import logging
import os
import re
import tempfile

from lmscale_jax.errors import UserError
from lmscale_jax.inference import callee_copy
from lmscale_jax.prep.elf import call_names
from lmscale_jax.search import index, listing, query
from lmscale_jax.serve.guard import ApiError
from lmscale_jax.serve.served import Limits
from lmscale_jax.store import user_text

log = logging.getLogger("lmscale.serve")


def json_object(body: bytes, expected: str) -> dict:
  """The JSON object of a request body. Its text passes store/user_text's check (UTF-8, no
  lone surrogate in any string, not nested past the parser): a 400 naming the field."""
  try:
    doc = user_text.parse_json(body, "request body")
  except user_text.TextError as e:
    raise ApiError(400, str(e)) from None
  except ValueError as e:
    raise ApiError(400, f"request body: not JSON ({e}); expected {expected}") from None
  if not isinstance(doc, dict):
    raise ApiError(400, f"request body: a JSON {type(doc).__name__}; expected {expected}")
  return doc


def k_of(value, default: int, limits: Limits) -> int:
  """k from JSON (an int) or a form field (its digits); 1..max_k."""
  if value is None or value == "":
    return min(default, limits.max_k)
  if isinstance(value, str) and value.strip().isdigit():
    value = int(value)
  if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limits.max_k:
    raise ApiError(400, f"k: {value!r} is out of range; expected an integer in 1..{limits.max_k}"
                   " (lmscale serve --max-k)")
  return value


def field(form, key: str) -> str | None:
  """A form's text field (absent or empty: None); a file sent in its place is a 400."""
  value = form.get(key)
  if value is not None and not isinstance(value, str):
    raise ApiError(400, f"field {key}: expected text, got a file")
  return value or None


def address_of(value: str | None) -> int | None:
  """An address field: hexadecimal with 0x (0x1139) or decimal (4409)."""
  if value is None or not value.strip():
    return None
  text = value.strip().lower()
  try:
    return int(text, 16) if text.startswith("0x") else int(text, 10)
  except ValueError:
    raise ApiError(400, f"address: {value!r}; expected hexadecimal like 0x1139 or decimal") \
        from None


def text_of(doc: dict, key: str = "text") -> str:
  text = doc.get(key)
  if not isinstance(text, str) or not text.strip():
    raise ApiError(400, f"{key}: expected a non-empty string of normalised instructions "
                   "([NEXT] between them), got " + (repr(text)[:40] if text is not None
                                                    else "none"))
  return text


def texts_of(doc: dict, limits: Limits) -> list[str]:
  texts = doc.get("texts")
  if not isinstance(texts, list) or not texts:
    raise ApiError(400, "texts: expected a non-empty list of strings")
  if len(texts) > limits.max_texts:
    raise ApiError(413, f"texts: {len(texts)} texts, over the server's limit of "
                   f"{limits.max_texts} per request (lmscale serve --max-texts); send fewer")
  for i, t in enumerate(texts):
    if not isinstance(t, str) or not t.strip():
      raise ApiError(400, f"texts[{i}]: expected a non-empty string, got {repr(t)[:40]}")
  return texts


def calls_of(doc: dict, texts: list[str]) -> list | None:
  """/api/name's optional "calls": per text, the names its function calls (what /api/search
  answers give an upload's queries), or null where unknown."""
  calls = doc.get("calls")
  if calls is None:
    return None
  if not isinstance(calls, list) or len(calls) != len(texts):
    raise ApiError(400, f"calls: expected a list of {len(texts)} (one per text) lists of "
                   "called names, or no calls")
  for i, c in enumerate(calls):
    if c is not None and not (isinstance(c, list) and all(isinstance(n, str) for n in c)):
      raise ApiError(400, f"calls[{i}]: expected a list of names or null, got {repr(c)[:40]}")
  return calls


def file_shares_of(doc: dict) -> dict | None:
  """/api/name's optional "file_shares": the texts' file's namespace as /api/search answers an
  upload ({sub-token: share of the file's functions calling it, in [0, 1]}), or null."""
  shares = doc.get("file_shares")
  if shares is None:
    return None
  if not isinstance(shares, dict):
    raise ApiError(400, "file_shares: expected an object {sub-token: share in [0, 1]} (an "
                   "/api/search answer's) or null")
  for token, share in shares.items():
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
      raise ApiError(400, f"file_shares[{token[:40]!r}]: expected a number in [0, 1], got "
                     f"{repr(share)[:40]}")
  return {t: float(v) for t, v in shares.items()}


def shown_name(filename: str | None) -> str:
  """The upload's own file name (no directories), for its file on disk and its messages."""
  name = re.sub(r"[^A-Za-z0-9._+-]", "_", os.path.basename(filename or ""))[:100]
  return name if name.strip(".") else "upload"


def elf_queries(data: bytes, filename: str | None, name: str | None, address: int | None,
                limits: Limits, calls: bool = False) -> list[tuple]:
  """(name, address, text) of the query functions of an uploaded ELF file, read from a copy in
  a private temp directory (mode 0700) deleted after; ``calls`` (a server with a naming
  model): (name, address, text, calls, shares), the names each calls that the file shows
  stripped (prep/elf/call_names) and the whole file's namespace (callee_copy.file_shares)."""
  shown = shown_name(filename)
  with tempfile.TemporaryDirectory(prefix="lmscale-serve-") as where:
    path = os.path.join(where, shown)
    with open(path, "wb") as f:
      f.write(data)
    try:
      fns = index.elf_functions_of(path)
    except UserError as e:
      raise ApiError(400, str(e).replace(path, shown)) from None
    except Exception as e:  # noqa: BLE001 — the parser on a damaged upload (fuzzed: a
      # section's type overwritten is an AttributeError in pyelftools, a symbol table past the
      # end a BufferError from the mmap): the file's fault, a 400, and a line in the log
      # (--log-level debug: its traceback) in case the fault is ours.
      reason = f"{type(e).__name__}: {str(e).replace(path, shown)}"
      log.warning("%s: extraction failed (%s)", shown, reason)
      log.debug("%s: extraction failed", shown, exc_info=True)
      raise ApiError(400, f"{shown}: unreadable ELF file ({reason})") from None
    called = names_called(path, shown) if calls else None
    # the namespace of the whole file, whichever functions are asked for (as lmscale name)
    shares = (callee_copy.file_shares([called.get(f.address, []) for f in fns])
              if calls else None)
    try:
      fns = query.pick(fns, shown, name, address)
    except UserError as e:
      raise ApiError(404, str(e)) from None
  if len(fns) > limits.max_functions:
    raise ApiError(413, f"{shown}: {len(fns)} functions, over the server's limit of "
                   f"{limits.max_functions} per search (lmscale serve --max-functions); "
                   "pick one with the field function or address")
  if called is None:
    return [(f.name, f.address, f.text) for f in fns]
  return [(f.name, f.address, f.text, called.get(f.address, []), shares) for f in fns]


def names_called(path: str, shown: str) -> dict:
  """call_names.called of an upload whose functions were read: {} where its tables of calls do
  not parse (extra evidence for naming, not a reason to refuse the file; logged)."""
  try:
    return call_names.called(path, source="auto")
  except Exception as e:  # noqa: BLE001 — a fuzzed relocation table: the file's, not ours
    log.warning("%s: its calls were not read (%s: %s)", shown, type(e).__name__,
                str(e).replace(path, shown))
    return {}


def text_queries(text: str, limits: Limits) -> list[tuple[str, int | None, str]]:
  """(name, address, text) of a pasted text: an objdump -d listing's functions re-decoded from
  their bytes, or normalised instructions as they are (search/listing.py)."""
  try:
    found = listing.queries(text)
  except UserError as e:  # no instruction in it, bytes that do not decode: the field's fault
    raise ApiError(400, f"text: {e}") from None
  if len(found) > limits.max_functions:
    raise ApiError(413, f"the pasted listing: {len(found)} functions, over the server's limit "
                   f"of {limits.max_functions} per search (lmscale serve --max-functions)")
  return found
