"""No command replaces a file it did not write, and none writes over one of its own inputs.

Was (issue 55): `lmscale embed --elf x.so --output x.so` turned the ELF into an .npz,
`similarity-build --sources victim.c --output victim.c` replaced the C source, and `search
--json` / `eval-similarity --json` replaced whatever file they were given. Now an output that is
an input (the same file, also through a symlink or a hard link) is one `error:` line naming both
options, as parsed; an existing file that is not the command's own earlier output is replaced
only with --overwrite; a rerun over the command's own output replaces it (the rule and the marks:
lmscale_jax/cli/args.py's OutputFile, lmscale_jax/store/output_marks.py).

Real parts: shared objects compiled by the system's gcc, a real 6-step training run
(tests/test_hf_tools.py's `run`), an index built with it, a benchmark compiled from
tests/data/similarity, and the commands' own main() as `lmscale` runs it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from lmscale_jax.cli import lmscale as lmscale_cli
from lmscale_jax.search import index
from lmscale_jax.store import output_marks
from tests.helpers import ROOT
from tests.test_hf_tools import run, run_tool  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

SOURCES = os.path.join(ROOT, "tests", "data", "similarity")
VICTIM_C = """
int add(int a, int b) { return a + b; }
int checksum(const unsigned char *p, int n) {
  int s = 0;
  for (int i = 0; i < n; i++) s = (s * 31 + p[i]) & 0xffff;
  return s;
}
"""


@pytest.fixture(scope="module")
def elf(tmp_path_factory) -> str:
  """victim.so: a shared object the system's gcc compiled (the user's file at stake)."""
  base = tmp_path_factory.mktemp("elf")
  (base / "victim.c").write_text(VICTIM_C)
  so = base / "victim.so"
  subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", str(so), str(base / "victim.c")],
                 check=True, timeout=120)
  return str(so)


@pytest.fixture(scope="module")
def built_index(run, elf, tmp_path_factory) -> str:
  from lmscale_jax.inference import trained_model

  where = str(tmp_path_factory.mktemp("index") / "idx")
  index.build(trained_model.load(workdir=str(run[1])), [elf], where, say=lambda _: None)
  return where


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> str:
  out = tmp_path_factory.mktemp("bench") / "bench.jsonl"
  from lmscale_jax.cli import similarity_build

  assert similarity_build.main(["--sources", SOURCES, "--output", str(out), "--compilers", "gcc",
                                "--opt", "O0,O3", "--no-progress"]) == 0
  return str(out)


def refused(result, *named: str) -> str:
  """The command's one `error:` line (exit 1), naming each of ``named``."""
  code, out, err = result
  line = err.strip()
  assert code == 1 and line.count("\n") == 0 and line.startswith("error: "), (code, err[-3000:])
  assert all(n in line for n in named), line
  return line


def victim(tmp_path, name: str, data: bytes) -> tuple:
  path = tmp_path / name
  path.write_bytes(data)
  return path, data


def eval_args(run, bench) -> list:
  """A quick eval-similarity: 20 queries, pool 10, one pair, no random-init row."""
  return ["--bench", bench, "--workdir", run[1], "--pool", "10", "--pairs", "gcc-O0:gcc-O3",
          "--queries", "20", "--no-random-init", "--no-progress"]


# ----------------------------------------------------------------------------- an input as output
@pytest.mark.parametrize("how", ["same_path", "symlink", "hardlink"])
def test_embed_output_that_is_its_elf_input_is_refused_and_the_elf_kept(run, elf, tmp_path, how,
                                                                        capsys):
  """Was: the ELF replaced by an .npz of its own embeddings (rc 0)."""
  so, data = victim(tmp_path, "x.so", open(elf, "rb").read())
  out = {"same_path": so, "symlink": tmp_path / "link.so", "hardlink": tmp_path / "hard.so"}[how]
  if how == "symlink":
    os.symlink(so, out)
  elif how == "hardlink":
    os.link(so, out)
  line = refused(run_tool("embed", ["--workdir", run[1], "--elf", so, "--output", out], capsys),
                 "--output", "--elf", str(out))
  assert "reads or writes" in line and so.read_bytes() == data and os.path.islink(out) == (how == "symlink")


