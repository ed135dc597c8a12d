"""The names of what each function calls, as a stripped binary still shows them: its imports
(a call or tail jump to a PLT stub, or through a GOT slot as ``-fno-plt`` code calls) and the
functions the dynamic symbol table exports (a shared library's own API). ``strip`` removes
neither: the dynamic linker needs both. Nothing here reads ``.symtab``, so a stripped file and
its unstripped copy give the same names.

A PLT stub's import is found as ``objdump`` finds it (its ``<malloc@plt>``): each entry of
``.plt``, ``.plt.sec`` and ``.plt.got`` (``sh_entsize`` bytes, 16 where unset) jumps through
one GOT slot, and the slot's dynamic relocation (R_X86_64_JUMP_SLOT or GLOB_DAT) names the
symbol. Decoded with iced-x86, data preparation's decoder.

Measured on the naming task's 400 libraries (session 30): 66% of their named functions call
at least one such name, and a name's sub-tokens hold 31% of the calling function's own name
sub-tokens (see docs/naming.md, "What a function calls"). Relocatable objects (``gcc -c``) are
not read: their calls are relocations, not stubs (no names, the same as today).
"""

from __future__ import annotations

import mmap

from lmscale_jax.errors import UserError
from lmscale_jax.prep.elf import elf_corpus

_R_X86_64_GLOB_DAT, _R_X86_64_JUMP_SLOT = 6, 7
_PLT_SECTIONS = (".plt", ".plt.sec", ".plt.got")
_STT_FUNC, _STT_GNU_IFUNC = "STT_FUNC", "STT_LOOS"  # pyelftools' name of type 10 (ifunc)


def called(path: str, source: str = "symbols", imports_only: bool = False) -> dict[int, list[str]]:
  """Function address (``elf_corpus.function_symbols``' functions of ``source``) → the names it
  calls, each once, in the order first called, never its own; ``imports_only``: only names the
  file does not define (all a stripped executable shows)."""
  from elftools.common.exceptions import ELFError
  from elftools.elf.elffile import ELFFile

  try:
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
      elf = ELFFile(fh)
      if elf["e_type"] == "ET_REL" or elf["e_machine"] != "EM_X86_64":
        return {}
      funcs = elf_corpus.function_symbols(elf_corpus.section_headers(elf, data), data, source)
      slots, own = slot_names(elf), exported(elf)
      if imports_only:  # a library calls its own exports through its PLT too
        defined = set(own.values())
        slots = {a: n for a, n in slots.items() if n not in defined}
      targets = {**stub_names(elf, slots), **({} if imports_only else own)}
      code = _code_sections(elf)
      return {a: names_called(_code(data, code, a, size), a, targets, slots)
              for a, (size, _) in funcs.items()}
  except (ELFError, ValueError, IndexError, OSError) as e:
    raise UserError(f"{path}: unreadable ELF file ({type(e).__name__}: {e})") from None


def slot_names(elf) -> dict[int, str]:
  """GOT slot address → the symbol its dynamic relocation binds (an import's name)."""
  from elftools.elf.relocation import RelocationSection

  out: dict[int, str] = {}
  for sec in elf.iter_sections():
    if not isinstance(sec, RelocationSection) or not sec["sh_link"]:
      continue
    symbols = elf.get_section(sec["sh_link"])
    if symbols.name != ".dynsym":
      continue
    for r in sec.iter_relocations():
      if r["r_info_type"] in (_R_X86_64_GLOB_DAT, _R_X86_64_JUMP_SLOT) and r["r_info_sym"]:
        name = symbols.get_symbol(r["r_info_sym"]).name
        if name:
          out[int(r["r_offset"])] = name
  return out


def stub_names(elf, slots: dict[int, str]) -> dict[int, str]:
  """PLT entry address → the import its jump through a GOT slot reaches."""
  out: dict[int, str] = {}
  for name in _PLT_SECTIONS:
    sec = elf.get_section_by_name(name)
    if sec is None or sec["sh_type"] == "SHT_NOBITS":
      continue
    start, step = int(sec["sh_addr"]), int(sec["sh_entsize"]) or 16
    for insn in _decoded(sec.data(), start):
      slot = _slot_of(insn)
      if slot in slots:
        out.setdefault(start + (insn.ip - start) // step * step, slots[slot])
  return out


def exported(elf) -> dict[int, str]:
  """Address → name of each function the dynamic symbol table defines (first name each)."""
  table = elf.get_section_by_name(".dynsym")
  out: dict[int, str] = {}
  for sym in table.iter_symbols() if table is not None else ():
    if sym["st_info"]["type"] in (_STT_FUNC, _STT_GNU_IFUNC) and sym["st_shndx"] != "SHN_UNDEF" \
        and sym.name:
      out.setdefault(int(sym["st_value"]), sym.name)
  return out


def names_called(code: bytes, address: int, targets: dict[int, str],
                 slots: dict[int, str]) -> list[str]:
  """The names one function's direct calls and jumps (to a stub or an exported function
  other than itself) and its calls and jumps through a GOT slot reach, each once."""
  own = targets.get(address)
  seen: dict[str, None] = {}
  for insn in _decoded(code, address):
    name = targets.get(insn.near_branch_target) if _is_direct(insn) else slots.get(_slot_of(insn))
    if name and name != own and not (_is_direct(insn) and insn.near_branch_target == address):
      seen.setdefault(name, None)
  return list(seen)


def _code_sections(elf) -> list[tuple[int, int, int]]:
  """(address, size, file offset) of each section of machine code."""
  return [(int(s["sh_addr"]), int(s["sh_size"]), int(s["sh_offset"])) for s in elf.iter_sections()
          if s["sh_flags"] & 0x4 and s["sh_type"] != "SHT_NOBITS"]


def _code(data, sections: list, address: int, size: int) -> bytes:
  """A function's bytes, cut at the end of its section and of the file (as its text is)."""
  for lo, length, offset in sections:
    if lo <= address < lo + length:
      start = offset + address - lo
      return bytes(data[start:min(start + size, offset + length, len(data))])
  return b""


def _decoded(code: bytes, address: int):
  from iced_x86 import Decoder

  return Decoder(64, code, ip=address)


def _is_direct(insn) -> bool:
  from iced_x86 import FlowControl

  return insn.flow_control in (FlowControl.CALL, FlowControl.UNCONDITIONAL_BRANCH) \
      and insn.near_branch_target != 0


def _slot_of(insn) -> int | None:
  """The GOT slot of ``call/jmp [rip + slot]``, else None."""
  from iced_x86 import FlowControl

  if insn.flow_control in (FlowControl.INDIRECT_CALL, FlowControl.INDIRECT_BRANCH) \
      and insn.is_ip_rel_memory_operand:
    return insn.ip_rel_memory_address
  return None
