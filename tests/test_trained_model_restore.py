"""A trained model is loaded with its parameters only (inference.trained_model.from_workdir →
train.checkpoint.restore_params): the same parameters, bit for bit, as the full TrainState
restore training does, with no optimizer built and no optimizer array read; lmscale evaluate
scores a checkpoint with the eval step alone (pretrain.mlm.build_eval_step). Runs: a fresh
pretraining run of the real trainer, and tests/data/pre_layout's pretraining and fine-tuned
runs (written by an earlier version of the code). Real Orbax checkpoints throughout.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts

from lmscale_jax.cli import evaluate as evaluate_cli
from lmscale_jax.errors import UserError
from lmscale_jax.inference import model_dir, model_files, trained_model
from lmscale_jax.input import grain_pipeline
from lmscale_jax.store import dataset
from lmscale_jax.train import checkpoint as ckpt_lib
from lmscale_jax.finetune import finetune_state
from lmscale_jax.train import checkpoint_manifest, optim
from lmscale_jax.train import steps as steps_lib
from lmscale_jax.pretrain import mlm
from lmscale_jax.pretrain import trainer as train
from tests.helpers import make_synthetic_dataset, small_train_config
from tests.test_old_runs import FIXTURE


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
  """name -> (workdir, tokenizer path or ""): a fresh 3-step pretraining run, and copies of
  the pre-layout fixture's pretraining and fine-tuned runs."""
  base = tmp_path_factory.mktemp("runs")
  make_synthetic_dataset(str(base / "ds"), n_train=64, n_val=16)
  train.train_and_evaluate(small_train_config(base / "ds", steps=3), str(base / "run"))
  for name in ("dataset", "workdir", "finetune"):
    shutil.copytree(os.path.join(FIXTURE, name), base / name)
  return {"pretrained": (str(base / "run"), ""),
          "pre_layout": (str(base / "workdir"), str(base / "dataset" / "tokenizer.json")),
          "pre_layout_finetuned": (str(base / "finetune"), "")}


def full_state(workdir: str, tokenizer: str = ""):
  """The whole TrainState of the latest checkpoint, restored as training restores it (the
  optimizer built for its restore target): what loading a model did before."""
  read = model_dir.read_run(workdir, tokenizer)
  run_config, cfg = read.run_config, read.cfg
  if model_dir.is_finetuned(run_config):
    target = finetune_state.abstract_state(run_config, cfg)
  else:
    target = mlm.build_steps(run_config, cfg, 1).abstract_state
  manager = ocp.CheckpointManager(ckpt_lib.checkpoints_dir(workdir), item_names=ckpt_lib.ITEMS,
                                  options=ocp.CheckpointManagerOptions(
                                      create=False, read_only=True,
                                      step_name_format=ckpt_lib.STEP_NAMES))
  try:
    return manager.restore(manager.latest_step(), args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target)))["state"]
  finally:
    manager.close()


def loaded_params(workdir: str, tokenizer: str = "") -> dict:
  """The parameters trained_model loads, in the checkpoint's layout."""
  model = trained_model.from_workdir(workdir, tokenizer_path=tokenizer)
  if model.head is None:
    return model.params
  return {"bert": model.params, "projection": model.head["projection"]}


def assert_bitwise_equal(a, b) -> None:
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    assert x.tobytes() == y.tobytes()


@pytest.mark.parametrize("name", ["pretrained", "pre_layout", "pre_layout_finetuned"])
def test_the_params_only_load_equals_the_full_restore_bitwise(runs, name):
  workdir, tokenizer = runs[name]
  assert_bitwise_equal(loaded_params(workdir, tokenizer),
                       jax.device_get(full_state(workdir, tokenizer).params))


def refuse_optimizers(monkeypatch) -> None:
  """Every way to build an optimizer (or a TrainState around one) raises."""
  def refuse(*args, **kwargs):
    raise AssertionError("a model load built an optimizer")

  for module, name in ((optax, "adamw"), (optax, "adam"), (optax, "multi_transform"),
                       (optim, "make_optimizer"), (mlm, "build_steps"),
                       (steps_lib, "build_task_steps"),
                       (finetune_state, "optimizer"), (finetune_state, "abstract_state")):
    monkeypatch.setattr(module, name, refuse)


def test_loading_builds_no_optimizer(runs, monkeypatch):
  refuse_optimizers(monkeypatch)
  for workdir, tokenizer in runs.values():
    assert jax.tree.leaves(loaded_params(workdir, tokenizer))


