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

Preparation writes the text capstone's Intel syntax gives (:class:`Pretokenizer` normalises
those operand strings: the reference) through one of two backends, :func:`code_pretokenizer`'s
choice (``LMSCALE_PRETOKENIZER=compiled|python`` forces one):
  * ``compiled`` (:class:`CompiledPretokenizer`, the default where it is built): one call per
    function into ``_pretokens.c``, capstone's C library and this normalisation written in C;
    its text is the reference's byte for byte (tests/test_pretokens_compiled.py);
  * ``python`` (:class:`CodePretokenizer`, the fallback): iced-x86's Python binding with a memo
    per instruction; tests/test_pretokens_iced.py holds it to ≥ 99.9% of instructions identical
    to the reference on real libraries and lists where they differ, and why.
The two can differ on those rare instructions, so a dataset records which backend made it.
The same switch picks pass 3's C code (``prep/_token_ids.c``: instruction counts, token ids,
packing; ``prep/packing.token_ids_module``) or its Python reference; those two give identical
outputs.
"""

from __future__ import annotations

import itertools
import os
import re

from lmscale_jax.errors import PrepareError

from lmscale_jax.store.dataset import NEXT

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


class _Words(dict):
  """An operand word → its pretoken ("" for a dropped one): numbers normalised, once each."""

  def __missing__(self, w: str) -> str:
    if len(self) >= 1 << 16:
      self.clear()
    r = self[w] = (normalize_number(int(w, 0)) if w[0].isdigit() else "" if w == "ptr" else
                   "<rip>" if w == "\0" else w)
    return r


_WORDS = _Words()


def _operand_words(op_str: str) -> str:
  return " ".join(filter(None, map(_WORDS.__getitem__,
                                   _OPERAND_RE.findall(op_str.replace("<rip>", "\0")))))


class Pretokenizer:
  """Turns (address, size, mnemonic, operand string) tuples of one function (capstone's
  ``disasm_lite`` form) into its normalised text; :class:`CodePretokenizer` uses its operand
  normalisation.

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


# ----------------------------------------------------------------------------- iced-x86
_STOP = ()  # memo entry of an undecodable instruction: the function's text ends before it
# capstone prints these immediates unsigned (in the operand's size) even when negative.
_UNSIGNED_MNEMONICS = frozenset(["and", "or", "xor", "mov", "lock and", "lock or", "lock xor"])


def _formatter(signed: bool = False):
  """iced's Intel formatter set up to write what capstone writes (``qword ptr [rbp - 0x18]``)."""
  from iced_x86 import Formatter, FormatterSyntax, MemorySizeOptions

  f = Formatter(FormatterSyntax.INTEL)
  f.hex_prefix, f.hex_suffix, f.uppercase_hex = "0x", "", False
  f.small_hex_numbers_in_decimal = False
  f.space_after_operand_separator = True
  f.space_between_memory_add_operators = True
  f.rip_relative_addresses = True
  f.memory_size_options = MemorySizeOptions.ALWAYS
  f.show_useless_prefixes = True  # capstone keeps the cs: of the long nop
  f.signed_immediate_operands = signed
  return f


