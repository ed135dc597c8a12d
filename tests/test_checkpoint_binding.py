"""A checkpoint is restored only by the run that wrote it (train/checkpoint_binding.py), and a
file in place of a checkpoint is moved aside, never replaced (train/checkpoint.py).

Real runs of the trainer (2 × 64 models, seconds on a CPU) on real datasets: ``own`` trained on
dataset ``a``; ``other`` on dataset ``b`` (another corpus and another tokenizer of the same
size); ``narrow`` on ``a`` with another model shape. A checkpoint of ``other`` or ``narrow``
copied into ``own``'s checkpoints/ is what a user who mixes up directories gets: a resume, the
model tools and ``lmscale evaluate`` must refuse it in one line instead of loading it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess

import pytest

from lmscale_jax.cli import inspect_checkpoint
from lmscale_jax.errors import IncompatibleCheckpoint
from lmscale_jax.inference import trained_model
from lmscale_jax.pretrain import trainer as train
from tests.helpers import ROOT, lmscale, make_synthetic_dataset, small_train_config


def _other_tokenizer(directory) -> None:
  """The dataset's tokenizer.json with other token names for the same ids: as many tokens,
  another tokenizer (its ids mean other tokens)."""
  path = os.path.join(directory, "tokenizer.json")
  with open(path) as f:
    tok = json.load(f)
  tok["model"]["vocab"] = {(k if k.startswith("[") else f"u{k[1:]}"): v
                           for k, v in tok["model"]["vocab"].items()}
  with open(path, "w") as f:
    json.dump(tok, f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
  base = tmp_path_factory.mktemp("binding")
  for name, seed in (("a", 0), ("b", 1), ("c", 2)):
    make_synthetic_dataset(str(base / name), n_train=64, n_val=16, seed=seed)
  _other_tokenizer(base / "b")
  train.train_and_evaluate(small_train_config(base / "a", steps=3), str(base / "own"))
  train.train_and_evaluate(small_train_config(base / "b", steps=6), str(base / "other"))
  narrow = small_train_config(base / "a", steps=6)
  narrow.model.layers = 1
  train.train_and_evaluate(narrow, str(base / "narrow"))
  return {name: base / name for name in ("a", "b", "c", "own", "other", "narrow")}


def own_with(runs, tmp_path, foreign: str | None = None):
  """A copy of ``own`` (checkpoint 3) with checkpoint 6 of run ``foreign`` copied in."""
  workdir = tmp_path / "own"
  shutil.copytree(runs["own"], workdir)
  if foreign:
    shutil.copytree(runs[foreign] / "checkpoints" / "6", workdir / "checkpoints" / "6")
  return workdir


def snapshot(workdir) -> dict:
  """Every file under ``workdir`` with its size and modification time (the lock a run takes
  first left out)."""
  out = {}
  for folder, _, files in os.walk(workdir):
    for name in set(files) - {".lock"}:
      st = os.stat(os.path.join(folder, name))
      out[os.path.relpath(os.path.join(folder, name), workdir)] = (st.st_size, st.st_mtime_ns)
  return out


def test_a_resume_refuses_a_checkpoint_of_another_dataset_and_tokenizer_and_touches_nothing(
    runs, tmp_path):
  workdir = own_with(runs, tmp_path, "other")
  before = snapshot(workdir)
  with pytest.raises(IncompatibleCheckpoint) as e:
    train.train_and_evaluate(small_train_config(runs["a"], steps=9), str(workdir))
  line = str(e.value)
  assert "\n" not in line
  assert line.startswith(f"{workdir}/checkpoints/6 is a checkpoint of another run than "
                         f"{workdir}"), line
  assert "tokenizer.json sha256" in line and f"dataset: {runs['b']}" in line, line
  assert f"Move it out of {workdir}/checkpoints" in line, line
  assert snapshot(workdir) == before  # nothing trained, moved or rewritten


def test_evaluate_refuses_a_checkpoint_of_another_run_in_one_line(runs, tmp_path):
  workdir = own_with(runs, tmp_path, "other")
  r = subprocess.run([*lmscale("evaluate"), "--workdir", str(workdir), "--data",
                      str(runs["a"])], cwd=ROOT, capture_output=True, text=True, timeout=300,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert r.returncode == 1, r.stderr[-3000:]
  assert r.stdout == ""
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"error: {workdir}/checkpoints/6 is a "
                                                 "checkpoint of another run"), r.stderr[-3000:]


def test_the_model_tools_refuse_a_checkpoint_of_another_model_shape_and_load_their_own(
    runs, tmp_path):
  workdir = own_with(runs, tmp_path, "narrow")
  with pytest.raises(IncompatibleCheckpoint, match=r"checkpoints/6 is a checkpoint of another "
                     r"run .*model\.layers: 1, the run's 2"):
    trained_model.from_workdir(str(workdir))  # fill-mask, embed, export-hf, finetune's start
  assert trained_model.from_workdir(str(workdir), step=3).step == 3


def test_a_run_continued_on_another_dataset_loads_every_checkpoint_it_wrote(runs, tmp_path):
  """--allow_config_change continues a run on another corpus of the same tokenizer: its
  checkpoints before the change name the first dataset, and are still its own."""
  workdir = own_with(runs, tmp_path)
  train.train_and_evaluate(small_train_config(runs["c"], steps=6), str(workdir),
                           allow_config_change=True)
  assert sorted(os.listdir(workdir / "checkpoints")) == ["3", "6"]
  for step in (3, 6):
    assert trained_model.from_workdir(str(workdir), step=step).step == step
  # The run's checkpoint from before the change, resumed on the dataset config.json now names.
  shutil.move(workdir / "checkpoints" / "6", tmp_path / "6")
  out = train.train_and_evaluate(small_train_config(runs["c"], steps=6), str(workdir))
  assert out["step"] == 6


def test_a_file_in_place_of_a_checkpoint_is_moved_aside_with_a_warning_not_replaced(
    runs, tmp_path, caplog):
  workdir = own_with(runs, tmp_path)
  (workdir / "checkpoints" / "6").write_text("the user's notes\n")
  with caplog.at_level(logging.WARNING):
    out = train.train_and_evaluate(small_train_config(runs["a"], steps=9), str(workdir))
  assert out["step"] == 9
  aside = workdir / "checkpoints" / "6.corrupt"
  assert aside.read_text() == "the user's notes\n"
  assert (workdir / "checkpoints" / "6").is_dir() and (workdir / "checkpoints" / "9").is_dir()
  assert any(f"{workdir}/checkpoints/6 is a regular file, not a checkpoint directory" in m
             for m in caplog.messages), caplog.messages
  assert any(f"moved checkpoint {workdir}/checkpoints/6 aside to {aside}" in m
             for m in caplog.messages), caplog.messages


def test_inspect_verify_of_a_run_without_checkpoints_is_one_error(runs, tmp_path, capsys):
  workdir = tmp_path / "empty"
  (workdir / "checkpoints").mkdir(parents=True)
  shutil.copy(runs["own"] / "config.json", workdir / "config.json")
  assert inspect_checkpoint.main([str(workdir)]) == 0  # a listing: it says so
  assert f"no complete checkpoint in {workdir}/checkpoints" in capsys.readouterr().out
  assert inspect_checkpoint.main([str(workdir), "--verify"]) == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert err == [f"error: {workdir}: no checkpoint to verify in {workdir}/checkpoints (none "
                 "was saved yet, or each was moved aside)"]


def test_inspect_verify_names_a_file_in_place_of_a_checkpoint(runs, tmp_path, capsys):
  workdir = own_with(runs, tmp_path)
  (workdir / "checkpoints" / "6").write_text("not a checkpoint\n")
  assert inspect_checkpoint.main([str(workdir), "--verify"]) == 1
  out, err = capsys.readouterr()
  assert "6: " in out and "a run moves it aside to 6.corrupt" in out
  assert err.strip().splitlines()[0] == (f"error: {workdir}/checkpoints/6 is a regular file, "
                                         "not a checkpoint directory")
  assert "verify step 3: ok" in out
