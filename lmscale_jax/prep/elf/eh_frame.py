"""Function boundaries of a stripped ELF file from its ``.eh_frame``: one FDE (frame description
entry) per function, its start (``initial_location``) and size (``address_range``).

gcc and clang emit an FDE for every function on x86-64 Linux (unwind tables are on by default
for C++ exceptions and backtraces), and ``strip`` keeps the section, so it is where a stripped
binary's functions are. A small parser of the records rather than pyelftools'
``EH_CFI_entries()``: that one decodes every FDE's call-frame instructions as objects, 2.4 s for
libpython3.11's 6,102 FDEs (400 µs each; libLLVM has ~100,000); this reads the two fields per
FDE it needs (benchmarks/bench_stripped_functions.py measures both).

Pointer encodings (``DW_EH_PE_*``) are those the x86-64 toolchains write: absolute or
pc-relative, of fixed width or LEB128. A record that runs past the section, points at no CIE or
uses an encoding outside those is :class:`EhFrameError`, naming the offset: a damaged section
is refused, not read as wrong functions.
"""

from __future__ import annotations

import struct

import numpy as np

_ULEB, _SLEB = 0x01, 0x09
# DW_EH_PE format (low nibble) → (struct format, bytes); absptr is 8 bytes on ELF64.
_FIXED = {0x00: ("<Q", 8), 0x02: ("<H", 2), 0x03: ("<I", 4), 0x04: ("<Q", 8),
          0x0A: ("<h", 2), 0x0B: ("<i", 4), 0x0C: ("<q", 8)}
_PCREL, _OMIT = 0x10, 0xFF


class EhFrameError(ValueError):
  """A damaged (or foreign-format) ``.eh_frame``: the message says where and what."""


def _uleb(buf, pos: int) -> tuple[int, int]:
  value = shift = 0
  while True:
    if pos >= len(buf):
      raise EhFrameError(f"a LEB128 number runs past the section end (offset {pos:#x})")
    b = buf[pos]
    pos += 1
    value |= (b & 0x7F) << shift
    shift += 7
    if b < 0x80:
      return value, pos


def _sleb(buf, pos: int) -> tuple[int, int]:
  start = pos
  value, pos = _uleb(buf, pos)
  bits = 7 * (pos - start)
  return (value - (1 << bits) if value >> (bits - 1) & 1 else value), pos


def _read(buf, pos: int, enc: int, where: int) -> tuple[int, int]:
  """A value of format ``enc & 0x0F`` at ``pos`` (no application of pc-relative etc.)."""
  fmt = enc & 0x0F
  if fmt == _ULEB:
    return _uleb(buf, pos)
  if fmt == _SLEB:
    return _sleb(buf, pos)
  if fmt not in _FIXED:
    raise EhFrameError(f"pointer encoding {enc:#x} (at offset {where:#x}) is not one an x86-64 "
                       "toolchain writes")
  f, n = _FIXED[fmt]
  if pos + n > len(buf):
    raise EhFrameError(f"a pointer runs past the section end (offset {pos:#x})")
  return struct.unpack_from(f, buf, pos)[0], pos + n


def _cie_encoding(buf, pos: int, end: int) -> int:
  """The FDE pointer encoding ('R' augmentation; absptr without) of the CIE whose body (after
  its id) starts at ``pos``."""
  version = buf[pos]
  if version not in (1, 3):
    raise EhFrameError(f"CIE at offset {pos - 8:#x} has version {version} (expected 1 or 3)")
  nul = bytes(buf[pos + 1:end]).find(b"\0")
  if nul < 0:
    raise EhFrameError(f"CIE at offset {pos - 8:#x} has no end to its augmentation string")
  aug = bytes(buf[pos + 1:pos + 1 + nul]).decode("latin-1")
  pos += 2 + nul
  if aug and not aug.startswith("z"):
    raise EhFrameError(f"CIE at offset {pos:#x} has augmentation {aug!r} (expected 'z…')")
  _, pos = _uleb(buf, pos)                       # code alignment
  _, pos = _sleb(buf, pos)                       # data alignment
  pos = pos + 1 if version == 1 else _uleb(buf, pos)[1]  # return address register
  if not aug:
    return 0x00
  _, pos = _uleb(buf, pos)                       # augmentation data length
  enc = 0x00
  for c in aug[1:]:
    if pos >= end:
      raise EhFrameError(f"CIE augmentation data runs past its record (offset {pos:#x})")
    if c == "R":
      enc = buf[pos]
      pos += 1
    elif c == "P":                               # personality routine: encoding, pointer
      pos = _read(buf, pos + 1, buf[pos], pos)[1]
    elif c == "L":                               # LSDA encoding (its pointer is in FDEs)
      pos += 1
    elif c not in "SBG":                         # signal frame, AArch64 keys, MTE: no data
      raise EhFrameError(f"CIE at offset {pos:#x} has augmentation {aug!r} ({c!r} unknown)")
  return enc


