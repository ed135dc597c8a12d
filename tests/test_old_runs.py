"""Runs and datasets made by an earlier version of the code still load and resume.

``tests/data/pre_layout/`` was written at commit a8be4f6, before the modules moved into
subpackages: a prepared text dataset (``tools/prepare_text.py``, seq 64, vocabulary 100), a
pretraining workdir of a 1-layer, 32-wide BERT stopped at step 4 (``configs/tiny.py`` with the
overrides of :data:`PRETRAIN`), and a contrastive fine-tuning workdir started from it (2 steps).
Nothing in a dataset, a checkpoint or ``config.json`` may name a module path: these tests fail
when a move breaks what users already have on disk.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np

from tests.helpers import ROOT
from tests.test_hf_tools import run_tool

FIXTURE = os.path.join(ROOT, "tests", "data", "pre_layout")
PRETRAIN = ("--config.model.layers=1", "--config.model.hidden=32", "--config.model.heads=2",
            "--config.model.ffn=64", "--config.train.batch_size=8",
            "--config.checkpoint.every=2", "--config.checkpoint.keep=1",
            "--config.train.eval_every=2", "--config.train.eval_batches=1",
            "--config.train.log_every=1", "--config.train.warmup_steps=1")


def copy_fixture(tmp_path) -> dict:
  """The fixture's runs under tmp_path (a resume writes into its workdir)."""
  return {name: str(shutil.copytree(os.path.join(FIXTURE, name), tmp_path / name))
          for name in ("dataset", "workdir", "finetune")}


def steps_logged(workdir: str) -> list[int]:
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  return sorted({r["step"] for r in rows if "loss" in r})


def test_a_pretraining_run_from_before_the_layout_resumes_at_its_checkpoint(tmp_path):
  runs = copy_fixture(tmp_path)
  assert steps_logged(runs["workdir"]) == [1, 2, 3, 4]
  r = subprocess.run(
      [sys.executable, "-m", "lmscale_jax.main", f"--config={ROOT}/configs/tiny.py",
       f"--config.data.path={runs['dataset']}", f"--workdir={runs['workdir']}",
       "--config.train.steps=6", *PRETRAIN],
      cwd=ROOT, capture_output=True, text=True, timeout=300,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert r.returncode == 0, r.stderr[-3000:]
  assert steps_logged(runs["workdir"]) == [1, 2, 3, 4, 5, 6]  # 5 and 6 only: it resumed at 4
  state = json.load(open(os.path.join(runs["workdir"], "run_state.json")))
  assert (state["state"], state["step"]) == ("finished", 6)
  # Its config.json predates model.norm/positions: read as the model it trained, not a change.
  changed = {c["key"] for c in json.load(open(os.path.join(runs["workdir"], "config.json")))
             .get("changes", [])}
  assert not changed & {"model.norm", "model.positions", "model.pre_ln"}, changed


def test_a_fine_tuned_run_from_before_the_layout_embeds_and_resumes(tmp_path, capsys):
  runs = copy_fixture(tmp_path)
  code, out, err = run_tool("embed", ["--workdir", runs["finetune"], "--data", runs["dataset"],
                                      "--split", "validation", "--output", tmp_path / "e.npz"],
                            capsys)
  assert code == 0, err
  vectors = np.load(tmp_path / "e.npz")["embeddings"]
  assert vectors.shape[1] == 16  # the fine-tuned projection head's width
  np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
  code, out, err = run_tool("finetune_similarity", [
      "--pairs", os.path.join(FIXTURE, "pairs.jsonl"), "--workdir", runs["finetune"],
      "--init-workdir", runs["workdir"], "--steps", 4, "--batch-size", 8,
      "--learning-rate", 2e-3, "--warmup-steps", 1, "--proj-dim", 16, "--log-every", 1,
      "--checkpoint-every", 2,
      "--allow-config-change"], capsys)  # the fixture's pairs and start paths were under /tmp/fx
  assert code == 0, err
  assert steps_logged(runs["finetune"]) == [1, 2, 3, 4]
  assert json.load(open(os.path.join(runs["finetune"], "run_state.json")))["step"] == 4


def test_a_run_from_before_the_model_variants_is_read_as_the_model_it_trained(tmp_path):
  """The fixture's config.json has ``pre_ln: false`` and no ``positions``: it reads back as
  ``norm="post"`` and the positions its attention windows gave it (segment), and a record of a
  one-window run (no packed_attention: before segment attention) as absolute positions."""
  from lmscale_jax.inference import model_files

  runs = copy_fixture(tmp_path)
  config, record = model_files.read_run(runs["workdir"])
  assert (config.model.norm, config.model.positions) == ("post", "segment")
  assert "pre_ln" not in config.model and "pre_ln" not in record["model"]
  assert (record["model"]["norm"], record["model"]["positions"]) == ("post", "segment")
  saved = json.load(open(os.path.join(runs["workdir"], "config.json")))
  del saved["config"]["model"]["packed_attention"]
  saved["config"]["model"]["pre_ln"] = saved["model"]["pre_ln"] = True
  with open(os.path.join(runs["workdir"], "config.json"), "w") as f:
    json.dump(saved, f)
  config, record = model_files.read_run(runs["workdir"])
  assert (config.model.norm, config.model.positions) == ("pre", "absolute")
  assert (record["model"]["norm"], record["model"]["positions"]) == ("pre", "absolute")

