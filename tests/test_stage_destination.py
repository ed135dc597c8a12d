"""lmscale stage writes only into a destination of its own (issue 55, item 1): staged onto another
prepared dataset it replaced that dataset's shards, tokenizer.json and metadata.json (exit 0,
"4 kept"); it also wrote into its source's parent, a directory inside its source and a directory
of ELF inputs. Now each is one error line and nothing there changes, by the rule lmscale prepare
follows too (store/destination.py), while its own earlier destination still resumes and repairs.

Real datasets prepared by lmscale prepare, real ELF files, the command run as the user runs it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess

import pytest

from lmscale_jax.input import staging
from lmscale_jax.prep import cluster_extract, prepare
from lmscale_jax.store import dataset, destination
from tests.helpers import lmscale
from tests.test_bad_input_prepare import one_line, text_file, text_opts
from tests.test_prepare import opts, small_elves


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  """Two different prepared datasets: ``a`` (seq 128) and ``b`` (another corpus, seq 64)."""
  top = tmp_path_factory.mktemp("prepared")
  a, b = top / "a", top / "b"
  prepare.prepare(text_opts(a, [text_file(top / "a.jsonl")], seq_len=128))
  prepare.prepare(text_opts(b, [text_file(top / "b.jsonl", n=300)], seq_len=64))
  return a, b


def snapshot(d) -> dict:
  """Every path under ``d`` with its sha256 (directories: None)."""
  return {str(p.relative_to(d)): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file()
                                  else None) for p in sorted(d.rglob("*"))}


def stage_cli(src, dest, *extra):
  return subprocess.run([*lmscale("stage"), str(src), str(dest), "--no-progress", *extra],
                        capture_output=True, text=True, timeout=120)


def test_staging_onto_another_dataset_is_refused_and_that_dataset_is_kept_byte_for_byte(
    prepared, tmp_path):
  a, b = prepared
  other = tmp_path / "other"
  shutil.copytree(b, other)
  before = snapshot(other)
  err = one_line(stage_cli(a, other), code=1)
  assert err == (f"error: destination {other} holds another dataset (its metadata.json or "
                 f"tokenizer.json differs from those of {a}): staging never replaces a dataset; "
                 "choose a new or empty DEST (or remove what is there, if it is no longer "
                 "needed)")
  assert snapshot(other) == before  # no lock file, no staging.json, not one byte


def test_a_completed_staging_of_another_version_of_the_source_is_refused_not_restaged(
    prepared, tmp_path):
  """The shared dataset re-prepared since this node staged it: the staged copy may be the last
  copy of the old version, so staging the new one over it is refused too."""
  a, b = prepared
  shared, local = tmp_path / "shared", tmp_path / "local"
  shutil.copytree(a, shared)
  assert staging.stage(str(shared), str(local), progress=False, log=lambda m: None)["copied"]
  shutil.rmtree(shared)
  shutil.copytree(b, shared)  # re-prepared in place
  before = snapshot(local)
  with pytest.raises(staging.StagingError, match="holds another dataset"):
    staging.stage(str(shared), str(local), progress=False, log=lambda m: None)
  assert snapshot(local) == before


@pytest.mark.parametrize("where", ["the source's parent", "inside the source", "the source"])
def test_a_destination_around_or_inside_the_source_is_refused_and_nothing_is_written(
    prepared, tmp_path, where):
  a, _ = prepared
  top = tmp_path / "top"
  shutil.copytree(a, top / "ds")
  src = top / "ds"
  dest = {"the source's parent": top, "inside the source": src / "local",
          "the source": src}[where]
  how = {"the source's parent": "contains", "inside the source": "lies inside",
         "the source": "is the same directory as"}[where]
  before = snapshot(top)
  err = one_line(stage_cli(src, dest), code=1)
  assert err.startswith(f"error: destination {dest} {how} the source {src}: a staged copy "
                        "must lie apart from its source"), err
  assert snapshot(top) == before


def test_a_directory_of_elf_inputs_is_refused_and_kept(prepared, tmp_path):
  a, _ = prepared
  elves = tmp_path / "elves"
  elves.mkdir()
  for p in small_elves(2):
    shutil.copy(p, elves)
  before = snapshot(elves)
  err = one_line(stage_cli(a, elves), code=1)
  first = sorted(os.listdir(elves))[0]
  assert f"holds {first!r}, which no lmscale tool wrote; choose a new or empty DEST" in err
  assert snapshot(elves) == before


def test_an_unfinished_preparation_is_refused_and_kept(prepared, tmp_path):
  a, _ = prepared
  out = tmp_path / "preparing"
  cluster_extract.plan(opts(out, small_elves(1)), slices=1, buckets=1)  # its _work/ and manifest
  before = snapshot(out)
  err = one_line(stage_cli(a, out), code=1)
  assert "holds the files of an unfinished preparation (_work) but no dataset" in err, err
  assert snapshot(out) == before


def test_its_own_earlier_destination_resumes_and_repairs_and_files_beside_it_stay(
    prepared, tmp_path):
  """staging.json names the source's content digest: a damaged tokenizer.json (no longer the
  same dataset by content) is still this staging's own copy, repaired; a README the user put
  beside it is left alone."""
  a, _ = prepared
  local = tmp_path / "local"
  stage = lambda: staging.stage(str(a), str(local), progress=False, log=lambda m: None)  # noqa
  stage()
  state = staging.read_state(str(local))
  assert state["source_digest"] == destination.identity(str(a)) is not None
  (local / "README").write_text("node-local copy\n")
  tok = local / dataset.TOKENIZER
  tok.write_bytes(tok.read_bytes().replace(b"[UNK]", b"[UNX]", 1))
  assert stage()["copied"] == 1
  assert tok.read_bytes() == (a / dataset.TOKENIZER).read_bytes()
  assert (local / "README").read_text() == "node-local copy\n"
  assert stage()["copied"] == 0
  assert dataset.DatasetMeta.load(str(local)).verify() == []


def test_a_copy_of_the_same_dataset_staged_before_digests_or_copied_by_hand_is_verified(
    prepared, tmp_path):
  """The same content is the same dataset: a staging.json written before it recorded the
  source's digest, or a copy made with cp -r, is verified (and gets the digest), not refused."""
  a, _ = prepared
  by_hand = tmp_path / "by_hand"
  shutil.copytree(a, by_hand)
  out = staging.stage(str(a), str(by_hand), progress=False, log=lambda m: None)
  assert out["copied"] == 0 and out["kept"] > 0
  old_state = staging.read_state(str(by_hand))
  del old_state["source_digest"]
  (by_hand / staging.STAGE_FILE).write_text(json.dumps(old_state))
  assert staging.stage(str(a), str(by_hand), progress=False, log=lambda m: None)["copied"] == 0
  assert staging.read_state(str(by_hand))["source_digest"] == destination.identity(str(a))


@pytest.mark.parametrize("case", ["holds an ELF file", "around the input", "inside the input",
                                  "holds another dataset"])
def test_prepare_and_stage_refuse_the_same_directories(prepared, tmp_path, case):
  """One rule, two commands: what stage refuses as a destination, prepare refuses as an output,
  and neither touches it."""
  a, b = prepared
  inp = tmp_path / "in"
  shutil.copytree(a, inp)  # the source to stage; a directory of inputs for prepare
  elf = inp / "lib.so"
  shutil.copy(small_elves(1)[0], elf)
  target = {"holds an ELF file": tmp_path / "elves", "around the input": tmp_path,
            "inside the input": inp / "sub", "holds another dataset": tmp_path / "other"}[case]
  if case == "holds an ELF file":
    target.mkdir()
    shutil.copy(elf, target)
  elif case == "holds another dataset":
    shutil.copytree(b, target)
  before = snapshot(tmp_path)
  one_line(stage_cli(inp, target), code=1)
  prep = subprocess.run([*lmscale("prepare_binary"), "--input", str(inp), "--output",
                         str(target), "--no-progress", "--workers", "1"],
                        capture_output=True, text=True, timeout=300)
  one_line(prep, code=1)
  assert snapshot(tmp_path) == before
