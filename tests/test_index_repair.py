"""A rerun of lmscale index repairs a damaged index (issue 55, 11): every shard index.json names
is checked against the sha256 it recorded (an older index's by reading it), each missing,
truncated or changed one is rebuilt from its binary and said so, the intact ones are kept, and
search then gives the results it gave before the damage. Real parts: tests/test_search_index.py's
binaries compiled by gcc, short training run and index built from them."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from lmscale_jax.search import index, index_files, query
from tests.test_hf_tools import run, run_tool  # noqa: F401 (fixtures)
from tests.test_search_index import binaries, built, model  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


def answers(model, where, binaries):
  """What search answers for every function of every indexed binary (its 5 nearest)."""
  corpus = query.load(str(where), model)
  return [query.search(model, corpus, query.elf_queries(p), k=5) for p in binaries["O0"]]


@pytest.fixture(scope="module")
def before(model, built, binaries):
  return answers(model, built[0], binaries)


def copy_of(built, tmp_path):
  where = tmp_path / "idx"
  shutil.copytree(built[0], where)
  return where, json.loads((where / "index.json").read_text())


def truncate(path):
  os.truncate(path, os.path.getsize(path) // 2)


def flip(path, at=-40):
  """One bit of ``path`` flipped (by default inside the last row of a .jsonl)."""
  data = bytearray(path.read_bytes())
  data[at] ^= 0x01
  path.write_bytes(bytes(data))


def another_valid_shard(path):
  np.savez(path, vectors=np.zeros((2, 3), np.float32))


DAMAGE = {"truncated npz": (".npz", truncate), "truncated jsonl": (".jsonl", truncate),
          "byte flipped in npz": (".npz", lambda p: flip(p, 400)),  # in the vectors "byte flipped in jsonl": (".jsonl", flip),
          "npz deleted": (".npz", os.unlink), "jsonl deleted": (".jsonl", os.unlink),
          "npz replaced by another": (".npz", another_valid_shard)}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_shard_is_rebuilt_by_a_rerun_and_search_answers_as_before(
    case, model, built, binaries, before, tmp_path):
  where, doc = copy_of(built, tmp_path)
  hurt, kept = doc["binaries"][1], [doc["binaries"][0], doc["binaries"][2]]
  mtimes = {b["shard"]: os.stat(where / (b["shard"] + ".npz")).st_mtime_ns for b in kept}
  ext, damage = DAMAGE[case]
  damage(where / (hurt["shard"] + ext))
  said = []
  done = index.build(model, binaries["O0"], str(where), say=said.append)
  assert done["rebuilt"] == [hurt["path"]] and done["added"] == []
  assert done["skipped"] == [p for p in binaries["O0"] if p != hurt["path"]]
  assert len(said) == 1 and said[0].startswith(f"rebuilt {hurt['shard']} from {hurt['path']}: ")
  assert hurt["shard"] + ext in said[0]
  assert json.loads((where / "index.json").read_text()) == doc  # the same bytes rebuilt
  for b in kept:  # the intact shards were not rewritten
    assert os.stat(where / (b["shard"] + ".npz")).st_mtime_ns == mtimes[b["shard"]]
  assert answers(model, where, binaries) == before


def test_a_shard_whose_binary_is_not_given_is_rebuilt_from_the_path_index_json_recorded(
    model, built, binaries, before, tmp_path):
  where, doc = copy_of(built, tmp_path)
  hurt = doc["binaries"][2]
  os.unlink(where / (hurt["shard"] + ".npz"))
  done = index.build(model, binaries["O0"][:1], str(where), say=lambda _: None)
  assert done["rebuilt"] == [hurt["path"]] and done["skipped"] == binaries["O0"][:1]
  assert answers(model, where, binaries) == before


def test_a_damaged_shard_whose_binary_is_gone_is_one_line_and_nothing_is_written(
    run, built, binaries, tmp_path, capsys):
  where, doc = copy_of(built, tmp_path)
  hurt = doc["binaries"][0]
  flip(where / (hurt["shard"] + ".jsonl"))
  record = json.loads((where / "index.json").read_text())
  record["binaries"][0]["path"] = str(tmp_path / "moved_away.so")
  (where / "index.json").write_text(json.dumps(record))
  listing = sorted(os.listdir(where / "shards"))
  code, _, err = run_tool("index", ["--workdir", run[1], "--elf", binaries["O2"][0], "--output",
                                    where], capsys)
  assert code == 1 and len(err.strip().splitlines()) == 1, err
  assert (f"{hurt['shard']}.jsonl is not the file index.json recorded" in err
          and "moved_away.so is gone: give that binary (sha256 " in err), err
  assert json.loads((where / "index.json").read_text()) == record  # nothing written
  assert sorted(os.listdir(where / "shards")) == listing


def test_an_older_index_without_digests_is_checked_by_reading_its_shards(
    model, built, binaries, before, tmp_path):
  where, doc = copy_of(built, tmp_path)
  for b in doc["binaries"]:
    for key in index_files.SHARD_FILES.values():
      del b[key]
  (where / "index.json").write_text(json.dumps(doc))
  assert index.damaged(str(where), doc) == []
  truncate(where / (doc["binaries"][1]["shard"] + ".npz"))
  assert [j for j, _ in index.damaged(str(where), doc)] == [1]
  done = index.build(model, binaries["O0"], str(where), say=lambda _: None)
  assert done["rebuilt"] == [doc["binaries"][1]["path"]]
  now = json.loads((where / "index.json").read_text())["binaries"]
  assert [set(index_files.SHARD_FILES.values()) <= set(b) for b in now] == [False, True, False]
  assert answers(model, where, binaries) == before


def test_the_command_says_what_it_rebuilt_and_search_works(run, built, binaries, tmp_path,
                                                            capsys):
  where, doc = copy_of(built, tmp_path)
  os.unlink(where / (doc["binaries"][0]["shard"] + ".jsonl"))
  code, out, err = run_tool("index", ["--workdir", run[1], "--elf", *binaries["O0"], "--output",
                                      where], capsys)
  assert code == 0, err
  assert f"rebuilt {doc['binaries'][0]['shard']} from {doc['binaries'][0]['path']}" in out
  assert "added 0 binaries (0 functions), rebuilt 1 damaged shards, 2 already indexed" in out
  code, out, err = run_tool("search", ["--index", where, "--workdir", run[1], "--text",
                                       "push rbp [NEXT] mov rbp rsp", "--k", 3], capsys)
  assert code == 0 and out.strip(), err


def test_an_intact_index_is_left_as_it_is(model, built, binaries, tmp_path):
  where, doc = copy_of(built, tmp_path)
  before_bytes = {n: (where / "shards" / n).read_bytes() for n in os.listdir(where / "shards")}
  done = index.build(model, binaries["O0"], str(where), say=lambda _: None)
  assert done["rebuilt"] == [] and done["added"] == [] and done["skipped"] == binaries["O0"]
  assert {n: (where / "shards" / n).read_bytes() for n in os.listdir(where / "shards")} == \
      before_bytes
  assert json.loads((where / "index.json").read_text()) == doc
