"""Preparation decodes with iced-x86; its pretokens must mean what capstone's gave.

The reference is the decoder preparation used before (capstone's ``disasm_lite``) through the
same operand normalisation (``pretokenize.Pretokenizer``), compared per instruction address on
the real libraries of this machine. The differences left, all rare (see DIFFERENCES):
x87 ``fcomip``/``fucomip`` (capstone: ``fcompi``/``fucompi``; the Intel SDM vol. 2A names them
FCOMIP/FUCOMIP), ``comisd xmm, m64`` (capstone: ``xmmword``; SDM: COMISD xmm1, xmm2/m64 reads
64 bits), a useless ``ss`` prefix on bytes of data between functions (iced shows it, capstone
drops it), and capstone's ``riz`` (SIB index 100b, which the SDM defines as no index).
A direct branch with a ``bnd`` prefix (MPX, SDM vol. 1 ch. 17: the prefix does not change the
branch) is now a branch (``bnd jmp <fwd>``), where capstone's mnemonic ``bnd jmp`` made its
target a number; none occurs in these libraries.
"""

from __future__ import annotations

import collections
import mmap
import os

import pytest

from lmscale_jax.prep.elf import elf_corpus
from lmscale_jax.prep.elf.pretokenize import CodePretokenizer, NEXT, Pretokenizer

LIB = "/usr/lib/x86_64-linux-gnu"
LIBRARIES = ["libc.so.6", "libsqlite3.so.0", "libcrypto.so.3"]
# (capstone's first word, iced's first word) of the differences the docstring explains.
DIFFERENCES = {("fucompi", "fucomip"), ("fcompi", "fcomip"), ("comisd", "comisd"),
               ("pop", "ss"), ("xor", "ss"), ("and", "and")}


def functions(path: str):
  """(bytes, address) of every function preparation reads (elf_corpus.iter_functions' rules)."""
  from elftools.elf.elffile import ELFFile

  out = []
  with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
    shdrs = elf_corpus.section_headers(ELFFile(fh), data)
    # the exported functions this parity was measured on: libc's unnamed (.eh_frame) ones add
    # naming differences not listed here (capstone's wait / iced's fwait; xabort's operand)
    for addr, (size, shndx) in sorted(elf_corpus.function_symbols(shdrs, data,
                                                                  "symbols").items()):
      sec = shdrs[shndx]
      s_addr, s_off, s_size = int(sec["addr"]), int(sec["offset"]), int(sec["size"])
      if int(sec["flags"]) & 0x4 and s_addr <= addr < s_addr + s_size:
        off = s_off + addr - s_addr
        out.append((data[off:off + min(size, s_addr + s_size - addr)], addr))
  return out


def capstone_pretokens(code: bytes, addr: int) -> dict[int, str]:
  """address → pretokens, the way preparation made them with capstone (the reference)."""
  import capstone

  insns = list(capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64).disasm_lite(code, addr))
  if not insns:
    return {}
  text = Pretokenizer().function_text(insns, addr, addr + len(code))
  return dict(zip((i[0] for i in insns), text.split(f" {NEXT} ")))


def iced_pretokens(pre: CodePretokenizer, code: bytes, addr: int) -> dict[int, str]:
  from iced_x86 import Decoder

  text, _ = pre.function_text(code, addr)
  return dict(zip((i.ip for i in Decoder(64, code, ip=addr)), text.split(f" {NEXT} ")))


def libraries() -> list[str]:
  found = [os.path.join(LIB, n) for n in LIBRARIES if os.path.exists(os.path.join(LIB, n))]
  if len(found) < 2:
    pytest.skip(f"fewer than two of {LIBRARIES} in {LIB}")
  return found


def test_iced_pretokens_match_capstone_on_system_libraries():
  pre = CodePretokenizer()
  for path in libraries():
    same = total = 0
    kinds = collections.Counter()
    for code, addr in functions(path):
      new = iced_pretokens(pre, code, addr)
      for a, ref in capstone_pretokens(code, addr).items():
        total += 1
        if new.get(a) == ref:
          same += 1
        else:
          kinds[(ref.split()[0], (new.get(a) or "<none>").split()[0])] += 1
    assert total > 20_000, path
    assert same / total >= 0.999, (path, same, total, kinds.most_common(10))
    assert set(kinds) <= DIFFERENCES, (path, kinds.most_common(10))


def test_memoised_pretokens_equal_fresh_formatting():
  """The memo (by bytes, then by shape) never changes a text, whatever it saw before: the same
  as formatting each instruction afresh (a text that depended on the memo's history would make
  the output depend on which worker read which file)."""
  # Scrt1.o first: an object file's rip-relative calls read 0 before relocation ([rip]).
  first = [os.path.join(LIB, n) for n in ("Scrt1.o", "crt1.o")]
  fns = [f for p in [*first, *libraries()[:1], os.path.join(LIB, "ld-linux-x86-64.so.2")]
         if os.path.exists(p) for f in functions(p)]
  small = CodePretokenizer(memo_size=1 << 10)  # evicts all the time
  memo, fresh = CodePretokenizer(), CodePretokenizer(memo_size=0)
  for code, addr in fns + fns[::-7]:  # then backwards, on a warm memo
    want = fresh.function_text(code, addr)
    assert memo.function_text(code, addr) == want == small.function_text(code, addr), hex(addr)


def test_a_zero_rip_displacement_has_its_own_shape():
  """``[rip]`` has no number to normalise; ``[rip + 0x10]`` and ``[rip - 0x10]`` do (capstone
  writes the same): one shape for all three made the text depend on which came first."""
  code = bytes.fromhex("ff1510000000" "ff1500000000" "ff15f0ffffff" "ff1500000000")
  for pre in (CodePretokenizer(), CodePretokenizer(memo_size=0)):
    text, _ = pre.function_text(code, 0x1000)
    assert text.split(f" {NEXT} ") == ["call qword [ rip + <rip> ]", "call qword [ rip ]",
                                       "call qword [ rip - <rip> ]", "call qword [ rip ]"]


def test_branch_targets_depend_on_offsets_not_addresses_and_decoding_stops_at_bad_bytes():
  code = bytes.fromhex(
      "75fe"          # jne to itself, at the entry: <self>
      "7402"          # je +2: <fwd>
      "ebfa"          # jmp -6, to the entry: <self>
      "e800100000"    # call far outside: <ext>
      "f2e9f1ffffff"  # bnd jmp back to offset 2: <back> (capstone's text made it a number)
      "488b0518000000"  # mov rax, [rip + 0x18]: <rip>
      "4883ecff"      # sub rsp, -1: capstone writes the negative immediate
      "ff")           # undecodable: the text ends before it
  for start in (0x1000, 0x7FFF_0000_0000):
    text, decoded = CodePretokenizer().function_text(code, start)
    assert decoded == len(code) - 1
    assert text.split(f" {NEXT} ") == [
        "jne <self>", "je <fwd>", "jmp <self>", "call <ext>", "bnd jmp <back>",
        "mov rax qword [ rip + <rip> ]", "sub rsp - 0x1"]
