"""ELF files → functions → normalised pretoken text (one line per function).

Function boundaries come from ``.symtab`` and ``.dynsym`` (``STT_FUNC`` symbols with a size, first
name per address wins) and, in a stripped file, from ``.eh_frame`` (``eh_frame.py``); bytes are
read through the executable section that holds them and decoded by
``pretokenize.code_pretokenizer()`` (x86-64: capstone in C where the extension is built, else
iced-x86).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import mmap
import os
import stat
import time
from typing import Iterator

import numpy as np

from lmscale_jax.prep.elf import eh_frame

ELF_MAGIC = b"\x7fELF"
# pyelftools e_machine → the short name used in skip reasons ("machine=AArch64").
_MACHINE_NAMES = {"EM_386": "x86", "EM_AARCH64": "AArch64", "EM_ARM": "ARM", "EM_RISCV": "RISC-V",
                  "EM_PPC64": "PPC64", "EM_S390": "S390", "EM_MIPS": "MIPS"}


class InputError(ValueError):
  """An input path that cannot be used at all (as opposed to a file skipped and counted)."""


@dataclasses.dataclass
class Candidate:
  path: str
  size: int


def describe_non_regular(mode: int) -> str:
  """What a non-regular file is, in words (for errors and skip counts)."""
  for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                     (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                     (stat.S_ISSOCK, "a socket")):
    if test(mode):
      return what
  return "not a regular file"


def list_inputs(paths: list[str], max_input_bytes: int = 0,
                skipped: dict | None = None, notes: list | None = None) -> list[Candidate]:
  """Regular ELF files under ``paths`` in a deterministic (sorted) order, each real file once.

  Non-ELF files are counted in ``skipped["not_elf"]``, FIFOs/devices/sockets (named or found in
  a directory: reading /dev/zero or a pipe would never end) in ``skipped["not_regular"]`` and
  dangling links in ``skipped["broken_link"]``; ``notes`` gets one line per input named
  explicitly that was skipped, so the user is told. ``max_input_bytes`` (0 = no limit) bounds
  the ELF bytes taken (the demo's corpus): a file that would cross it is skipped
  (``skipped["over_max_input_bytes"]``) and the listing goes on with the next, so a large
  library early in the order does not end it (the demo's 24 MB stopped at 3 MB, before
  libLLVM's 110 MB). The first file too (it was taken whatever its size: --max-input-bytes 1
  took a 4 MB library); when none fits, :func:`nothing_fits` says so.
  """

  skipped = skipped if skipped is not None else {}
  notes = notes if notes is not None else []
  seen, out, total, smallest = set(), [], 0, None

  def count(reason: str) -> None:
    skipped[reason] = skipped.get(reason, 0) + 1

  def walk(p: str) -> Iterator[str]:
    if not os.path.isdir(p):
      yield p
      return
    for root, dirs, files in os.walk(p):
      dirs.sort()
      for f in sorted(files):
        yield os.path.join(root, f)

  for p in paths:
    if not os.path.lexists(p):
      raise InputError(f"input path {p!r} does not exist")
    for f in walk(p):
      real = os.path.realpath(f)
      if real in seen:
        continue
      seen.add(real)
      reason = input_skip(real)
      if reason:
        count(reason)
        if f == p and reason == "broken_link":
          notes.append(f"input {p!r} is a link to nothing: skipped (files_skipped.broken_link)")
        elif f == p and reason == "not_regular":
          notes.append(f"input {p!r} is {describe_non_regular(os.stat(real).st_mode)}, not a "
                       "regular file: skipped (files_skipped.not_regular)")
        continue
      st = os.stat(real)
      if max_input_bytes and total + st.st_size > max_input_bytes:
        count("over_max_input_bytes")
        if smallest is None or st.st_size < smallest[0]:  # the first of equals
          smallest = (st.st_size, f)
        if f == p:
          notes.append(over_limit_note(p, st.st_size, max_input_bytes))
        continue
      out.append(Candidate(real, st.st_size))
      total += st.st_size
  if not out and smallest:
    raise nothing_fits(max_input_bytes, "ELF file", *smallest)
  return out


def input_skip(path: str) -> str:
  """Why a file is skipped before its ELF header is read ("" where it is an ELF file):
  ``broken_link`` (a link to nothing), ``not_regular`` (a FIFO, device or socket: reading one
  may never end), ``unreadable``, ``not_elf``. The one rule for preparation's listing and for
  lmscale index (search/index.py), so both count a file under the same name."""
  try:
    st = os.stat(path)
  except OSError:
    return "broken_link"
  if not stat.S_ISREG(st.st_mode):
    return "not_regular"
  try:
    with open(path, "rb") as fh:
      magic = fh.read(4)
  except OSError:
    return "unreadable"
  return "" if magic == ELF_MAGIC else "not_elf"


def header_skip(elf) -> str:
  """Why an ELF file (a pyelftools ELFFile) is skipped on its header alone ("" where it is
  x86-64 ELF64): ``machine=AArch64`` (another machine) or ``abi=x32`` (x86-64 code with 32-bit
  pointers, in ELF32 tables, which section_headers does not read)."""
  machine = elf["e_machine"]
  if machine != "EM_X86_64":
    return "machine=" + _MACHINE_NAMES.get(machine, str(machine).removeprefix("EM_"))
  return "abi=x32" if elf.elfclass != 64 else ""


def over_limit_note(path: str, size: int, max_input_bytes: int) -> str:
  return (f"input {path!r} ({size:,} bytes) would pass --max-input-bytes {max_input_bytes:,}: "
          "skipped (files_skipped.over_max_input_bytes)")


def nothing_fits(max_input_bytes: int, what: str, size: int, path: str) -> InputError:
  return InputError(f"--max-input-bytes {max_input_bytes:,}: no input file fits in it (the "
                    f"smallest {what}, {path!r}, has {size:,} bytes); raise it to at least "
                    f"{size}")


@dataclasses.dataclass
class FileResult:
  path: str
  file_bytes: int
  skip: str = ""              # reason when the whole file was skipped
  functions: int = 0          # distinct sized function symbols found
  code_bytes: int = 0         # machine-code bytes disassembled
  partial: int = 0            # functions whose disassembly stopped at an undecodable byte
  error: str = ""
  # Seconds of this file's stages: "elf_parse" (headers, symbol tables), "decode_pretokenize".
  seconds: dict = dataclasses.field(default_factory=dict)


def function_digest(text: str) -> bytes:
  return hashlib.blake2b(text.encode(), digest_size=16).digest()


# Elf64_Shdr / Elf64_Sym read as numpy record arrays. pyelftools (which reads the ELF header
# here) builds a Python object per symbol (~60 µs each) and, for iter_sections(), parses whole
# hash tables up front: together two thirds of the extraction time on big libraries.
_SHDR_DTYPE = np.dtype([("name", "<u4"), ("type", "<u4"), ("flags", "<u8"), ("addr", "<u8"),
                        ("offset", "<u8"), ("size", "<u8"), ("link", "<u4"), ("info", "<u4"),
                        ("addralign", "<u8"), ("entsize", "<u8")])
_SYM_DTYPE = np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"),
                       ("value", "<u8"), ("size", "<u8")])
_SHT_PROGBITS, _SHT_SYMTAB, _SHT_DYNSYM = 1, 2, 11
_SHF_EXECINSTR = 0x4
_STT_FUNC = 2
_SHN_LORESERVE = 0xFF00


def section_headers(elf, data) -> np.ndarray:
  if elf.elfclass != 64 or not elf.little_endian:
    raise ValueError("not a little-endian ELF64 file")
  n, off = elf.num_sections(), elf.header["e_shoff"]
  if elf.header["e_shentsize"] != _SHDR_DTYPE.itemsize and n:
    raise ValueError(f"section header size {elf.header['e_shentsize']}")
  if off + n * _SHDR_DTYPE.itemsize > len(data):
    raise ValueError("section headers extend past the end of the file")
  return np.frombuffer(data, _SHDR_DTYPE, count=n, offset=off).copy()  # no view of the mmap


def function_table(shdrs: np.ndarray, data, source: str = "auto"
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(addresses, sizes, section indices), by address, of the functions of an ELF file, from
  ``source`` (eh_frame.SOURCES): the sized STT_FUNC symbols of .symtab then .dynsym, the first
  symbol of each address winning ("symbols"), the FDEs of .eh_frame ("eh_frame"), or both, the
  symbols winning ("both"; "auto": both where the file has no .symtab, i.e. is stripped).
  Raises eh_frame.EhFrameError (a ValueError) where a needed .eh_frame is damaged."""
  if source not in eh_frame.SOURCES:
    raise ValueError(f"function source {source!r}: expected one of {eh_frame.SOURCES}")
  table = _symbol_table(shdrs, data) if source != "eh_frame" else _EMPTY
  if source == "symbols" or (source == "auto" and (shdrs["type"] == _SHT_SYMTAB).any()):
    return table
  return eh_frame.add_fde_functions(table, shdrs, data, executable_sections(shdrs))


def executable_sections(shdrs: np.ndarray) -> np.ndarray:
  return (shdrs["type"] == _SHT_PROGBITS) & ((shdrs["flags"] & _SHF_EXECINSTR) != 0)


_EMPTY = np.zeros(0, np.uint64), np.zeros(0, np.uint64), np.zeros(0, np.uint16)


def _symbol_table(shdrs: np.ndarray, data) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """function_table's "symbols": all in numpy (a dict built per symbol was ~0.4 s of 1.4 s of
  symbol reading on 21 MB of code, paid again by every part of a file)."""
  tables = []
  for kind in (_SHT_SYMTAB, _SHT_DYNSYM):
    for sec in shdrs[shdrs["type"] == kind]:
      if sec["entsize"] != _SYM_DTYPE.itemsize:
        continue
      n = int(sec["size"]) // _SYM_DTYPE.itemsize
      if int(sec["offset"]) + n * _SYM_DTYPE.itemsize > len(data):
        raise ValueError("symbol table extends past the end of the file")
      syms = np.frombuffer(data, _SYM_DTYPE, count=n, offset=int(sec["offset"]))
      tables.append(syms[((syms["info"] & 0xF) == _STT_FUNC) & (syms["size"] > 0)
                         & (syms["shndx"] > 0) & (syms["shndx"] < _SHN_LORESERVE)])
  if not tables:
    return _EMPTY
  syms = np.concatenate(tables)
  addrs, first = np.unique(syms["value"], return_index=True)  # sorted; each one's first symbol
  return addrs, syms["size"][first], syms["shndx"][first]


def function_symbols(shdrs: np.ndarray, data, source: str = "auto") -> dict:
  """address → (size, section index) of the functions (:func:`function_table`)."""
  addrs, sizes, shndx = function_table(shdrs, data, source)
  return dict(zip(addrs.tolist(), zip(sizes.tolist(), shndx.tolist())))


REPEATS_SIZE = 1 << 18  # functions remembered by bytes (~40 MB)


def _remember(repeats: dict, key: bytes, value: tuple) -> None:
  if len(repeats) >= REPEATS_SIZE:  # the oldest quarter goes (dicts keep insertion order)
    for old in list(itertools.islice(repeats, len(repeats) // 4)):
      del repeats[old]
  repeats[key] = value


def _add_seconds(res: FileResult, stage: str, seconds: float) -> None:
  res.seconds[stage] = res.seconds.get(stage, 0.0) + seconds


def extract_file(path: str) -> tuple[FileResult, list]:
  """One ELF file → (result, [(digest, text)…]): convenience wrapper around iter_functions."""
  res = FileResult(path=path, file_bytes=os.path.getsize(path))
  lines = list(iter_functions(path, res))
  return res, lines


def _part(sizes: np.ndarray, part: int, parts: int) -> np.ndarray:
  """Which of the functions (by address; their sizes) are the ``part``-th of ``parts``
  contiguous address ranges of ~equal code size: a boolean mask."""
  if parts == 1:
    return np.ones(len(sizes), bool)
  sizes = sizes.astype(np.float64)
  start = np.concatenate([[0.0], np.cumsum(sizes)[:-1]]) / max(1.0, sizes.sum())
  return np.minimum((start * parts).astype(np.int64), parts - 1) == part


def iter_functions(path: str, res: FileResult, part: int = 0, parts: int = 1,
                   repeats: dict | None = None,
                   source: str = "auto") -> Iterator[tuple[bytes, str | None]]:
  """Yields (digest, text) per function of one ELF file, streaming; fills ``res`` as it goes.

  ``part``/``parts`` select a contiguous slice of the file's functions (by address) so a large
  file can be spread over several workers; the parts, concatenated in order, are the whole file.
  ``repeats`` (a dict the caller keeps across files): a function whose bytes it already holds
  is not decoded again and yields (digest, None). Its text is a function of its bytes alone
  (branch targets are classified by offset), so it is the same duplicate either way.
  ``source``: where the function boundaries come from (:func:`function_table`).

  Never raises for a bad file: ``res.skip`` says why it was skipped. A file found corrupt part
  way has its already-yielded functions kept (their bytes decoded fine).
  """
  from elftools.common.exceptions import ELFError
  from elftools.elf.elffile import ELFFile

  from lmscale_jax.prep.elf.pretokenize import code_pretokenizer

  t0, decode = time.perf_counter(), 0.0
  try:
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
      elf = ELFFile(fh)
      res.skip = header_skip(elf)
      if res.skip:
        return
      shdrs = section_headers(elf, data)
      sections = list(zip(shdrs["addr"].tolist(), shdrs["offset"].tolist(),
                          shdrs["size"].tolist(), executable_sections(shdrs).tolist()))
      addrs, sizes, shndxs = function_table(shdrs, data, source)
      function_text = code_pretokenizer().function_text
      mine = _part(sizes, part, parts)
      _add_seconds(res, "elf_parse", time.perf_counter() - t0)
      for addr, fsize, shndx in zip(addrs[mine].tolist(), sizes[mine].tolist(),
                                    shndxs[mine].tolist()):
        if shndx >= len(sections):
          continue
        s_addr, s_off, s_size, executable = sections[shndx]
        if not executable or not s_addr <= addr < s_addr + s_size:
          continue
        off = s_off + addr - s_addr
        fsize = min(fsize, s_addr + s_size - addr, len(data) - off)
        if fsize <= 0:
          continue
        t = time.perf_counter()
        code = data[off:off + fsize]
        key = hashlib.blake2b(code, digest_size=16).digest() if repeats is not None else None
        seen = repeats.get(key) if key is not None else None
        if seen is None:
          text, decoded = function_text(code, addr)
          digest = function_digest(text) if decoded else b""
          if key is not None and decoded:
            _remember(repeats, key, (digest, decoded))
        else:
          (digest, decoded), text = seen, None
        decode += time.perf_counter() - t
        if not decoded:
          continue
        res.partial += decoded < fsize
        res.functions += 1
        res.code_bytes += decoded
        yield digest, text
  except (ELFError, ValueError, IndexError, KeyError, OSError, AssertionError) as e:
    # pyelftools raises a variety of exceptions on truncated/corrupt files.
    res.skip = "corrupt"
    res.error = f"{type(e).__name__}: {e}"
    return
  finally:
    _add_seconds(res, "decode_pretokenize", decode)
  if not res.functions:
    res.skip = "no_functions"