def train_steps_evaluation(workdir: str, data: str) -> dict:
  """What lmscale evaluate computed before it had an eval-only path: the run's eval batches
  through build_steps' eval step, on the TrainState restore target's parameters."""
  config, _ = model_files.read_run(workdir)
  config.data.path = data
  meta = dataset.DatasetMeta.load(data)
  setup = train.build_setup(config, meta)
  steps = mlm.build_steps(config, setup.model_cfg, setup.predictions)
  _, params = model_files.restore_params(workdir, None, steps.abstract_state.params)
  return train.evaluate(steps, params, grain_pipeline.make_dataset(config, meta, "validation",
                                                           train=False))


def test_evaluate_builds_no_optimizer_and_scores_as_before(runs, monkeypatch, capsys):
  """lmscale evaluate (in-process) with every optimizer constructor refusing: the loss and
  accuracy of the train steps' evaluation, and the run's own eval_loss at its last step."""
  workdir, _ = runs["pretrained"]
  data = os.path.join(os.path.dirname(workdir), "ds")
  before = train_steps_evaluation(workdir, data)
  rows = [json.loads(x) for x in open(os.path.join(workdir, "metrics.jsonl"))]
  own = [r for r in rows if "eval_loss" in r][-1]
  refuse_optimizers(monkeypatch)
  assert evaluate_cli.main(["--workdir", workdir, "--data", data, "--batches", "2"]) == 0
  got = json.loads(capsys.readouterr().out)
  assert (got["step"], got["batches"]) == (own["step"], 2)
  assert (got["loss"], got["accuracy"]) == (before["eval_loss"], before["eval_mlm_accuracy"])
  assert got["loss"] == pytest.approx(own["eval_loss"], abs=1e-6)
  assert got["accuracy"] == pytest.approx(own["eval_mlm_accuracy"], abs=1e-6)


def drop_optimizer_arrays(step_dir: str) -> None:
  """Deletes every ``opt_state`` array from the step's OCDBT store (the files hold params and
  optimizer state together) and writes the step's manifest again, so that it verifies."""
  store = ts.KvStore.open({"driver": "ocdbt",
                           "base": f"file://{os.path.join(step_dir, 'state')}/"}).result()
  assert any(k.startswith(b"opt_state.") for k in store.list().result())
  store.delete_range(ts.KvStore.KeyRange(b"opt_state.", b"opt_state/")).result()
  assert not any(k.startswith(b"opt_state") for k in store.list().result())
  if checkpoint_manifest.parts_present(step_dir):
    checkpoint_manifest.write_part(step_dir, 0, 1, int(os.path.basename(step_dir)))


@pytest.mark.parametrize("name", ["pretrained", "pre_layout_finetuned"])
def test_a_checkpoint_without_its_optimizer_arrays_still_loads(runs, name, tmp_path):
  """The full restore reads the optimizer state (it fails without it); the model load does
  not, and gives the parameters it gave with them."""
  workdir, tokenizer = runs[name]
  before = loaded_params(workdir, tokenizer)
  copy = str(shutil.copytree(workdir, tmp_path / "run"))
  drop_optimizer_arrays(ckpt_lib.step_dir(copy, ckpt_lib.latest_complete_step(copy)))
  assert checkpoint_manifest.verify(ckpt_lib.step_dir(copy,
                                                      ckpt_lib.latest_complete_step(copy))) == []
  with pytest.raises(Exception):
    full_state(copy, tokenizer)
  assert_bitwise_equal(loaded_params(copy, tokenizer), before)


def test_a_damaged_checkpoint_file_is_one_line_naming_it(runs, tmp_path):
  workdir, tokenizer = runs["pretrained"]
  copy = str(shutil.copytree(workdir, tmp_path / "run"))
  step = ckpt_lib.step_dir(copy, ckpt_lib.latest_complete_step(copy))
  data = os.path.join(step, "state", "ocdbt.process_0", "d")
  name = max(os.listdir(data), key=lambda n: os.path.getsize(os.path.join(data, n)))
  with open(os.path.join(data, name), "r+b") as f:
    f.seek(os.path.getsize(os.path.join(data, name)) // 2)
    f.write(b"\xff" * 16)
  with pytest.raises(UserError) as e:
    trained_model.from_workdir(copy, tokenizer_path=tokenizer)
  line = str(e.value)
  assert "\n" not in line and f"{step} does not verify" in line and name in line
