"""Pasted assembly as a query (search/listing.py): the machine's objdump -d listing of a
gcc-built .so is re-decoded from its bytes into the text the index holds, and through
lmscale search (standard input) each pasted function finds itself."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess

import pytest

from lmscale_jax.cli import search as search_cli
from lmscale_jax.errors import UserError
from lmscale_jax.prep.elf import elf_functions
from lmscale_jax.search import listing
from tests.test_hf_tools import exported, run, run_tool  # noqa: F401 (fixtures)
from tests.test_search_index import binaries, built, model  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("objdump") is None,
                                reason="needs gcc and objdump (binutils)")


def listing_of(path: str, *flags: str) -> str:
  return subprocess.run(["objdump", "-d", *flags, path], check=True, capture_output=True,
                        text=True, timeout=60).stdout


@pytest.mark.parametrize("syntax", [[], ["-M", "intel"]], ids=["att", "intel"])
def test_an_objdump_listing_gives_each_function_the_text_the_index_holds(binaries, syntax):
  for path in binaries["O0"] + binaries["O2"]:
    pasted = {name: (address, text) for name, address, text
              in listing.queries(listing_of(path, *syntax))}
    for f in elf_functions.functions(path):
      # objdump also prints the alignment padding after the symbol's size (nop, int3 …): the
      # query leaves it out, as the index does
      assert pasted[f.name] == (f.address, f.text), (path, f.name)


LIBZ = "/usr/lib/x86_64-linux-gnu/libz.so.1"


@pytest.mark.skipif(not os.path.exists(LIBZ), reason=f"needs {LIBZ}")
def test_libz_compress_pasted_with_its_padding_is_its_indexed_text():
  """Issue 56: compress (2 instructions, then a 5-byte nop to the next function's alignment)
  pasted from objdump -d was 3 instructions, and not in the top 100 of 17,625 functions."""
  lines = listing_of(LIBZ).splitlines()
  start = next(i for i, line in enumerate(lines) if re.match(r"^[0-9a-f]+ <compress@", line))
  end = lines.index("", start)
  assert any("nop" in line for line in lines[start:end])  # the padding is in the paste
  (name, address, text), = listing.queries("\n".join(lines[start:end]))
  indexed, = elf_functions.functions(LIBZ, "compress")
  assert (address, text) == (indexed.address, indexed.text) and len(indexed.instructions) == 2


def test_only_trailing_nops_and_int3s_are_dropped():
  code = bytes.fromhex("90" "55" "c3" "cc" "66 2e 0f 1f 84 00 00 00 00 00" "0f 1f 40 00")
  assert listing.without_padding(code, 0x1000) == bytes.fromhex("90 55 c3")
  assert listing.without_padding(bytes.fromhex("90 90"), 0) == bytes.fromhex("90 90")  # all
  assert listing.without_padding(bytes.fromhex("c3 06"), 0) == bytes.fromhex("c3 06")  # invalid


def test_normalised_instructions_are_joined_with_next_whatever_the_separator():
  want = [("text", None, "push rbp [NEXT] mov rbp rsp [NEXT] ret")]
  assert listing.queries("push rbp\nmov rbp rsp\n\nret\n") == want
  assert listing.queries("push rbp [NEXT] mov rbp rsp\nret") == want
  assert not listing.is_listing("push rbp\nmov rbp rsp")


def test_a_listing_without_bytes_or_with_undecodable_bytes_is_one_line(binaries):
  with pytest.raises(UserError, match="do not decode as x86-64"):
    listing.queries("0000000000001139 <bad>:\n    1139:\t0f 0b ff ff ff ff ff ff ff ff ff\n"
                    "    1144:\t06\n")
  # --no-show-raw-insn: mnemonics only, no bytes to decode: not read as a listing
  assert not listing.is_listing(listing_of(binaries["O0"][0], "--no-show-raw-insn"))


def test_search_reads_a_listing_from_standard_input_and_each_function_finds_itself(
    run, built, binaries, tmp_path, monkeypatch, capsys):
  path = binaries["O0"][2]  # maths: gcd, power, is_prime
  monkeypatch.setattr("sys.stdin", io.StringIO(listing_of(path)))
  out = tmp_path / "answers.json"
  assert search_cli.main(["--index", built[0], "--workdir", str(run[1]), "--text", "-",
                          "--k", "1", "--json", str(out)]) == 0
  answers = {a["query"]: a for a in json.loads(out.read_text())["queries"]}
  for f in elf_functions.functions(path):
    top = answers[f.name]["results"][0]
    assert (top["function"], top["address"]) == (f.name, f.address) and top["score"] > 0.99
  assert "gcd" in capsys.readouterr().out