def fde_ranges(buf, address: int) -> tuple[np.ndarray, np.ndarray]:
  """(starts, sizes) of the FDEs of an ``.eh_frame`` section's bytes ``buf`` loaded at
  ``address``, sorted by start, one per start (the first), FDEs of no length dropped.
  Raises :class:`EhFrameError` for a damaged section."""
  cies: dict[int, int] = {}
  starts, sizes = [], []
  pos, n = 0, len(buf)
  while pos + 4 <= n:
    length = struct.unpack_from("<I", buf, pos)[0]
    if length == 0:                              # the terminator
      break
    head = 4
    if length == 0xFFFFFFFF:                     # 64-bit DWARF record
      if pos + 12 > n:
        raise EhFrameError(f"record at offset {pos:#x} runs past the section end")
      length, head = struct.unpack_from("<Q", buf, pos + 4)[0], 12
    body, end = pos + head, pos + head + length
    if end > n or length < 4:
      raise EhFrameError(f"record at offset {pos:#x} (length {length}) runs past the section "
                         f"end ({n:#x})")
    cie_id = struct.unpack_from("<I", buf, body)[0]
    if cie_id == 0:
      cies[pos] = _cie_encoding(buf, body + 4, end)
    else:
      cie = body - cie_id
      if cie not in cies:
        raise EhFrameError(f"FDE at offset {pos:#x} points at no CIE (offset {cie:#x})")
      start, size = _fde_range(buf, body + 4, cies[cie], address, pos)
      if size:
        starts.append(start)
        sizes.append(size)
    pos = end
  return _unique(starts, sizes)


def _fde_range(buf, pos: int, enc: int, address: int, where: int) -> tuple[int, int]:
  if enc == _OMIT or enc & 0x70 not in (0, _PCREL) or enc & 0x80:
    raise EhFrameError(f"FDE at offset {where:#x}: pointer encoding {enc:#x} is not one an "
                       "x86-64 toolchain writes")
  start, after = _read(buf, pos, enc, where)
  if enc & 0x70 == _PCREL:
    start = (start + address + pos) & 0xFFFFFFFFFFFFFFFF
  size, _ = _read(buf, after, enc & 0x0F, where)
  if size < 0:
    raise EhFrameError(f"FDE at offset {where:#x} has a negative address range ({size})")
  return start, size


def _unique(starts: list, sizes: list) -> tuple[np.ndarray, np.ndarray]:
  starts_a = np.array(starts, np.uint64)
  sizes_a = np.array(sizes, np.uint64)
  addrs, first = np.unique(starts_a, return_index=True)
  return addrs, sizes_a[first]


# ----------------------------------------------------------------------------- in an ELF file
_SHT_NOBITS = 8
_ET_REL = 1
SOURCES = ("auto", "symbols", "eh_frame", "both")
SOURCES_HELP = ("where function boundaries come from: symbols (sized STT_FUNC of .symtab and "
                ".dynsym: the behaviour before this option), eh_frame (one function per FDE of "
                ".eh_frame: a stripped binary's functions, unnamed), both (symbols, plus the "
                ".eh_frame functions no symbol covers), auto (both where the file has no "
                ".symtab, i.e. is stripped; symbols where it has one)")


