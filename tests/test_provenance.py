"""The compiler-provenance task (lmscale provenance-build) and its TF-IDF + logistic-regression
baseline (benchmarks/provenance_baseline.py), end to end on a real function-groups file: the
four C files of tests/data/similarity, each its own library, "strings" vendoring a copy of
numeric.c besides (as zstd vendors xxhash), compiled by the machine's gcc at -O0..-O3.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from lmscale_jax.evals import classification
from lmscale_jax.prep.elf import elf_corpus
from lmscale_jax.similarity import function_groups, provenance
from lmscale_jax.store import file_io
from tests.helpers import ROOT, lmscale

SOURCES = os.path.join(ROOT, "tests", "data", "similarity")
LIBRARIES = ("codecs", "containers", "numeric", "strings")
BASELINE = os.path.join(ROOT, "benchmarks", "provenance_baseline.py")
pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


def tool(name, *args, timeout=120):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cmd = [sys.executable, BASELINE] if name == "baseline" else lmscale(name)
  return subprocess.run([*cmd, *map(str, args)], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def read_jsonl(path) -> list[dict]:
  return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
  work = tmp_path_factory.mktemp("provenance")
  roots = []
  for lib in LIBRARIES:
    os.makedirs(work / "src" / lib)
    shutil.copy(os.path.join(SOURCES, f"{lib}.c"), work / "src" / lib / f"{lib}.c")
    roots.append(work / "src" / lib)
  shutil.copy(os.path.join(SOURCES, "numeric.c"), work / "src" / "strings" / "numeric_copy.c")
  out = work / "bench.jsonl"
  r = tool("similarity_build", "--sources", *roots, "--output", out,
           "--compilers", "gcc", "--opt", "O0,O1,O2,O3")
  assert r.returncode == 0, r.stderr
  return out


@pytest.fixture(scope="module")
def task(bench, tmp_path_factory):
  out = tmp_path_factory.mktemp("task") / "task"
  r = tool("provenance_build", "--bench", bench, "--output", out)
  assert r.returncode == 0, r.stderr
  assert r.stdout.startswith(f"{out}: ") and "test examples" in r.stdout
  return out


def test_the_split_shares_no_library_and_no_function_text(task):
  train, test = read_jsonl(task / "train.jsonl"), read_jsonl(task / "test.jsonl")
  assert train and test
  assert not {r["library"] for r in train} & {r["library"] for r in test}
  digests = [{elf_corpus.function_digest(r["text"]) for r in rows} for rows in (train, test)]
  assert not digests[0] & digests[1]
  meta = json.load(open(task / "task.json"))
  assert sorted(meta["split"]["train_libraries"] + meta["split"]["test_libraries"]) == \
      sorted(LIBRARIES)


def test_a_vendored_copy_is_dropped_from_training_or_kept_once_and_counted(bench):
  """Over seeds, strings (with its copy of numeric.c) lands on the other side of numeric (the
  training side's copy dropped as texts of the test split) or on the same side (dropped as
  repeats): every example is kept or counted, and no text is ever on both sides."""
  total = sum(len(g["variants"]) for g in function_groups.load(str(bench))[1])
  sides = set()
  for seed in range(8):
    splits, meta = provenance.build([str(bench)], seed=seed)
    test_libs = set(meta["split"]["test_libraries"])
    sides.add(("numeric" in test_libs) == ("strings" in test_libs))
    kept = sum(len(rows) for rows in splits.values())
    assert kept + sum(meta["dropped"].values()) == total
    assert not {r["digest"] for r in splits["train"]} & {r["digest"] for r in splits["test"]}
    assert sum(meta["dropped"].values()) > 0
  assert sides == {True, False}  # both cases were met


def test_the_labels_are_the_variants_one_example_per_group_and_variant(bench, task):
  header, groups = function_groups.load(str(bench))
  meta = json.load(open(task / "task.json"))
  rows = read_jsonl(task / "train.jsonl") + read_jsonl(task / "test.jsonl")
  assert meta["labels"] == header["variants"] == ["gcc-O0", "gcc-O1", "gcc-O2", "gcc-O3"]
  assert {r["label"] for r in rows} == set(header["variants"])
  keys = [(r["binary"], r["function"], r["label"]) for r in rows]
  assert len(keys) == len(set(keys))
  texts = {(g["source"], g["name"], v): x["text"] for g in groups for v, x in g["variants"].items()}
  assert all(texts[k] == r["text"] for k, r in zip(keys, rows))
  assert set(rows[0]) == {"text", "label", "library", "function", "binary"}
  for split in ("train", "test"):
    assert meta["counts"][split]["examples"] == len(read_jsonl(task / f"{split}.jsonl"))
  assert meta["sources"][0]["sha256"] == file_io.sha256_file(str(bench))


def test_the_same_seed_writes_byte_identical_files(bench, task, tmp_path):
  r = tool("provenance_build", "--bench", bench, "--output", tmp_path / "again", "--seed", "0")
  assert r.returncode == 0, r.stderr
  for name in ("train.jsonl", "test.jsonl", "task.json"):
    assert open(task / name, "rb").read() == open(tmp_path / "again" / name, "rb").read(), name
  splits = {tuple(provenance.build([str(bench)], seed=s)[1]["split"]["test_libraries"])
            for s in range(8)}
  assert len(splits) > 1  # the seed chooses the split


def test_variants_and_max_per_label_choose_the_labels_and_cap_each_split(bench, tmp_path):
  r = tool("provenance_build", "--bench", bench, "--output", tmp_path / "t", "--variants",
           "gcc-O0,gcc-O3", "--max-per-label", "10")
  assert r.returncode == 0, r.stderr
  meta = json.load(open(tmp_path / "t" / "task.json"))
  assert meta["labels"] == ["gcc-O0", "gcc-O3"]
  for split in ("train", "test"):
    per = meta["counts"][split]["per_label"]
    assert set(per) == {"gcc-O0", "gcc-O3"} and 0 < max(per.values()) <= 10


def test_the_baseline_runs_end_to_end_and_beats_the_majority_class(task, tmp_path):
  r = tool("baseline", "--task", task, "--json", tmp_path / "base.json")
  assert r.returncode == 0, r.stderr
  doc = json.load(open(tmp_path / "base.json"))
  s, m = doc["scores"], doc["majority"]
  assert s["accuracy"] > m["accuracy"] + 0.15 and s["macro_f1"] > m["macro_f1"] + 0.15, r.stdout
  assert s["per_label"]["gcc-O0"]["f1"] > 0.8  # -O0's frame setup and stack traffic
  assert doc["date"] and doc["device"].startswith("cpu: ") and doc["method"]["converged"]
  assert sum(map(sum, s["confusion"])) == doc["examples"]["test"]
  assert f"macro-F1 {s['macro_f1']:.4f}" in r.stdout


def test_the_labels_of_several_files_are_the_variants_every_file_holds(bench, tmp_path):
  """A pairs file built with -Os beside benchmarks without it: -Os would be told by library."""
  a = rewritten(bench, tmp_path / "a.jsonl", keep_libraries=["codecs", "containers"])
  b = rewritten(bench, tmp_path / "b.jsonl", ["gcc-O0", "gcc-O1", "gcc-O2"],
                ["numeric", "strings"])
  splits, meta = provenance.build([str(a), str(b)])
  assert meta["labels"] == ["gcc-O0", "gcc-O1", "gcc-O2"]
  assert meta["variants_left_out"] == ["gcc-O3"]
  assert {r["label"] for rows in splits.values() for r in rows} == set(meta["labels"])
  assert [x["file"] for x in meta["sources"]] == [str(a), str(b)]


def test_macro_f1_counts_every_label_of_the_task():
  """A label the classifier never predicts and the test split never holds still counts (as
  F1 0): macro-F1 over ["a", "b", "c"] of a perfect "a"/"b" prediction is 2/3."""
  s = classification.classification_scores(["a", "b"], ["a", "b"], ["a", "b", "c"])
  assert s["accuracy"] == 1.0 and s["macro_f1"] == pytest.approx(2 / 3)
  assert s["confusion"] == [[1, 0, 0], [0, 1, 0], [0, 0, 0]] and s["labels"] == ["a", "b", "c"]
  m = classification.majority_scores(["b", "b", "a"], ["a", "b"], ["a", "b", "c"])
  assert m["label"] == "b" and m["accuracy"] == 0.5


def rewritten(bench, path, keep_variants=None, keep_libraries=()):
  """The bench with only some variants or some libraries' groups."""
  lines = open(bench).read().splitlines()
  header, groups = json.loads(lines[0]), [json.loads(x) for x in lines[1:]]
  if keep_variants:
    header["variants"] = keep_variants
    for g in groups:
      g["variants"] = {v: x for v, x in g["variants"].items() if v in keep_variants}
  if keep_libraries:
    groups = [g for g in groups if g["source"].split("/")[0] in keep_libraries]
  path.write_text("\n".join(json.dumps(x) for x in [header, *groups]) + "\n")
  return path


