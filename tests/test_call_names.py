"""What each function calls, by name, as a stripped binary shows it (issue 58: the naming
task's strongest clue): a real shared library compiled by this machine's gcc (with and without
-fno-plt), stripped by the real ``strip``, and this machine's libz read against objdump's own
``<name@plt>`` annotations."""

from __future__ import annotations

import bisect
import re
import shutil
import subprocess

import pytest

from lmscale_jax.prep.elf import call_names, elf_functions

pytestmark = pytest.mark.skipif(not (shutil.which("gcc") and shutil.which("strip")),
                                reason="needs gcc and strip")

SOURCE = r"""
#include <stdlib.h>
#include <string.h>
int api_helper(int n) { return n * 3 + 1; }
__attribute__((noinline)) static void quiet_release(void *p) { if (p) free(p); }
char *api_open(const char *name) {
  size_t n = strlen(name);
  char *copy = malloc(n + api_helper((int)n));
  if (copy) memcpy(copy, name, n + 1);
  quiet_release(NULL);
  return copy;
}
long api_count(long n) { return n <= 0 ? 0 : 1 + api_count(n - 1); }
"""


def library(tmp, *flags: str) -> str:
  src = tmp / "lib.c"
  src.write_text(SOURCE)
  out = tmp / f"libcalls{''.join(flags)}.so"
  subprocess.run(["gcc", "-O1", "-shared", "-fPIC", *flags, "-o", str(out), str(src)],  # last -O wins
                 check=True, timeout=120)
  return str(out)


def by_name(path: str, **kw) -> dict[str, list[str]]:
  names = {f.address: f.name for f in elf_functions.functions(path)}
  return {names[a]: calls for a, calls in call_names.called(path, source="auto", **kw).items()
          if a in names}


@pytest.mark.parametrize("flags", [(), ("-fno-plt",)], ids=["plt", "no-plt"])
def test_a_function_calls_its_imports_and_its_librarys_exports_by_name(tmp_path, flags):
  calls = by_name(library(tmp_path, *flags))
  assert {"strlen", "malloc", "memcpy", "api_helper"} <= set(calls["api_open"])
  assert calls["quiet_release"] == ["free"]
  assert calls["api_helper"] == []


def test_a_recursive_function_is_never_its_own_callee(tmp_path):
  calls = by_name(library(tmp_path, "-O0"))  # gcc names it api_count.localalias in .symtab
  assert [calls[n] for n in calls if n.startswith("api_count")] == [[]]


def test_imports_only_leaves_out_what_the_file_defines(tmp_path):
  calls = by_name(library(tmp_path), imports_only=True)
  assert "api_helper" not in calls["api_open"]
  assert {"strlen", "malloc", "memcpy"} <= set(calls["api_open"])


def test_a_stripped_copy_calls_the_same_names(tmp_path):
  path = library(tmp_path)
  out = path + ".stripped"
  subprocess.run(["strip", "-o", out, path], check=True, timeout=60)
  whole, bare = call_names.called(path, source="auto"), call_names.called(out, source="auto")
  assert bare and all(bare[a] == whole[a] for a in bare)
  assert ["free"] in bare.values()  # the internal function, found by .eh_frame as sub_<address>


def objdump_plt_names(path: str, ranges: dict[int, tuple]) -> dict[int, set[str]]:
  starts = sorted(ranges)
  call = re.compile(r"^\s*([0-9a-f]+):\s+(?:call|jmp)\s+[0-9a-f]+ <([^>+]+)@plt>")
  text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", path], capture_output=True,
                        text=True, check=True, timeout=120).stdout
  out: dict[int, set[str]] = {}
  for m in filter(None, map(call.match, text.splitlines())):
    at = int(m.group(1), 16)
    i = bisect.bisect_right(starts, at) - 1
    if i >= 0 and at < starts[i] + ranges[starts[i]][0]:
      out.setdefault(starts[i], set()).add(m.group(2))
  return out


@pytest.mark.skipif(not shutil.which("objdump"), reason="needs objdump")
def test_libz_plt_calls_are_the_ones_objdump_names(tmp_path):
  import glob
  import mmap

  from elftools.elf.elffile import ELFFile

  from lmscale_jax.prep.elf import elf_corpus

  found = sorted(glob.glob("/usr/lib/x86_64-linux-gnu/libz.so.1.*"))
  if not found:
    pytest.skip("no libz on this machine")
  with open(found[0], "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
    ranges = elf_corpus.function_symbols(elf_corpus.section_headers(ELFFile(fh), data), data,
                                         "symbols")
  theirs = objdump_plt_names(found[0], ranges)
  ours = call_names.called(found[0])
  assert sum(map(len, theirs.values())) > 20
  assert all(names <= set(ours[a]) for a, names in theirs.items())
