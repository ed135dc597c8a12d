"""x86-64 instructions → normalised pretokens (the unit the tokenizer sees).

One instruction becomes: its mnemonic (prefixes such as ``rep``/``lock`` are separate words),
then its operands split into registers, size keywords, memory brackets, operators and numbers;
``[NEXT]`` separates instructions. ``ptr`` and operand commas are dropped: they carry no
information once operands are separate words, and every token saved is sequence room.

Number normalisation — addresses and large constants would otherwise give the vocabulary one word
per value:
  * branch / call targets: ``<self>`` (the function's own entry: recursion), ``<fwd>`` / ``<back>``
    (inside the function: forward jump, backward jump = loop), ``<ext>`` (elsewhere);
  * ``rip``-relative displacements (globals, GOT, constants): ``<rip>``;
  * every other immediate or displacement: exact hex when ``v <= 0xff``; exact hex when ``v`` is
    a power of two, a power of two minus one (low-bit masks) or the 64/32-bit two's complement
    of a power of two (alignment masks such as ``0xfffffffffffffff0``); otherwise a magnitude
    bucket ``<imm16>``, ``<imm32>`` or ``<imm64>``.
All numbers are written in lowercase hex (capstone prints values below 10 in decimal).
"""

from __future__ import annotations

import re

NEXT = "[NEXT]"
_BRANCHES = frozenset(
    ["call", "jmp", "ja", "jae", "jb", "jbe", "jc", "je", "jg", "jge", "jl", "jle", "jna", "jnae",
     "jnb", "jnbe", "jnc", "jne", "jng", "jnge", "jnl", "jnle", "jno", "jnp", "jns", "jnz", "jo",
     "jp", "jpe", "jpo", "js", "jz", "jcxz", "jecxz", "jrcxz", "loop", "loope", "loopne",
     "xbegin"])
_OPERAND_RE = re.compile(r"0x[0-9a-fA-F]+|\d+|[A-Za-z_][A-Za-z0-9_.]*|[^\s,]")
_HEX_RE = re.compile(r"0x[0-9a-f]+")
_RIP_RE = re.compile(r"rip ([+-]) 0x[0-9a-f]+")
_MASK64 = (1 << 64) - 1
# Values kept verbatim even though large: powers of two, low-bit masks, alignment masks.
_SPECIAL_VALUES = frozenset(
    [1 << k for k in range(64)] + [(1 << k) - 1 for k in range(1, 65)]
    + [_MASK64 - (1 << k) + 1 for k in range(64)]
    + [((1 << 32) - 1) - (1 << k) + 1 for k in range(32)])


def normalize_number(value: int) -> str:
  value &= _MASK64
  if value <= 0xFF or value in _SPECIAL_VALUES:
    return hex(value)
  if value <= 0xFFFF:
    return "<imm16>"
  if value <= 0xFFFFFFFF:
    return "<imm32>"
  return "<imm64>"


def _operand_words(op_str: str) -> str:
  out = []
  for w in _OPERAND_RE.findall(op_str.replace("<rip>", "\0")):
    c = w[0]
    if c.isdigit():
      out.append(normalize_number(int(w, 0)))
    elif w == "ptr":
      continue
    elif w == "\0":
      out.append("<rip>")
    else:
      out.append(w)
  return " ".join(out)


class Pretokenizer:
  """Turns capstone ``disasm_lite`` tuples of one function into its normalised text.

  Operand strings repeat heavily (``eax, eax``, ``rbp``…), so their normalisation is memoised:
  this is what keeps the pipeline near capstone's own speed. The cache is bounded.
  """

  def __init__(self, cache_size: int = 1 << 18):
    self._cache: dict[str, str] = {}
    self._cache_size = cache_size

  def operands(self, op_str: str) -> str:
    if "rip" in op_str:  # normalise first so every rip-relative operand shares one cache entry
      op_str = _RIP_RE.sub(r"rip \1 <rip>", op_str)
    r = self._cache.get(op_str)
    if r is None:
      r = _operand_words(op_str)
      if len(self._cache) >= self._cache_size:
        self._cache.clear()
      self._cache[op_str] = r
    return r

  def function_text(self, insns, start: int, end: int) -> str:
    """``insns``: iterable of (address, size, mnemonic, op_str); ``[start, end)``: the function."""
    get, operands, parts = self._cache.get, self.operands, []
    append = parts.append
    for address, _, mnemonic, op_str in insns:
      if not op_str:
        append(mnemonic)
        continue
      if op_str[:2] == "0x" and mnemonic in _BRANCHES:
        target = int(op_str, 16) if _HEX_RE.fullmatch(op_str) else None
        if target is None:
          ops = operands(op_str)
        elif target == start:
          ops = "<self>"
        elif start <= target < end:
          ops = "<fwd>" if target > address else "<back>"
        else:
          ops = "<ext>"
      else:
        ops = get(op_str) or operands(op_str)  # fast path: a hit needs no rip rewrite
      append(f"{mnemonic} {ops}")
    return f" {NEXT} ".join(parts)