def test_similarity_build_output_that_is_a_source_is_refused_and_the_source_kept(tmp_path,
                                                                                  capsys):
  """Was: victim.c replaced by the benchmark built from it; --overwrite does not lift it."""
  src, data = victim(tmp_path, "victim.c", VICTIM_C.encode())
  for extra in ([], ["--overwrite"]):
    refused(run_tool("similarity_build", ["--sources", src, "--output", src, "--compilers", "gcc",
                                          "--opt", "O0,O3", *extra], capsys),
            "--output", "--sources")
    assert src.read_bytes() == data


def test_a_merge_into_one_of_its_inputs_is_refused(bench, tmp_path, capsys):
  copy = tmp_path / "a.jsonl"
  shutil.copy(bench, copy)
  before = copy.read_bytes()
  refused(run_tool("similarity_build", ["--merge", copy, bench, "--output", copy], capsys),
          "--output", "--merge")
  assert copy.read_bytes() == before


def test_an_append_output_that_is_an_input_is_refused(run, bench, tmp_path, capsys):
  """--results is appended to, never replaced, but appending to the benchmark corrupts it."""
  copy = tmp_path / "bench.jsonl"
  shutil.copy(bench, copy)
  before = copy.read_bytes()
  refused(run_tool("eval_similarity", [*eval_args(run, copy), "--results", copy], capsys),
          "--results", "--bench")
  assert copy.read_bytes() == before


def test_one_file_named_for_two_outputs_is_refused(run, bench, tmp_path, capsys):
  out = tmp_path / "out.json"
  refused(run_tool("eval_similarity", [*eval_args(run, bench), "--json", out, "--results", out],
                   capsys), "--json", "--results")
  assert not out.exists()


@pytest.mark.parametrize("case", ["leakage_json_train", "classify_json_labels",
                                  "sweep_output_config", "gpu_check_json_config"])
def test_every_file_output_refuses_its_inputs(bench, tmp_path, capsys, case):
  """The same rule at every command with a file output (refused as parsed: no work done)."""
  copy = tmp_path / "in.file"
  shutil.copy(bench, copy)
  before = copy.read_bytes()
  name, argv, named = {
      "leakage_json_train": ("similarity_leakage", ["--train", copy, "--bench", bench, "--json",
                                                    copy], ("--json", "--train")),
      "classify_json_labels": ("classify", ["--workdir", tmp_path, "--labels", copy, "--json",
                                            copy], ("--json", "--labels")),
      "sweep_output_config": ("sweep", ["--data", tmp_path, "--config", copy, "--output", copy],
                              ("--output", "--config")),
      "gpu_check_json_config": ("gpu_check", ["--config", copy, "--json", copy],
                                ("--json", "--config")),
  }[case]
  refused(run_tool(name, argv, capsys), *named)
  assert copy.read_bytes() == before


# ----------------------------------------------------------------------------- a file not its own
def test_search_json_does_not_replace_a_file_it_did_not_write(run, elf, built_index, tmp_path,
                                                               capsys):
  """Was: notes.json replaced by the answer. Now refused; --overwrite replaces it; the rerun
  over its own answer needs nothing."""
  notes, data = victim(tmp_path, "notes.json", b'{"mine": "keep me"}\n')
  argv = ["--index", built_index, "--workdir", run[1], "--elf", elf, "--function", "add",
          "--k", 1, "--json", notes]
  line = refused(run_tool("search", argv, capsys), "--json", str(notes), "--overwrite")
  assert "lmscale search" in line and notes.read_bytes() == data
  code, _, err = run_tool("search", [*argv, "--overwrite"], capsys)
  assert code == 0, err
  doc = json.loads(notes.read_text())
  assert next(iter(doc)) == "tool" and doc["tool"] == "lmscale search" and doc["queries"]
  code, _, err = run_tool("search", argv, capsys)  # its own earlier answer: replaced
  assert code == 0, err
  assert json.loads(notes.read_text())["queries"][0]["query"] == "add"


