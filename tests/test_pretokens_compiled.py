"""The compiled pretokenizer (prep/elf/_pretokens.c) writes the reference text byte for byte.

The reference is capstone's ``disasm_lite`` through ``pretokenize.Pretokenizer`` (what
preparation wrote before it decoded with iced-x86); the compiled backend decodes with the same
capstone library in C and normalises in C. Compared per function on the real libraries of this
machine; against the iced-x86 backend per instruction (their differences are the ones
tests/test_pretokens_iced.py lists). Then the choice of backend and its fallback.
"""

from __future__ import annotations

import functools
import os
import sys

import pytest

from lmscale_jax.errors import PrepareError
from lmscale_jax.prep.elf import pretokenize
from lmscale_jax.prep.elf.pretokenize import NEXT, CodePretokenizer, CompiledPretokenizer
from tests.test_pretokens_iced import LIB, LIBRARIES, functions, iced_pretokens


def compiled() -> CompiledPretokenizer:
  """The compiled backend; a test fails (never skips) where it is not built: CI has a compiler,
  so a missing extension is a broken build."""
  try:
    return CompiledPretokenizer()
  except ImportError as e:
    pytest.fail(f"the compiled pretokenizer is not built ({e}): run bash tools/setup.sh")


def library(name: str) -> str:
  path = os.path.join(LIB, name)
  if not os.path.exists(path):
    pytest.skip(f"{path} is not on this machine")
  return path


@functools.lru_cache(maxsize=None)
def reference(name: str) -> list[tuple[bytes, int, str, int]]:
  """(code, address, reference text, bytes capstone decoded) per function of a library."""
  import capstone

  md, out = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64), []
  for code, addr in functions(library(name)):
    insns = list(md.disasm_lite(code, addr))
    text = pretokenize.Pretokenizer().function_text(insns, addr, addr + len(code))
    out.append((code, addr, text, sum(i[1] for i in insns)))
  return out


@pytest.mark.parametrize("name", LIBRARIES)
def test_compiled_text_and_bytes_decoded_equal_the_capstone_reference(name):
  pre, differ = compiled(), []
  for code, addr, text, decoded in reference(name):
    if pre.function_text(code, addr) != (text, decoded):
      differ.append(hex(addr))
  assert len(reference(name)) > 1000, name
  assert not differ, (name, len(differ), differ[:5])


@pytest.mark.parametrize("name", LIBRARIES)
def test_compiled_and_iced_agree_on_99_99_percent_of_instructions(name):
  """Per instruction address; what differs is only what test_pretokens_iced explains (where
  iced is right). A function iced stops in earlier or later than capstone counts its missing
  instructions as different."""
  from tests.test_pretokens_iced import DIFFERENCES

  pre, iced = compiled(), CodePretokenizer()
  same = total = 0
  kinds = {}
  for code, addr, _, _ in reference(name):
    new = iced_pretokens(iced, code, addr)
    for a, ref in capstone_pretokens_of(pre, code, addr).items():
      total += 1
      if new.get(a) == ref:
        same += 1
      else:
        k = (ref.split()[0], (new.get(a) or "<none>").split()[0])
        kinds[k] = kinds.get(k, 0) + 1
  assert total > 20_000, name
  assert same / total >= 0.9999, (name, same, total, kinds)
  assert set(kinds) <= DIFFERENCES, (name, kinds)


def capstone_pretokens_of(pre: CompiledPretokenizer, code: bytes, addr: int) -> dict[int, str]:
  """address → the compiled backend's pretokens (addresses from capstone: the same decoder)."""
  import capstone

  text, _ = pre.function_text(code, addr)
  insns = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64).disasm_lite(code, addr)
  return dict(zip((i[0] for i in insns), text.split(f" {NEXT} ") if text else []))