def section_names(shdrs: np.ndarray, data) -> list[bytes]:
  """The name of each section (rows of elf_corpus.section_headers); b"" where unreadable."""
  shstrndx = struct.unpack_from("<H", data, 62)[0]
  if shstrndx == 0xFFFF and len(shdrs):  # SHN_XINDEX: the index is in section 0's sh_link
    shstrndx = int(shdrs[0]["link"])
  if shstrndx >= len(shdrs):
    return [b""] * len(shdrs)
  base, size = int(shdrs[shstrndx]["offset"]), int(shdrs[shstrndx]["size"])
  strtab = bytes(data[base:base + size])
  out = []
  for at in shdrs["name"].tolist():
    end = strtab.find(b"\0", at)
    out.append(strtab[at:end] if at < len(strtab) and end >= 0 else b"")
  return out


def section_named(shdrs: np.ndarray, data, name: bytes) -> np.ndarray | None:
  """The first section header called ``name`` (a row of elf_corpus.section_headers), or None."""
  names = section_names(shdrs, data)
  return shdrs[names.index(name)] if name in names else None


def has_eh_frame(shdrs: np.ndarray, data) -> bool:
  sec = section_named(shdrs, data, b".eh_frame")
  return sec is not None and int(sec["type"]) != _SHT_NOBITS and int(sec["size"]) > 0


def file_fde_ranges(shdrs: np.ndarray, data) -> tuple[np.ndarray, np.ndarray]:
  """(starts, sizes) of the FDEs of a linked ELF file's ``.eh_frame`` (none without one, and
  none in an object file, whose FDE addresses are only filled in by the linker)."""
  empty = np.zeros(0, np.uint64), np.zeros(0, np.uint64)
  if struct.unpack_from("<H", data, 16)[0] == _ET_REL or not has_eh_frame(shdrs, data):
    return empty
  sec = section_named(shdrs, data, b".eh_frame")
  off, size = int(sec["offset"]), int(sec["size"])
  if off + size > len(data):
    raise EhFrameError(f".eh_frame ({size:,} bytes at offset {off:#x}) extends past the end "
                       f"of the file ({len(data):,} bytes)")
  # A copy, not a memoryview: one held by an exception's traceback would keep the caller's
  # mmap from closing (BufferError in place of the error line).
  return fde_ranges(data[off:off + size], int(sec["addr"]))


def add_fde_functions(table: tuple, shdrs: np.ndarray, data,
                      executable: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """``table`` (elf_corpus.function_table's symbols: addresses, sizes, section indices) with
  the FDE ranges that start in an executable section and not inside a symbol's function: the
  symbol wins where both start at one address (its name and its size). The linker's FDEs of
  .plt, .plt.got and .plt.sec are left out: stubs that jump through the GOT, no function."""
  addrs, sizes, shndx = table
  starts, lengths = file_fde_ranges(shdrs, data)
  if len(addrs) and len(starts):
    at = np.searchsorted(addrs, starts, side="right") - 1
    inside = (at >= 0) & (starts < addrs[np.maximum(at, 0)] + sizes[np.maximum(at, 0)])
    starts, lengths = starts[~inside], lengths[~inside]
  plt = np.array([n.startswith(b".plt") for n in section_names(shdrs, data)], bool)
  sec = _containing_section(shdrs, executable & ~plt, starts)
  keep = sec >= 0
  addrs = np.concatenate([addrs, starts[keep]])
  order = np.argsort(addrs, kind="stable")
  return (addrs[order], np.concatenate([sizes, lengths[keep]])[order],
          np.concatenate([shndx, sec[keep].astype(np.uint16)])[order])


def _containing_section(shdrs: np.ndarray, executable: np.ndarray,
                        starts: np.ndarray) -> np.ndarray:
  """Per start, the index of the executable section that holds it (-1: none)."""
  idx = np.flatnonzero(executable & (shdrs["addr"] > 0))
  idx = idx[np.argsort(shdrs["addr"][idx], kind="stable")]
  lo, hi = shdrs["addr"][idx], shdrs["addr"][idx] + shdrs["size"][idx]
  at = np.searchsorted(lo, starts, side="right") - 1
  ok = (at >= 0) & (starts < hi[np.maximum(at, 0)]) if len(idx) else np.zeros(len(starts), bool)
  return np.where(ok, idx[np.maximum(at, 0)] if len(idx) else -1, -1)