class CodePretokenizer:
  """One function's machine code → its normalised text, decoded with iced-x86.

  An instruction's pretokens are a function of its bytes alone (rip-relative displacements all
  become ``<rip>``; a direct branch keeps its target as an offset from the instruction), so
  they are memoised per instruction bytes: ~80% of the instructions of a library repeat
  exactly, and a hit costs one dict lookup instead of formatting (~7 µs). One instance per process
  (:func:`code_pretokenizer`) keeps the memo across files; it is bounded.
  """

  backend = "python"

  @property
  def decoder(self) -> str:
    """What decodes, with its version (for a dataset's record of how it was made)."""
    return _package_version("iced-x86")

  def __init__(self, memo_size: int = 1 << 18):
    """``memo_size``: entries of the bytes memo (the shapes and operand memos get half)."""
    from iced_x86 import Code, Decoder, OpKind

    # _memo: instruction bytes → entry. On a miss, _shapes (the bytes with displacement and
    # immediates zeroed, plus each constant's number class) and _branches (a direct branch's
    # bytes before its rel8/rel32): call sites and rip-relative loads are mostly unique bytes
    # of few shapes. memo_size=0: no memo at all (the tests' reference).
    self._decoder, self._memo, self._memo_size = Decoder, {}, memo_size
    self._shapes, self._branches = {}, {}
    # Unprefixed relative branches, first byte (or 0F xx) → (length, opcode bytes): call/jmp
    # rel32, jmp/jcc/loop/jrcxz rel8, jcc rel32 (Intel SDM vol. 2: E8 cd, E9 cd, EB cb, 7x cb,
    # E0–E3 cb, 0F 8x cd). Their _branches entry (by the opcode bytes) gives the text; without
    # a memo (memo_size=0, the tests' reference) every instruction is formatted.
    self._rel_branches = {} if not memo_size else {
        0xE8: (5, 1), 0xE9: (5, 1), 0xEB: (2, 1), **{b: (2, 1) for b in range(0x70, 0x80)},
        **{b: (2, 1) for b in range(0xE0, 0xE4)},
        **{bytes([0x0F, b]): (6, 2) for b in range(0x80, 0x90)}}
    self._ops = Pretokenizer(cache_size=max(1, memo_size // 2))
    self._fmt, self._signed_fmt = _formatter(), _formatter(signed=True)
    self._invalid, self._nopw, self._register = Code.INVALID, Code.NOPW, OpKind.REGISTER
    # capstone's (LLVM's) name of mov with a 64-bit immediate or a 64-bit absolute address.
    self._movabs = {getattr(Code, n) for n in ("MOV_R64_IMM64", "MOV_AL_MOFFS8", "MOV_AX_MOFFS16",
                    "MOV_EAX_MOFFS32", "MOV_RAX_MOFFS64", "MOV_MOFFS8_AL", "MOV_MOFFS16_AX",
                    "MOV_MOFFS32_EAX", "MOV_MOFFS64_RAX")}
    self._near = {OpKind.NEAR_BRANCH64, OpKind.NEAR_BRANCH32, OpKind.NEAR_BRANCH16}
    self._sign_extended = {OpKind.IMMEDIATE8TO16, OpKind.IMMEDIATE8TO32, OpKind.IMMEDIATE8TO64,
                           OpKind.IMMEDIATE32TO64}
    # x87 register forms: capstone writes only st(i) of "fadd st(0), st(i)" / "faddp st(i), st(0)"
    # and both registers of "fadd st(i), st(0)".
    self._x87 = {}
    for name in dir(Code):
      if name.startswith("F") and "_ST0_STI" in name:
        self._x87[getattr(Code, name)] = (1,)
      elif name.startswith("F") and name.endswith("_STI_ST0"):
        self._x87[getattr(Code, name)] = (0,) if name.endswith("P_STI_ST0") else (0, 1)

  def function_text(self, code: bytes, start: int) -> tuple[str, int]:
    """-> (text, bytes decoded): the instructions of ``code`` (at address ``start``) up to the
    first undecodable one. Branch targets are classified against ``[start, start+len(code))``."""
    get, parts = self._memo.get, []
    append = parts.append
    size, p = len(code), 0
    decoder = self._decoder(64, code, ip=start)
    rel, branches = self._rel_branches, self._branches
    for ins in decoder:
      n = ins.len
      key = code[p:p + n]
      e = get(key)
      if e is None:
        # A relative call/jump without prefixes: its bytes are mostly unique (the offset), its
        # text is its opcode's, by where it lands. Measured: half the memo's misses, ~3 µs each
        # through _miss; this way one int.from_bytes and one lookup, and nothing memoised.
        op = rel.get(key[:2] if key[0] == 0x0F else key[0])
        if op is not None and op[0] == n and (texts := branches.get(key[:op[1]])):
          t = p + n + int.from_bytes(key[op[1]:], "little", signed=True)
          append(texts[1] if t == 0 else texts[4] if not 0 < t < size else
                 texts[2] if t > p else texts[3])
          p += n
          continue
        e = self._miss(ins, key, decoder)
      if e.__class__ is str:
        append(e)
      elif e is _STOP:
        break
      else:  # a direct branch: (target - instruction offset, its four texts)
        t = p + e[0]
        append(e[1] if t == 0 else e[4] if not 0 < t < size else e[2] if t > p else e[3])
      p += n
    return f" {NEXT} ".join(parts), p

  def _miss(self, ins, key: bytes, decoder):
    if not self._memo_size:
      return self._entry(ins)
    if len(self._memo) >= self._memo_size:  # bounded: ~100 MB for all three at the default
      _evict_oldest(self._memo)
    if len(self._shapes) >= self._memo_size // 2:
      _evict_oldest(self._shapes)
    e = self._memo[key] = self._shaped(ins, key, decoder.get_constant_offsets(ins))
    return e

  def _shaped(self, ins, key: bytes, co):
    """The entry of a new instruction, through the memo of shapes (bytes less constants)."""
    if ins.op_count == 1 and ins.op0_kind in self._near:  # direct branch: rel8/rel32 last
      shape = key[:co.immediate_offset]  # prefixes and opcode
      e = self._branches.get(shape)
      if e is None:
        e = self._branches[shape] = self._entry(ins)
      return (self._branch_delta(ins), *e[1:]) if e else e
    if not (co.has_displacement or co.has_immediate):
      return self._entry(ins)
    if ins.is_ip_rel_memory_operand and not co.has_immediate:  # only the sign of rip's offset
      o = co.displacement_offset
      shape = (key[:o] + b"\0\0\0\0" + key[o + 4:],
               _number_class(int.from_bytes(key[o:o + 4], "little", signed=True), 4, rip=True))
    else:
      # The bytes with their constants zeroed still decode to the same form (the constants'
      # places follow from the opcode, ModRM and SIB bytes), so they and the classes are a key.
      zeroed, classes = bytearray(key), []
      rip = ins.is_ip_rel_memory_operand
      for off, size, disp in ((co.displacement_offset, co.displacement_size, True),
                              (co.immediate_offset, co.immediate_size, False),
                              (co.immediate_offset2, co.immediate_size2, False)):
        if size:
          v = int.from_bytes(key[off:off + size], "little", signed=True)
          classes.append(_number_class(v, size, rip and disp))
          zeroed[off:off + size] = bytes(size)
      shape = (bytes(zeroed), *classes)
    e = self._shapes.get(shape)
    if e is None:
      e = self._shapes[shape] = self._entry(ins)
    return e

  @staticmethod
  def _branch_delta(ins) -> int:
    delta = (ins.near_branch_target - ins.ip) & _MASK64
    return delta - ((delta >> 63) << 64)

  def _entry(self, ins):
    code = ins.code
    if code == self._invalid:
      return _STOP
    if code == self._nopw:  # 66 90: the SDM's 2-byte NOP, which iced writes "xchg ax, ax"
      return "nop"
    mn = self._fmt.format_mnemonic(ins)
    if code in self._movabs:
      mn = mn.replace("mov", "movabs")
    elif mn == "rep ret":
      mn = "repz ret"
    if ins.op_count == 1 and ins.op0_kind in self._near:
      return (self._branch_delta(ins),
              *(f"{mn} {where}" for where in ("<self>", "<fwd>", "<back>", "<ext>")))
    ops = self._operands(ins, code, mn)
    return f"{mn} {self._ops.operands(ops.replace('tbyte', 'xword'))}" if ops else mn

  def _operands(self, ins, code: int, mn: str) -> str:
    f = self._signed_fmt if self._negative_sign_extended(ins, mn) else self._fmt
    x87 = self._x87.get(code)
    if x87 is not None:
      return ", ".join(f.format_register(ins.op_register(i)) for i in x87)
    if f.operand_count(ins) == ins.op_count:
      return f.format_all_operands(ins)
    # capstone also writes the implicit operands (the al/eax of stos/lods/scas, imul's repeated
    # register) that iced leaves out.
    ops = []
    for i in range(ins.op_count):
      j = f.get_formatter_operand(ins, i)
      if j is not None and j >= 0:
        ops.append(f.format_operand(ins, j))
      elif ins.op_kind(i) == self._register:
        ops.append(f.format_register(ins.op_register(i)))
    return ", ".join(ops)

  def _negative_sign_extended(self, ins, mn: str) -> bool:
    """capstone writes a negative sign-extended immediate as ``-0x80`` except for logic/mov."""
    if mn in _UNSIGNED_MNEMONICS:
      return False
    for i in range(ins.op_count):
      if ins.op_kind(i) in self._sign_extended:
        return ins.immediate(i) >= 1 << 63
    return False


def _evict_oldest(memo: dict) -> None:
  """Drops the oldest quarter (dicts keep insertion order): unlike clearing it all, the
  instructions of the file at hand stay (a library like libLLVM has 500k distinct ones)."""
  for key in list(itertools.islice(memo, len(memo) // 4)):
    del memo[key]


def _number_class(v: int, size: int, rip: bool = False):
  """What the text of a ``size``-byte constant ``v`` can depend on: its sign, and the normalised
  form of every way a formatter prints it (negated, or as unsigned in any width ≥ its own); a
  rip-relative displacement only its sign (it is written ``<rip>``), zero apart (``[rip]``
  has no number). Two values of one class give the same pretokens in the same instruction."""
  if rip:
    return (v > 0) - (v < 0)
  if -0x100 < v < 0x100:
    return v
  return (v < 0, normalize_number(-v),
          *(normalize_number(v & ((1 << b) - 1)) for b in (8, 16, 32, 64) if b >= 8 * size))


# ----------------------------------------------------------------------------- compiled
BACKEND_ENV = "LMSCALE_PRETOKENIZER"
BACKENDS = ("compiled", "python")


class CompiledPretokenizer:
  """One function's machine code → its normalised text in one call into ``_pretokens.c``
  (capstone's C library, :class:`Pretokenizer`'s normalisation in C): the reference text byte
  for byte, with no Python per instruction. It needs no memo: capstone's own decoding and
  printing is most of its time (bench_prep's "compiled decode alone" row).

  ``function_text(code, start) -> (text, bytes decoded)``, as :class:`CodePretokenizer`'s: the
  instructions of ``code`` up to the first one capstone cannot decode.
  """

  backend = "compiled"

  def __init__(self):
    """Raises ImportError (one line: what is missing) where the extension is not built or
    capstone's library cannot be opened."""
    from lmscale_jax.prep.elf import _pretokens  # the C extension (setup.py): optional

    _pretokens.load(capstone_library())
    # The C function itself: no Python frame between the caller and the decoder.
    self.function_text = _pretokens.function_text
    self.decode_only = _pretokens.decode_only

  @property
  def decoder(self) -> str:
    """What decodes, with its version: looked up when a dataset records it (the lookup was
    12–22 ms of each pool worker's start, and workers never read it)."""
    return _package_version("capstone")


def _package_version(name: str) -> str:
  """``"capstone 5.0.9"``: the installed distribution's version (capstone.__version__ lags)."""
  from importlib import metadata

  try:
    return f"{name} {metadata.version(name)}"
  except metadata.PackageNotFoundError:
    return f"{name} (version unknown)"


def capstone_library() -> str:
  """The path of the shared library capstone's Python binding loaded: the compiled backend
  opens the same one, so it decodes exactly as the reference (disasm_lite) does."""
  import capstone

  path = getattr(getattr(capstone, "_cs", None), "_name", None)
  if not path:
    raise ImportError("capstone's Python binding does not name its library (capstone._cs._name);"
                      f" set {BACKEND_ENV}=python")
  return path


_shared: CodePretokenizer | CompiledPretokenizer | None = None


def code_pretokenizer(fresh: bool = False) -> CodePretokenizer | CompiledPretokenizer:
  """This process's pretokenizer (the python backend's memo serves every file the process
  reads); ``fresh``: a new one with an empty memo from now on (what a benchmark of a cold start
  wants). The backend: ``$LMSCALE_PRETOKENIZER`` (compiled or python), else compiled where the
  extension imports, else python; its ``backend`` attribute says which and ``decoder`` the
  decoding library and its version (``"capstone 5.0.9"``): what a dataset records."""
  global _shared
  if _shared is None or fresh:
    _shared = make_pretokenizer(os.environ.get(BACKEND_ENV, ""))
  return _shared


def make_pretokenizer(choice: str = "") -> CodePretokenizer | CompiledPretokenizer:
  """A new pretokenizer of backend ``choice`` ("" = compiled where it is built, else python)."""
  if choice not in ("", *BACKENDS):
    raise PrepareError(f"{BACKEND_ENV}={choice!r}: expected one of {', '.join(BACKENDS)} "
                       "(or unset: compiled where it is built)")
  if choice == "python":
    return CodePretokenizer()
  try:
    return CompiledPretokenizer()
  except ImportError as e:
    if choice == "compiled":
      raise PrepareError(f"{BACKEND_ENV}=compiled but the compiled pretokenizer is unavailable "
                         f"({e}); rebuild it with bash tools/setup.sh, or unset "
                         f"{BACKEND_ENV}") from e
    return CodePretokenizer()

