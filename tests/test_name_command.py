"""lmscale name: a naming fine-tune (tests/test_finetune_name.py's run) suggests names for
every function of a real stripped gcc binary (found by .eh_frame, named sub_<hex>), or one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from lmscale_jax.prep.elf import elf_functions
from lmscale_jax.similarity import function_groups
from tests.test_finetune import SOURCES, bench, pretrained, rows  # noqa: F401 (fixtures)
from tests.test_finetune_name import named, task_dir  # noqa: F401 (fixtures)
from tests.test_hf_tools import run_tool

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("strip") is None,
                                reason="needs gcc and strip")


@pytest.fixture(scope="module")
def stripped(tmp_path_factory):
  """(the stripped library, its unstripped copy)."""
  base = tmp_path_factory.mktemp("bin")
  full, bare = base / "libstrings.so", base / "libstrings.stripped.so"
  subprocess.run(["gcc", "-O2", *function_groups.BASE_FLAGS, f"-I{SOURCES}", "-o", str(full),
                  os.path.join(SOURCES, "strings.c")], check=True, timeout=120)
  subprocess.run(["strip", "-o", str(bare), str(full)], check=True, timeout=60)
  return bare, full


def test_every_function_of_a_stripped_binary_gets_suggestions(named, stripped, tmp_path,
                                                               capsys):
  out = tmp_path / "names.json"
  code, said, err = run_tool("name", ["--workdir", named, "--elf", stripped[0], "--top", 3,
                                      "--json", out], capsys)
  assert code == 0, err
  got = json.load(open(out))
  assert got["tool"] == "lmscale name" and got["step"] == 60
  found = elf_functions.functions(str(stripped[0]))
  assert [f["function"] for f in got["functions"]] == [f.name for f in found]
  # A stripped library keeps only its exported (.dynsym) names; the rest are sub_<hex>.
  exported = {f.name for f in elf_functions.functions(str(stripped[1]))}
  assert len(got["functions"]) >= 20 and all(
      f["function"] in exported or f["function"] == f"sub_{int(f['address'], 16):x}"
      for f in got["functions"])
  first = got["functions"][0]
  assert first["address"] == f"{found[0].address:#x}" and len(first["tokens"]) == 3
  assert first["tokens"][0][1] >= first["tokens"][1][1] >= first["tokens"][2][1]
  assert got["rule"] == json.load(open(named / "naming_eval.json"))["rule"]
  assert f"wrote {out}" in said
  # A rerun replaces its own output (the "tool" mark).
  assert run_tool("name", ["--workdir", named, "--elf", stripped[0], "--json", out],
                  capsys)[0] == 0


def test_one_function_by_address_or_name_as_a_table(named, stripped, capsys):
  found = elf_functions.functions(str(stripped[0]))
  code, said, err = run_tool("name", ["--workdir", named, "--elf", stripped[0], "--address",
                                      hex(found[1].address)], capsys)
  assert code == 0, err
  lines = said.splitlines()
  assert len(lines) == 2 and lines[0].split()[:3] == ["address", "function", "suggested"]
  assert lines[1].split()[1] == found[1].name
  code, said, err = run_tool("name", ["--workdir", named, "--elf", stripped[1], "--function",
                                      "str_reverse"], capsys)
  assert code == 0 and said.splitlines()[1].split()[1] == "str_reverse", err


def test_bad_requests_are_one_line(named, stripped, pretrained, tmp_path, capsys):
  code, _, err = run_tool("name", ["--workdir", named, "--elf", stripped[0], "--address",
                                   "0x1"], capsys)
  assert code == 1 and err.count("\n") == 1 and "no function starts at 0x1" in err, err
  code, _, err = run_tool("name", ["--workdir", pretrained[1], "--elf", stripped[0]], capsys)
  assert code == 1 and err.count("\n") == 1 and "is not a naming fine-tune" in err, err
  # Another vocabulary in place of the run's: refused, not mis-read.
  other = tmp_path / "run"
  shutil.copytree(named, other)
  vocab = json.load(open(other / "name_vocab.json"))
  vocab["tokens"] = vocab["tokens"][:-1]
  json.dump(vocab, open(other / "name_vocab.json", "w"))
  code, _, err = run_tool("name", ["--workdir", other, "--elf", stripped[0]], capsys)
  assert code == 1 and err.count("\n") == 1, err
  assert "name_vocab.json has" in err and "not the vocabulary this model was trained with" in err