def test_eval_similarity_json_does_not_replace_a_file_it_did_not_write(run, bench, tmp_path,
                                                                       capsys):
  """Was: the file replaced by the scores. An old eval-similarity JSON without the mark counts
  as not its own (one --overwrite); the marked one is read by benchmarks/similarity_seeds.py."""
  old, data = victim(tmp_path, "scores.json", b'{"bench": "x", "results": []}\n')
  args = [*eval_args(run, bench), "--json", old]
  refused(run_tool("eval_similarity", args, capsys), "--json", "--overwrite")
  assert old.read_bytes() == data
  for extra in (["--overwrite"], []):
    code, _, err = run_tool("eval_similarity", [*args, *extra], capsys)
    assert code == 0, err
    assert json.loads(old.read_text())["tool"] == "lmscale eval-similarity"
  from lmscale_jax.evals import seeds

  assert seeds.load(str(old))  # its readers read the marked file


def test_embed_replaces_its_own_npz_and_no_other(run, elf, tmp_path, capsys):
  out = tmp_path / "e.npz"
  foreign = np.zeros(3)
  np.savez(out, embeddings=foreign)
  data = out.read_bytes()
  argv = ["--workdir", run[1], "--elf", elf, "--output", out]
  refused(run_tool("embed", argv, capsys), "--output", "--overwrite", "lmscale embed")
  assert out.read_bytes() == data
  for extra in (["--overwrite"], []):
    code, _, err = run_tool("embed", [*argv, *extra], capsys)
    assert code == 0, err
    with np.load(out) as e:
      assert str(e["tool"]) == "lmscale embed" and len(e["names"]) == len(e["embeddings"]) >= 2


def test_similarity_build_replaces_its_own_benchmark_and_no_other(bench, tmp_path, capsys):
  """A function-groups file is its own output by its header's format (old files too)."""
  out = tmp_path / "b.jsonl"
  shutil.copy(bench, out)
  argv = ["--merge", bench, "--output", out]
  code, _, err = run_tool("similarity_build", argv, capsys)
  assert code == 0, err
  other, data = victim(tmp_path, "other.jsonl", b'{"text": "push rbp", "label": "gcc-O0"}\n')
  refused(run_tool("similarity_build", ["--merge", bench, "--output", other], capsys),
          "--output", "--overwrite")
  assert other.read_bytes() == data


def test_import_hf_refuses_an_existing_config_as_parsed(tmp_path, capsys):
  """Its config is meant to be edited: never replaced without --overwrite, even its own."""
  config, data = victim(tmp_path, "pretrain.py", b"# my edits\n")
  refused(run_tool("import_hf", ["--hf", tmp_path, "--data", tmp_path, "--output", config],
                   capsys), "--output", "--overwrite")
  assert config.read_bytes() == data


# ----------------------------------------------------------------------------- option and marks
def test_every_command_with_a_file_output_offers_overwrite(capsys):
  """--overwrite comes with every replace-type file output (cli/args.Parser adds it)."""
  import importlib

  for name in ("embed", "search", "eval-similarity", "classify", "similarity-build",
               "similarity-leakage", "gpu-check", "import-hf"):
    with pytest.raises(SystemExit):
      importlib.import_module(lmscale_cli.MODULES[name]).main(["--help"])
    assert "--overwrite" in capsys.readouterr().out, name


def test_marks_are_found_in_the_first_bytes_whatever_the_layout(tmp_path):
  path = str(tmp_path / "r.json")
  output_marks.write_json(path, "lmscale search", {"b": {"z": 1, "a": 2}, "a": float("nan")})
  text = open(path).read()
  assert text.index('"tool"') < text.index('"a"') < text.index('"b"')  # sorted after the mark
  assert output_marks.written_by(path, "lmscale search")
  assert not output_marks.written_by(path, "lmscale classify")
  doc = json.loads(text)
  with open(path, "w") as f:  # reformatted by hand or jq: still its own
    json.dump(doc, f, indent=4)
  assert output_marks.written_by(path, "lmscale search")
  for other in (b"", b"\x7fELF\x02\x01", b'{"a": 1, "tool": "lmscale search"}', b"PK\x03\x04"):
    open(path, "wb").write(other)
    assert not output_marks.written_by(path, "lmscale search"), other