@pytest.mark.parametrize("name", LIBRARIES)
def test_code_that_ends_undecodable_stops_where_the_reference_and_iced_stop(name):
  """No function of these libraries holds undecodable bytes, so they are made: each function
  cut at two thirds (mostly inside an instruction) and one with a byte invalid in 64-bit mode
  (06, push es) after its first half of instructions. The compiled text and bytes decoded
  equal the reference's, and the bytes decoded equal iced's."""
  import capstone

  md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
  pre, iced, differ, cut = compiled(), CodePretokenizer(), [], 0
  for code, addr, _, _ in reference(name)[::3]:
    sizes = [i[1] for i in md.disasm_lite(code, addr)]
    half = sum(sizes[:len(sizes) // 2])
    for bad in (code[:len(code) * 2 // 3], code[:half] + b"\x06" + code[half:]):
      insns = list(md.disasm_lite(bad, addr))
      want = (pretokenize.Pretokenizer().function_text(insns, addr, addr + len(bad)),
              sum(i[1] for i in insns))
      got = pre.function_text(bad, addr)
      assert got == want, (name, hex(addr))
      cut += got[1] < len(bad)
      if got[1] != iced.function_text(bad, addr)[1]:
        differ.append(hex(addr))
  assert cut > 500, name
  assert len(differ) <= cut // 1000, (name, cut, differ[:5])


def test_the_texts_of_branches_numbers_and_rip_operands():
  code = bytes.fromhex(
      "75fe"            # jne to itself, at the entry: <self>
      "7402"            # je +2: <fwd>
      "ebfa"            # jmp -6, to the entry: <self>
      "e800100000"      # call far outside: <ext>
      "488b0518000000"  # mov rax, [rip + 0x18]: <rip>
      "488b0508000000"  # mov rax, [rip + 8]: capstone writes 8 in decimal, a number
      "ff1500000000"    # call [rip]: no number
      "4883ecff"        # sub rsp, -1: capstone writes the negative immediate
      "48b8f0ffffffffffffff"  # movabs rax, 0xfffffffffffffff0: an alignment mask, kept
      "b834120000"      # mov eax, 0x1234: <imm16>
      "ff")             # undecodable: the text ends before it
  for start in (0x1000, 0x7FFF_0000_0000):
    text, decoded = compiled().function_text(code, start)
    assert decoded == len(code) - 1
    assert text.split(f" {NEXT} ") == [
        "jne <self>", "je <fwd>", "jmp <self>", "call <ext>", "mov rax qword [ rip + <rip> ]",
        "mov rax qword [ rip + 0x8 ]", "call qword [ rip ]", "sub rsp - 0x1",
        "movabs rax 0xfffffffffffffff0", "mov eax <imm16>"]


def test_nothing_decodable_is_empty_text_and_zero_bytes():
  pre = compiled()
  assert pre.function_text(b"", 0x1000) == ("", 0)
  assert pre.function_text(b"\xff\xff", 0x1000) == ("", 0)


def test_code_pretokenizer_is_compiled_where_built_and_python_when_forced(monkeypatch):
  compiled()
  monkeypatch.setattr(pretokenize, "_shared", None)
  monkeypatch.delenv(pretokenize.BACKEND_ENV, raising=False)
  pre = pretokenize.code_pretokenizer(fresh=True)
  assert (pre.backend, pre.decoder.split()[0]) == ("compiled", "capstone")
  monkeypatch.setenv(pretokenize.BACKEND_ENV, "python")
  pre = pretokenize.code_pretokenizer(fresh=True)
  assert isinstance(pre, CodePretokenizer) and pre.backend == "python"
  assert pre.decoder.startswith("iced-x86 ")


def test_without_the_extension_the_default_falls_back_to_python_and_forcing_it_is_one_error(
    monkeypatch):
  import lmscale_jax.prep.elf

  monkeypatch.setitem(sys.modules, "lmscale_jax.prep.elf._pretokens", None)  # import fails
  monkeypatch.delattr(lmscale_jax.prep.elf, "_pretokens", raising=False)  # as if never imported
  assert isinstance(pretokenize.make_pretokenizer(""), CodePretokenizer)
  with pytest.raises(PrepareError) as e:
    pretokenize.make_pretokenizer("compiled")
  assert "\n" not in str(e.value) and "tools/setup.sh" in str(e.value)
  with pytest.raises(PrepareError, match="LMSCALE_PRETOKENIZER='iced'"):
    pretokenize.make_pretokenizer("iced")