def test_each_bad_input_is_one_line_and_exit_1(bench, tmp_path):
  not_groups = tmp_path / "x.jsonl"
  not_groups.write_text('{"format": "something else"}\n')
  full = tmp_path / "full"
  os.makedirs(full)
  (full / "old.txt").write_text("x")
  cases = {
      "not a similarity benchmark": [not_groups],
      "needs two classes or more": [rewritten(bench, tmp_path / "one.jsonl", ["gcc-O2"])],
      "a split by library needs at least 2": [rewritten(bench, tmp_path / "lib.jsonl",
                                                        keep_libraries=["codecs"])],
      "a file is given twice": [bench, bench],
  }
  for expected, files in cases.items():
    r = tool("provenance_build", "--bench", *files, "--output", tmp_path / "out")
    assert r.returncode == 1 and r.stderr.count("\n") == 1, (expected, r.stderr)
    assert r.stderr.startswith("error: ") and expected in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
  for extra, expected in ((["--output", full], "exists and is not empty"),
                          (["--output", tmp_path / "o", "--variants", "gcc-O9"], "gcc-O9"),
                          (["--output", tmp_path / "o", "--test-fraction", "1.5"], "1.5")):
    r = tool("provenance_build", "--bench", bench, *extra)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and expected in r.stderr, r.stderr
  r = tool("baseline", "--task", tmp_path / "none")
  assert r.returncode == 1 and r.stderr.count("\n") == 1 and "no such directory" in r.stderr
