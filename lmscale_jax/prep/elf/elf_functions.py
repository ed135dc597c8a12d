"""Named functions of one ELF file as pretoken text: the input of lmscale fill-mask and
lmscale embed (which need each function's name; preparation, elf_corpus.iter_functions,
keeps only the text and a digest).

The same functions (elf_corpus.function_symbols: sized STT_FUNC, first name per address,
.symtab then .dynsym; in a stripped file also one per .eh_frame FDE, named ``sub_<hex
address>`` as disassemblers name them), the same bytes (cut at the end of their section and of the file) and
the same text (pretokenize.code_pretokenizer) as preparation, so a function reads exactly as the
model saw such functions in training.
"""

from __future__ import annotations

import dataclasses
import mmap

from lmscale_jax.errors import UserError
from lmscale_jax.prep.elf import eh_frame, elf_corpus
from lmscale_jax.prep.elf.pretokenize import NEXT, code_pretokenizer

_SHF_EXECINSTR = 0x4  # ELF section flag: holds machine code


@dataclasses.dataclass
class Function:
  name: str
  file: str
  address: int
  text: str

  @property
  def instructions(self) -> list[str]:
    return self.text.split(f" {NEXT} ")


def _symbol_names(elf) -> dict[int, str]:
  names: dict[int, str] = {}
  for section in (".symtab", ".dynsym"):
    table = elf.get_section_by_name(section)
    for sym in table.iter_symbols() if table is not None else ():
      if sym["st_info"]["type"] == "STT_FUNC" and sym["st_size"] > 0 and sym.name:
        names.setdefault(int(sym["st_value"]), sym.name)
  return names


def functions(path: str, only: str | None = None, source: str = "auto") -> list[Function]:
  """Every function of ``path`` (address order), or the one called ``only`` (a symbol name or
  ``sub_<hex address>``); ``source``: where boundaries come from (elf_corpus.function_table)."""
  from elftools.common.exceptions import ELFError
  from elftools.elf.elffile import ELFFile

  try:
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
      if data[:4] != elf_corpus.ELF_MAGIC:
        raise UserError(f"{path}: not an ELF file")
      elf = ELFFile(fh)
      if elf["e_machine"] != "EM_X86_64":
        raise UserError(f"{path}: machine {elf['e_machine']}; the model reads x86-64 code")
      shdrs = elf_corpus.section_headers(elf, data)
      funcs = _table(path, shdrs, data, source)
      names = {a: n for a, n in _symbol_names(elf).items() if a in funcs}
      names.update((a, f"sub_{a:x}") for a in funcs if a not in names)
      wanted = sorted(funcs) if only is None else [a for a in sorted(funcs)
                                                   if names[a] == only]
      if only is not None and not wanted:
        some = ", ".join(sorted(set(names.values()))[:5])
        raise UserError(f"{path} has no function named {only!r} ({len(funcs)} functions, "
                        f"e.g. {some}; names as `nm` prints them, sub_<hex address> where the "
                        "file has no symbol)")
      out = []
      for addr in wanted:
        text = _text(shdrs, data, addr, *funcs[addr])
        if text:
          out.append(Function(names[addr], path, addr, text))
      return out
  except FileNotFoundError:
    raise UserError(f"{path}: no such file") from None
  except (ELFError, ValueError, IndexError, OSError) as e:
    raise UserError(f"{path}: unreadable ELF file ({type(e).__name__}: {e})") from None


class NoFunctionsFound(UserError):
  """A stripped file with no .eh_frame: its functions cannot be found (lmscale index counts it
  as preparation does, under no_functions)."""


def _table(path: str, shdrs, data, source: str) -> dict:
  """elf_corpus.function_symbols, with the two ways a stripped file cannot be read as one line
  each: a damaged .eh_frame, and none at all (removed, or never written). One that is there
  but holds no FDE of a function (gcc -fno-asynchronous-unwind-tables on a library) gives no
  functions, which each tool reports as it does a file of data alone (index: no_functions)."""
  try:
    funcs = elf_corpus.function_symbols(shdrs, data, source)
  except eh_frame.EhFrameError as e:
    raise UserError(f"{path}: damaged .eh_frame ({e}); its functions cannot be found from it "
                    "(give an undamaged copy, or the unstripped file)") from None
  if not funcs and source != "symbols" and not eh_frame.has_eh_frame(shdrs, data) \
      and elf_corpus.executable_sections(shdrs).any() \
      and not (shdrs["type"] == elf_corpus._SHT_SYMTAB).any():  # data alone (gcc -c): not this
    raise NoFunctionsFound(f"{path}: stripped (no function symbols) and no .eh_frame section "
                           "to find its functions by (removed, or linked without one); give the "
                           "unstripped file")
  return funcs


def _text(shdrs, data, addr: int, size: int, shndx: int) -> str:
  if shndx >= len(shdrs):
    return ""
  sec = shdrs[shndx]
  s_addr, s_off, s_size = int(sec["addr"]), int(sec["offset"]), int(sec["size"])
  if not int(sec["flags"]) & _SHF_EXECINSTR or not s_addr <= addr < s_addr + s_size:
    return ""
  off = s_off + addr - s_addr
  size = min(size, s_addr + s_size - addr, len(data) - off)
  return code_pretokenizer().function_text(data[off:off + size], addr)[0] if size > 0 else ""
