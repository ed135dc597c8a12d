"""Assembly a user pastes, as queries: an ``objdump -d`` listing (AT&T or ``-M intel``: only its
address and hex-byte columns are read) is re-decoded from those bytes by preparation's own
normaliser (``prep/elf/pretokenize``), one query per function header, so a pasted function is
the text the index holds for it; anything else is taken as the model's normalised instructions
(one a line, or ``[NEXT]`` between them).

objdump also prints the alignment padding between a function's end (its symbol's size) and the
next function: nop and int3 instructions the index does not hold. Those trailing ones are
dropped (:func:`without_padding`): kept, `compress` of libz (2 instructions, then a 5-byte nop)
was a 3-instruction query and ranked below the top 100 of 8,125 functions, where its own text
scores 1.0. A function whose symbol itself ends in a nop (3 of 99,963 functions in 400 system
libraries: crypt, crypt_gensalt, RC4_options) loses it too, and finds itself near the top, not
at 1.0.

Why the bytes and not the mnemonics: objdump's syntax (``%rbp``, ``<gcd+0x1c>``, suffixes)
differs from preparation's normalisation in many small ways; the bytes are the same function.
"""

from __future__ import annotations

import re

from lmscale_jax.errors import UserError

# "  401126:\t55                   \tpush   %rbp": address, then 1..15 two-digit hex bytes.
_BYTES_LINE = re.compile(r"^\s*([0-9a-f]+):\t((?:[0-9a-f]{2} )*[0-9a-f]{2})\s*(?:\t.*)?$")
_HEADER = re.compile(r"^([0-9a-f]+) <([^>]+)>:\s*$")


def is_listing(text: str) -> bool:
  """True where most non-empty lines are objdump byte lines or function headers."""
  lines = [line for line in text.splitlines() if line.strip()]
  hits = sum(bool(_BYTES_LINE.match(line) or _HEADER.match(line)) for line in lines)
  return bool(lines) and hits >= max(1, len(lines) // 2)


def _functions(text: str) -> list[tuple[str, int, bytearray]]:
  """(name, start address, bytes) per function of a listing; lines before any header form
  one function named after its first address."""
  out: list[tuple[str, int, bytearray]] = []
  for line in text.splitlines():
    header, row = _HEADER.match(line), _BYTES_LINE.match(line)
    if header:
      out.append((header.group(2), int(header.group(1), 16), bytearray()))
    elif row:
      address = int(row.group(1), 16)
      if not out or not _continues(out[-1], address):
        out.append((f"sub_{address:x}", address, bytearray()))
      out[-1][2].extend(bytes.fromhex(row.group(2)))
  return [f for f in out if f[2]]


def _continues(function, address: int) -> bool:
  """Whether a byte line at ``address`` continues ``function`` (objdump wraps long
  instructions onto a second line at the next address)."""
  _, start, code = function
  return not code or address == start + len(code)


def queries(text: str) -> list[tuple[str, int | None, str]]:
  """(name, address, normalised text) per query of a pasted text."""
  if not is_listing(text):
    parts = [p.strip() for p in re.split(r"\[NEXT\]|\n", text) if p.strip()]
    if not parts:  # embedded, it would be no token at all: a query no function is like
      raise UserError("the query text holds no instruction (it is empty, blank or only [NEXT] "
                      f"separators: {text[:40]!r}); expected normalised instructions, [NEXT] "
                      "between them or one a line, or an objdump -d listing")
    return [("text", None, " [NEXT] ".join(parts))]
  from lmscale_jax.prep.elf.pretokenize import code_pretokenizer

  out = []
  for name, start, code in _functions(text):
    code = without_padding(bytes(code), start)
    normalised, decoded = code_pretokenizer().function_text(code, start)
    if decoded < len(code):
      raise UserError(f"the pasted listing of {name} @ {start:#x}: bytes at offset {decoded} "
                      "do not decode as x86-64 (give objdump -d output of x86-64 code)")
    out.append((name, start, normalised))
  if not out:
    raise UserError("the pasted listing holds no instruction bytes (objdump -d output expected)")
  return out


def without_padding(code: bytes, start: int) -> bytes:
  """``code`` less its trailing nop and int3 instructions (every nop form: 90, 66 90, 0f 1f …,
  with cs/data16 prefixes), the padding a compiler puts after a function, outside its symbol's
  size; a function of padding alone, or bytes that do not decode, are left as they are (the
  normaliser says what is wrong with those). Decoded to find where each instruction ends: a
  byte pattern read from the end could start inside one."""
  from iced_x86 import Code, Decoder, Mnemonic

  end = 0  # where the last instruction that is not padding ends
  for ins in Decoder(64, code, ip=start):
    if ins.code == Code.INVALID:
      return code
    if ins.mnemonic not in (Mnemonic.NOP, Mnemonic.INT3):
      end = ins.next_ip - start
  return code[:end] if end else code
