"""Functions of stripped binaries (issue 58, item 1): real programs and libraries compiled by this
machine's gcc and clang, stripped by the real ``strip``, read through .eh_frame; symbol names
where the file keeps them; a damaged .eh_frame and a stripped file without one refused in one
line; ``prepare binary --functions`` reaching the old behaviour."""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from lmscale_jax.errors import PrepareError, UserError
from lmscale_jax.prep import options as prep_options
from lmscale_jax.prep import prepare
from lmscale_jax.prep.elf import eh_frame, elf_corpus, elf_functions

pytestmark = pytest.mark.skipif(not (shutil.which("gcc") and shutil.which("clang")
                                     and shutil.which("strip")),
                                reason="needs gcc, clang and strip (apt-get install clang; "
                                       "tools/test.sh installs it where it runs as root)")

SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
static int cmp(const void *a, const void *b) { return *(const int *)a - *(const int *)b; }
static long fib(int n) { return n < 2 ? n : fib(n - 1) + fib(n - 2); }
__attribute__((noinline)) static void reverse(char *s) {
  for (size_t i = 0, j = strlen(s); i + 1 < j; ++i, --j) { char t = s[i]; s[i] = s[j - 1]; s[j - 1] = t; }
}
int exported_sum(const int *v, int n) { int s = 0; for (int i = 0; i < n; ++i) s += v[i]; return s; }
int main(int argc, char **argv) {
  int v[16]; for (int i = 0; i < 16; ++i) v[i] = rand() % 100;
  qsort(v, 16, sizeof v[0], cmp);
  char buf[64]; snprintf(buf, sizeof buf, "%s", argc > 1 ? argv[1] : "stripped");
  reverse(buf);
  printf("%s %ld %d\n", buf, fib(argc + 20), exported_sum(v, 16));
  return 0;
}
"""


def build(tmp, cc: str, level: str, *flags: str, shared: bool = False) -> str:
  src = tmp / "prog.c"
  src.write_text(SOURCE)
  out = tmp / f"prog-{cc}{level}{'-so' if shared else ''}{''.join(flags)}"
  extra = ["-shared", "-fPIC"] if shared else []
  subprocess.run([cc, level, *extra, *flags, "-o", str(out), str(src)], check=True, timeout=120)
  return str(out)


def stripped(path: str) -> str:
  out = path + ".stripped"
  subprocess.run(["strip", "-o", out, path], check=True, timeout=60)
  return out


def table(path: str, source: str) -> dict[int, int]:
  from elftools.elf.elffile import ELFFile

  with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
    shdrs = elf_corpus.section_headers(ELFFile(fh), data)
    return {a: s for a, (s, _) in elf_corpus.function_symbols(shdrs, data, source).items()}


@pytest.mark.parametrize("cc", ["gcc", "clang"])
@pytest.mark.parametrize("level", ["-O0", "-O1", "-O2", "-O3"])
def test_every_symbol_table_function_is_found_in_the_stripped_copy(tmp_path, cc, level):
  full = build(tmp_path, cc, level)
  truth = table(full, "symbols")  # the unstripped program's .symtab (and .dynsym)
  found = table(stripped(full), "auto")
  assert table(stripped(full), "symbols") == {}  # what every tool refused before
  assert found == truth  # each start and each size (crt's functions included), nothing else


def test_a_stripped_functions_text_is_its_unstripped_text_named_by_address(tmp_path):
  full = build(tmp_path, "gcc", "-O2")
  named = {f.address: f for f in elf_functions.functions(full)}
  bare = elf_functions.functions(stripped(full))
  assert {f.address for f in bare} == set(named)
  for f in bare:
    assert f.name == f"sub_{f.address:x}" and f.text == named[f.address].text
  one = elf_functions.functions(stripped(full), only=bare[0].name)  # fill-mask --function
  assert [f.address for f in one] == [bare[0].address]
  with pytest.raises(UserError, match="sub_<hex address>"):
    elf_functions.functions(stripped(full), only="sub_1")


def test_a_stripped_library_keeps_its_exported_names_and_gains_its_static_functions(tmp_path):
  lib = stripped(build(tmp_path, "clang", "-O1", shared=True))  # strip keeps .dynsym
  fns = {f.name: f for f in elf_functions.functions(lib)}
  assert "exported_sum" in fns and "main" in fns  # the symbol's name wins at its start
  assert sum(n.startswith("sub_") for n in fns) >= 3  # cmp, fib, reverse (and crt's)
  assert len(table(lib, "symbols")) == 2 < len(fns)  # the old reading: exported ones only


def test_the_parser_agrees_with_pyelftools_on_every_fde(tmp_path):
  from elftools.dwarf.callframe import FDE
  from elftools.elf.elffile import ELFFile

  for path in (build(tmp_path, "gcc", "-O2", shared=True), build(tmp_path, "clang", "-O0")):
    with open(path, "rb") as fh:
      elf = ELFFile(fh)
      want = sorted((e.header["initial_location"], e.header["address_range"])
                    for e in elf.get_dwarf_info().EH_CFI_entries() if isinstance(e, FDE))
      sec = elf.get_section_by_name(".eh_frame")
      starts, sizes = eh_frame.fde_ranges(sec.data(), sec["sh_addr"])
    assert list(zip(starts.tolist(), sizes.tolist())) == want


def damaged(path: str, at: int, value: bytes) -> str:
  """A copy of ``path`` with ``value`` written ``at`` bytes into its .eh_frame."""
  from elftools.elf.elffile import ELFFile

  with open(path, "rb") as fh:
    offset = ELFFile(fh).get_section_by_name(".eh_frame")["sh_offset"]
  data = bytearray(open(path, "rb").read())
  data[offset + at:offset + at + len(value)] = value
  out = path + ".damaged"
  with open(out, "wb") as f:
    f.write(bytes(data))
  return out


@pytest.mark.parametrize("at,value,what", [
    (0, b"\xf0\xff\xff\x7f", "runs past the section end"),   # the first record's length
    (8, b"\x07", "version 7"),                                  # the CIE's version
    (0x1C, b"\x00\x01\x00\x00", "points at no CIE"),           # the first FDE's CIE pointer
])
def test_a_damaged_eh_frame_is_one_line_naming_the_file(tmp_path, at, value, what):
  bad = damaged(stripped(build(tmp_path, "gcc", "-O2")), at, value)
  with pytest.raises(UserError) as e:
    elf_functions.functions(bad)
  line = str(e.value)
  assert "\n" not in line and line.startswith(f"{bad}: damaged .eh_frame (") and what in line
  res = elf_corpus.FileResult(path=bad, file_bytes=os.path.getsize(bad))
  assert list(elf_corpus.iter_functions(bad, res)) == []  # prepare: counted, not read wrong
  assert res.skip == "corrupt" and "EhFrameError" in res.error
  res = elf_corpus.FileResult(path=bad, file_bytes=os.path.getsize(bad))
  assert list(elf_corpus.iter_functions(bad, res, source="symbols")) == [] \
      and res.skip == "no_functions"  # the old setting never reads the section


def test_a_stripped_file_with_no_eh_frame_is_one_line(tmp_path):
  full = build(tmp_path, "gcc", "-O2", "-fno-asynchronous-unwind-tables")
  bare = full + ".bare"
  subprocess.run(["objcopy", "--strip-all", "--remove-section", ".eh_frame",
                  "--remove-section", ".eh_frame_hdr", full, bare], check=True, timeout=60)
  with pytest.raises(UserError) as e:
    elf_functions.functions(bare)
  assert str(e.value) == (f"{bare}: stripped (no function symbols) and no .eh_frame section "
                          "to find its functions by (removed, or linked without one); give "
                          "the unstripped file")
  # built without unwind tables, then stripped: its .eh_frame holds crt's _start alone
  only = elf_functions.functions(stripped(full))
  assert len(only) == 1 and only[0].address == elf_entry(full)


def elf_entry(path: str) -> int:
  with open(path, "rb") as f:
    return int.from_bytes(f.read(32)[24:32], "little")


def test_prepare_option_checks_and_keeps_old_runs_resumable():
  base = dict(kind="binary", inputs=["x"], output="o")
  with pytest.raises(PrepareError, match="--functions 'dwarf'"):
    prep_options.check_options(prep_options.PrepareOptions(**base, functions="dwarf"))
  old = prep_options.PrepareOptions(**base, functions="symbols").output_params()
  assert "functions" not in old  # the params of every run before the option
  assert prep_options.PrepareOptions(**base).output_params()["functions"] == "auto"


def test_prepare_binary_reads_more_of_stripped_libraries_and_symbols_as_before(tmp_path):
  """This machine's distribution libraries (.dynsym only): the default reads their unnamed
  functions too; --functions symbols reads what every run before the option read, the same
  bytes for any worker count (test_prepare checks the default's)."""
  from tests.test_prepare import _same_output, opts, small_elves

  libs = small_elves(3)
  stats = {how: prepare.prepare(opts(tmp_path / how, libs, workers=1, functions=how))
           for how in ("symbols", "auto")}
  assert stats["auto"]["functions_kept"] > 2 * stats["symbols"]["functions_kept"], stats
  prepare.prepare(opts(tmp_path / "symbols-2", libs, workers=2, functions="symbols"))
  _same_output(tmp_path / "symbols", tmp_path / "symbols-2")
  r = subprocess.run([sys.executable, "-m", "lmscale_jax.cli.prepare", "binary", "--help"],
                     capture_output=True, text=True, timeout=120)
  assert "--functions {auto,symbols,eh_frame,both}" in r.stdout


def test_every_function_range_lies_in_code_and_plt_stubs_are_left_out(tmp_path):
  path = stripped(build(tmp_path, "clang", "-O2"))
  from elftools.elf.elffile import ELFFile

  with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
    shdrs = elf_corpus.section_headers(ELFFile(fh), data)
    addrs, sizes, shndx = elf_corpus.function_table(shdrs, data, "eh_frame")
    names = eh_frame.section_names(shdrs, data)
  assert len(addrs) and np.all(np.diff(addrs.astype(np.int64)) > 0)
  assert {names[i] for i in shndx.tolist()} == {b".text"}
