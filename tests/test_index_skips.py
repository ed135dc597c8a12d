"""lmscale index over files preparation skips (issue 56, item 2): real ELF files compiled by the
machine's gcc (one with named functions, one with only data, one whose functions are hidden and
stripped), a text file, a link to nothing, another machine's header; and the README's own
`--elf /usr/lib/x86_64-linux-gnu/*.so.*` on a few of this machine's real libraries. Skipped and
counted per reason under preparation's names, or, --strict, refused in one line."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess

import pytest

from lmscale_jax.prep.elf import elf_corpus, elf_functions
from lmscale_jax.search import index, index_array
from tests.test_hf_tools import run, run_tool  # noqa: F401 (fixtures)
from tests.test_search_index import model  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
LIBS = "/usr/lib/x86_64-linux-gnu"


def gcc(out, source, *flags):
  subprocess.run(["gcc", *flags, "-o", str(out), str(source)], check=True, timeout=120)
  return str(out)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  """{kind: path}: a library with named functions, and one file per reason to skip."""
  base = tmp_path_factory.mktemp("skips")
  (base / "code.c").write_text("int add(int a, int b) { return a + b; }\n"
                               "int mul(int a, int b) { return a * b; }\n")
  (base / "data.c").write_text("int table[4] = {1, 2, 3, 4};\n")
  out = {"good": gcc(base / "code.so", base / "code.c", "-O1", "-shared", "-fPIC"),
         "data_only": gcc(base / "data.so", base / "data.c", "-nostdlib", "-shared"),
         # hidden, then stripped, with no unwind tables: no symbol and no .eh_frame FDE
         # names or bounds a function
         "stripped": gcc(base / "hidden.so", base / "code.c", "-O1", "-shared", "-fPIC",
                         "-fvisibility=hidden", "-fno-asynchronous-unwind-tables",
                         "-fno-unwind-tables")}
  subprocess.run(["strip", out["stripped"]], check=True)
  (base / "notes.txt").write_text("not a binary\n")
  out["text"] = str(base / "notes.txt")
  os.symlink(base / "nowhere.so", base / "dangling.so")
  out["dangling"] = str(base / "dangling.so")
  data = bytearray(open(out["good"], "rb").read())
  data[18:20] = (183).to_bytes(2, "little")  # e_machine = EM_AARCH64
  (base / "arm.so").write_bytes(bytes(data))
  out["arm"] = str(base / "arm.so")
  return out


def prepare_reason(path: str) -> str:
  """The name preparation's own code (list_inputs, then iter_functions) counts ``path`` under."""
  skipped: dict = {}
  if not elf_corpus.list_inputs([path], skipped=skipped):
    return next(iter(skipped))
  return elf_corpus.extract_file(path)[0].skip


def test_index_skips_and_counts_each_file_under_preparations_reason(model, files, tmp_path):
  said = []
  order = ["good", "data_only", "text", "stripped", "dangling", "arm"]
  done = index.build(model, [files[k] for k in order], str(tmp_path / "idx"), say=said.append)
  assert done["added"] == [files["good"]] and done["functions"] == 2
  expected = {files[k]: prepare_reason(files[k]) for k in order[1:]}
  assert expected == {files["data_only"]: "no_functions", files["text"]: "not_elf",
                      files["stripped"]: "no_functions", files["dangling"]: "broken_link",
                      files["arm"]: "machine=AArch64"}
  assert done["skipped_files"] == expected
  assert done["files_skipped"] == {"broken_link": 1, "machine=AArch64": 1, "no_functions": 2,
                                   "not_elf": 1}
  for path, reason in expected.items():  # a line each, naming the file and the reason
    assert sum(line.startswith(f"skipped {path}: ") and line.endswith(
        f"(files_skipped.{reason})") for line in said) == 1, said
  doc = json.loads((tmp_path / "idx" / "index.json").read_text())
  assert [b["path"] for b in doc["binaries"]] == [files["good"]]


def test_the_command_prints_the_counts_at_the_end_and_strict_refuses(run, files, tmp_path,
                                                                      capsys):
  out = tmp_path / "idx"
  argv = ["--workdir", run[1], "--elf", files["good"], files["data_only"], files["text"],
          "--output", out]
  code, text, err = run_tool("index", argv, capsys)
  assert code == 0, err
  assert text.strip().splitlines()[-1] == (
      f"{out}: added 1 binaries (2 functions), 0 already indexed, 2 files skipped "
      "(no_functions 1, not_elf 1; --strict refuses them)")
  strict = tmp_path / "strict"
  code, _, err = run_tool("index", [*argv[:-1], strict, "--strict"], capsys)
  assert code == 1 and err.strip() == f"error: {files['text']}: not an ELF file (the index " \
      "takes x86-64 ELF binaries)"
  assert not strict.exists()  # refused before anything was written


def test_an_array_skips_as_one_node_does_and_finish_counts_once(model, files, tmp_path):
  paths = [files[k] for k in ("good", "data_only", "text", "stripped")]
  one = index.build(model, paths, str(tmp_path / "one"), say=lambda _: None)
  where = str(tmp_path / "two")
  parts = [index_array.run_task(model, paths, where, i, 2, say=lambda _: None) for i in (0, 1)]
  assert sum(len(p["binaries"]) for p in parts) == 1
  done = index_array.finish(where)
  assert done["files_skipped"] == one["files_skipped"] == {"no_functions": 2, "not_elf": 1}
  assert open(os.path.join(where, "index.json")).read() == \
      open(tmp_path / "one" / "index.json").read()


def real_libraries(count: int = 3) -> tuple[list[str], str] | None:
  """The first ``count`` small libraries of the README's glob with named functions, and the
  first of the glob with none (None where this machine has no such file)."""
  named, empty = [], None
  for path in sorted(glob.glob(f"{LIBS}/*.so.*")):
    if os.path.getsize(path) > 400_000 or elf_corpus.input_skip(path):
      continue
    try:
      fns = elf_functions.functions(path)
    except Exception:  # noqa: BLE001 (what the scan cannot read is no candidate)
      continue
    if not fns and empty is None:
      empty = path
    elif fns and len(named) < count:
      named.append(path)
    if empty and len(named) == count:
      return named, empty
  return None


def test_the_readme_glob_over_real_libraries_goes_past_one_with_no_functions(run, tmp_path,
                                                                            capsys):
  """Debian 12: libGLESv1_CM.so.1 (no function symbols) stopped the whole command; with
  stripped files read by .eh_frame, libnss_files.so.2 and others still have no function."""
  found = real_libraries()
  if found is None:
    pytest.skip(f"no library without named functions among {LIBS}/*.so.*")
  named, empty = found
  out = tmp_path / "idx"
  argv = ["--workdir", run[1], "--elf", named[0], empty, *named[1:], "--output", out]
  code, text, err = run_tool("index", argv, capsys)
  assert code == 0, err
  assert f"skipped {empty}: no named x86-64 functions" in text
  assert "1 files skipped (no_functions 1; --strict refuses them)" in text
  doc = json.loads((out / "index.json").read_text())
  assert [b["path"] for b in doc["binaries"]] == [os.path.abspath(p) for p in named]
  code, _, err = run_tool("index", [*argv[:-1], tmp_path / "strict", "--strict"], capsys)
  assert code == 1 and len(err.strip().splitlines()) == 1
  assert f"{empty}: no named x86-64 functions" in err and "(1 binaries before it are in" in err
