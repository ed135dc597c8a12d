"""What a search answer says beyond its scores (issue 56, items 3 and 4), on real parts: a
gcc-built library whose functions include identical twins (the same normalised text, so the
same vector and score), indexed and searched by the real commands with a real short MLM run
(tests/test_hf_tools.py) and a real contrastive fine-tune (tests/test_finetune.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess

import pytest

from lmscale_jax.inference import trained_model
from lmscale_jax.prep.elf import elf_functions
from lmscale_jax.search import index, index_files
from tests.test_finetune import bench, pretrained, tuned  # noqa: F401 (fixtures)
from tests.test_hf_tools import run, run_tool  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

# twin_a and twin_b compile to the same instructions; other does not.
SOURCE = """
int twin_a(int x) { return x * 7 + 3; }
int twin_b(int x) { return x * 7 + 3; }
int other(const char *s) { int n = 0; while (s[n]) n++; return n; }
"""


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
  base = tmp_path_factory.mktemp("twins")
  (base / "twins.c").write_text(SOURCE)
  so = base / "libtwins.so"
  subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", str(so), str(base / "twins.c")],
                 check=True, timeout=120)
  texts = {f.name: f.text for f in elf_functions.functions(str(so))}
  assert texts["twin_a"] == texts["twin_b"] != texts["other"]  # what the tests rest on
  return str(so)


@pytest.fixture(scope="module")
def built(run, twins, tmp_path_factory):
  where = tmp_path_factory.mktemp("idx") / "idx"
  index.build(trained_model.load(workdir=str(run[1])), [twins], str(where), say=lambda _: None)
  return where


def search(index_dir, model_args, out, capsys, *query):
  code, text, err = run_tool("search", ["--index", index_dir, *model_args, *query, "--k", 3,
                                        "--json", out], capsys)
  assert code == 0, err
  return json.loads(out.read_text()), text, err


def test_a_functions_identical_twin_is_marked_in_the_json_and_the_rows(run, twins, built,
                                                                      tmp_path, capsys):
  doc, text, _ = search(built, ["--workdir", run[1]], tmp_path / "r.json", capsys, "--elf",
                        twins, "--function", "twin_b")
  results = doc["queries"][0]["results"]
  assert {r["function"] for r in results[:2]} == {"twin_a", "twin_b"}  # tied: either first
  assert results[0]["score"] == pytest.approx(results[1]["score"], abs=1e-6)
  assert [(r["same_text_as"], r["same_text_as_query"]) for r in results] == [
      (None, True), (1, True), (None, False)]
  rows = [line for line in text.splitlines() if line.startswith("twin_b")]
  assert [row.split()[3:5] for row in rows[:2]] == [["=", "query"], ["=", "query"]], text
  assert "= " not in rows[2] and "same" in text.splitlines()[0]
  doc, text, _ = search(built, ["--workdir", run[1]], tmp_path / "o.json", capsys, "--elf",
                        twins, "--function", "other")
  results = doc["queries"][0]["results"]
  assert [(r["same_text_as"], r["same_text_as_query"]) for r in results] == [
      (None, True), (None, False), (2, False)]  # the twins, below: the second is the first's
  assert " = #2 " in text.splitlines()[-1]


def without_text_digests(index_dir, where):
  """A copy of the index as one written before rows kept their text's digest (its shard
  digests in index.json made to match, as that index's own would)."""
  shutil.copytree(index_dir, where)
  doc = json.loads((where / "index.json").read_text())
  for b in doc["binaries"]:
    path = where / (b["shard"] + ".jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(index_files.TEXT_DIGEST in r for r in rows)  # a new index has them
    path.write_text("".join(json.dumps({k: v for k, v in r.items()
                                        if k != index_files.TEXT_DIGEST}, sort_keys=True) + "\n"
                            for r in rows))
    b["jsonl_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
  (where / "index.json").write_text(json.dumps(doc))
  return where


def test_an_older_index_without_text_digests_loads_and_marks_nothing(run, twins, built,
                                                                    tmp_path, capsys):
  old = without_text_digests(built, tmp_path / "old")
  doc, text, _ = search(old, ["--workdir", run[1]], tmp_path / "r.json", capsys, "--elf", twins,
                        "--function", "twin_a")
  assert [(r["same_text_as"], r["same_text_as_query"]) for r in doc["queries"][0]["results"]] \
      == [(None, None)] * 3  # unknown, not "different"
  assert "= " not in "\n".join(text.splitlines()[1:])
  code, out, err = run_tool("index", ["--workdir", run[1], "--elf", twins, "--output", old],
                            capsys)
  assert code == 0 and "1 already indexed" in out and "rebuilt" not in out, err  # not damage


def test_an_mlm_encoder_warns_once_where_its_scores_are_read(run, twins, built, tmp_path,
                                                             capsys):
  doc, _, err = search(built, ["--workdir", run[1]], tmp_path / "r.json", capsys, "--text",
                       "push rbp [NEXT] mov rbp rsp")
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"warning: {run[1]} is not fine-tuned for "
                                                 "similarity")
  assert "lmscale finetune" in lines[0] and "docs/similarity.md" in lines[0]
  assert doc["warning"] == lines[0].removeprefix("warning: ")
  assert [r["same_text_as_query"] for r in doc["queries"][0]["results"]] == [False] * 3
  code, _, err = run_tool("index", ["--workdir", run[1], "--elf", twins, "--output",
                                    tmp_path / "i"], capsys)
  assert code == 0 and err.strip() == lines[0]


def test_a_contrastive_fine_tune_gives_no_warning(tuned, twins, tmp_path, capsys):
  where = tmp_path / "idx"
  code, _, err = run_tool("index", ["--workdir", tuned, "--elf", twins, "--output", where],
                          capsys)
  assert code == 0 and err == "", err
  doc, _, err = search(where, ["--workdir", tuned], tmp_path / "r.json", capsys, "--elf", twins,
                       "--function", "twin_a")
  assert err == "" and doc["warning"] is None
  assert [r["same_text_as_query"] for r in doc["queries"][0]["results"]][:2] == [True, True]
  assert os.path.exists(where / "index.json")
