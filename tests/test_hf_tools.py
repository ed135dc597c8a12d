"""Using a trained model: lmscale export-hf, import-hf (+ init_from), evaluate, fill-mask and
embed on a real prepared dataset and a real (short) training run."""

from __future__ import annotations

import importlib
import json
import os
import shutil

import jax
import numpy as np
import pytest

from lmscale_jax.inference import trained_model
from lmscale_jax.model import hf_convert
from lmscale_jax.prep import prepare
from lmscale_jax.store import dataset
from lmscale_jax.pretrain import mlm
from lmscale_jax.pretrain import trainer as train
from tests.hf_helpers import hf_side
from tests.helpers import CLI_MODULES, small_train_config

ELF = "/usr/lib/x86_64-linux-gnu/libz.so.1"
INPUTS = [ELF, "/usr/lib/x86_64-linux-gnu/libbz2.so.1.0"]


def tool(name: str):
  """The lmscale subcommand's module that tools/<name>.py is kept for (run in-process)."""
  return importlib.import_module(f"lmscale_jax.cli.{CLI_MODULES.get(name, name)}")


def run_tool(name, argv, capsys):
  try:
    code = tool(name).main([str(a) for a in argv])
  except SystemExit as e:  # an argument error (argparse exits)
    code = e.code
  out = capsys.readouterr()
  return code, out.out, out.err


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A binary-code dataset from two system libraries and a 6-step run on it, with BERT's
  position table (segment positions: the model that exports as BertForMaskedLM; the default
  on binary code, instruction positions, exports with remote code: tests/test_hf_variants.py)."""
  base = tmp_path_factory.mktemp("use")
  data = base / "ds"
  prepare.prepare(prepare.PrepareOptions(kind="binary", inputs=INPUTS, output=str(data), seq_len=64,
                                  vocab_size=400, val_fraction=0.1, workers=1, progress=False))
  workdir = base / "run"
  config = small_train_config(str(data))
  config.model.positions = "segment"
  train.train_and_evaluate(config, str(workdir))
  return data, workdir


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
  out = tmp_path_factory.mktemp("export") / "hf"
  assert tool("export_hf").main(["--workdir", str(run[1]), "--output", str(out)]) == 0
  return out


def test_export_writes_a_complete_model_directory(run, exported):
  names = set(os.listdir(exported))
  assert names == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "README.md", "lmscale_export.json"}
  config = json.loads((exported / "config.json").read_text())
  assert (config["max_position_embeddings"], config["vocab_size"], config["layer_norm_eps"]) \
      == (64, dataset.DatasetMeta.load(str(run[0])).vocab_size, 1e-12)
  card = (exported / "README.md").read_text()
  eval_loss = [json.loads(x) for x in (run[1] / "metrics.jsonl").read_text().splitlines()
               if "eval_loss" in x][-1]["eval_loss"]
  assert f"{eval_loss:.4f}" in card and "6 of 6" in card


def test_exported_model_in_transformers_matches_fill_mask_tool(run, exported, tmp_path, capsys):
  """pipeline("fill-mask") on the exported directory = tools/fill_mask.py --hf and --workdir;
  AutoTokenizer loads the dataset directory itself, and [NEXT] survives decoding."""
  text = "push rbp [NEXT] mov rbp rsp [NEXT] [MASK] rsp 0x10 [NEXT] [MASK] eax eax"
  pipe, tok = hf_side(tmp_path, [
      {"op": "fill_mask", "dir": str(exported), "text": text, "top_k": 5},
      {"op": "tokenize", "dir": str(run[0]), "text": "push rbp [NEXT] ret"}])
  for source in (["--hf", exported], ["--workdir", run[1]]):
    code, out, _ = run_tool("fill_mask", [*source, "--text", text, "--json"], capsys)
    assert code == 0
    ours = json.loads(out)
    assert [[p["id"] for p in m] for m in ours] == [[p["id"] for p in m] for m in pipe]
    np.testing.assert_allclose([[p["probability"] for p in m] for m in ours],
                               [[p["probability"] for p in m] for m in pipe], atol=1e-5)
  assert tok["decoded"] == "push rbp [NEXT] ret"
  assert tok["ids"][0] == 2 and tok["ids"][-1] == 3 and tok["roles"]["mask_token"] == "[MASK]"


def test_fill_mask_masks_each_mnemonic_of_an_elf_function(run, capsys):
  code, out, _ = run_tool("fill_mask", ["--workdir", run[1], "--elf", ELF, "--function",
                                        "crc32", "--json"], capsys)
  assert code == 0
  r = json.loads(out)
  assert r["function"] == "crc32" and r["evaluated"] == r["instructions"] >= 2
  assert r["correct"] == sum(row["correct"] for row in r["rows"])
  code, out, _ = run_tool("fill_mask", ["--workdir", run[1], "--elf", ELF, "--function",
                                        "crc32"], capsys)
  assert "mnemonic top-1 accuracy" in out.splitlines()[-1]


def test_evaluate_equals_the_runs_own_eval_loss(run, capsys):
  data, workdir = run
  rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  want = [r for r in rows if "eval_loss" in r and r["step"] == 3][0]
  code, out, _ = run_tool("evaluate", ["--workdir", workdir, "--data", data, "--step", 3,
                                       "--batches", 2], capsys)
  assert code == 0
  got = json.loads(out)
  assert got["loss"] == pytest.approx(want["eval_loss"], abs=1e-6)
  assert got["accuracy"] == pytest.approx(want["eval_mlm_accuracy"], abs=1e-6)
  code, out, _ = run_tool("evaluate", ["--workdir", workdir, "--data", data], capsys)
  whole = json.loads(out)
  assert whole["step"] == 6 and whole["records"] == whole["records"] > 0
  assert whole["perplexity"] == pytest.approx(np.exp(whole["loss"]))


def test_embed_gives_one_vector_per_function(run, tmp_path, capsys):
  out = tmp_path / "e.npz"
  assert run_tool("embed", ["--workdir", run[1], "--elf", ELF, "--output", out], capsys)[0] == 0
  e = np.load(out)
  n = len(e["names"])
  assert e["embeddings"].shape == (n, 64) and n > 50 and "crc32" in set(e["names"])
  assert set(e["files"]) == {ELF} and np.isfinite(e["embeddings"]).all()
  assert run_tool("embed", ["--workdir", run[1], "--elf", ELF, "--pool", "cls", "--output",
                            tmp_path / "c.npz"], capsys)[0] == 0
  assert not np.allclose(np.load(tmp_path / "c.npz")["embeddings"], e["embeddings"])
  assert run_tool("embed", ["--workdir", run[1], "--data", run[0], "--output",
                            tmp_path / "d.npz"], capsys)[0] == 0
  d = np.load(tmp_path / "d.npz")
  assert len(d["names"]) > 0 and d["names"][0].startswith("validation:0:")


def test_import_config_and_init_from_start_at_the_hf_weights(run, exported, tmp_path, capsys):
  """tools/import_hf.py's config builds a run whose step-0 state holds the HF weights (the
  hook train._loop calls; a whole training run is left out to keep the test short)."""
  data, _ = run
  cfg_file = tmp_path / "from_hf.py"
  code, out, _ = run_tool("import_hf", ["--hf", exported, "--data", data, "--output", cfg_file],
                          capsys)
  assert code == 0 and "train with: lmscale train --config=" in out
  spec = importlib.util.spec_from_file_location("from_hf", cfg_file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  assert config.init_from == str(exported) and config.model.layers == 2
  config.train.batch_size = 8
  setup = train.build_setup(config)  # config_checks: init_from's shape = config.model's
  steps = mlm.build_steps(config, setup.model_cfg, setup.predictions)
  state = hf_convert.init_state(config.init_from, steps.init(jax.random.key(0)), steps, setup)
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(state.params),
                         trained_model.from_hf(str(exported)).params)
  config.model.positions = "auto"  # the start model's: BERT's one position table
  assert train.build_setup(config).model_cfg.positions == "segment"
  config.model.positions = "instruction"
  with pytest.raises(hf_convert.HFError, match="is a BertForMaskedLM .* set "
                     "--config.model.positions=segment"):
    train.build_setup(config)
  config.model.positions = "segment"
  config.model.layers = 3
  with pytest.raises(hf_convert.HFError, match="num_hidden_layers=2 but model.layers=3; set "
                     "--config.model.layers=2"):
    train.build_setup(config)
  other = tmp_path / "other_vocab"
  shutil.copytree(exported, other)
  vocab = json.loads((other / "tokenizer.json").read_text())
  vocab["model"]["vocab"] = {("zz" if t == "mov" else t): i
                             for t, i in vocab["model"]["vocab"].items()}
  (other / "tokenizer.json").write_text(json.dumps(vocab))
  (other / "lmscale_export.json").unlink()  # another BERT: no digest to refuse it by
  with pytest.raises(hf_convert.HFError, match="vocabulary .* differs from the dataset's"):
    hf_convert.init_params(str(other), setup.model_cfg, setup.meta)


# --------------------------------------------------------------------------- bad input
def test_bad_input_is_one_line_naming_what_and_the_fix(run, exported, tmp_path, capsys):
  data, workdir = run
  empty = tmp_path / "empty_run"
  empty.mkdir()
  (empty / "config.json").write_text((workdir / "config.json").read_text())
  (tmp_path / "busy").mkdir()
  (tmp_path / "busy" / "x").write_text("")
  roberta = tmp_path / "roberta"
  roberta.mkdir()
  (roberta / "config.json").write_text(json.dumps({"model_type": "roberta"}))
  cases = [
      ("export_hf", ["--workdir", empty, "--output", tmp_path / "o1"], "no complete checkpoint"),
      ("export_hf", ["--workdir", workdir, "--step", 5, "--output", tmp_path / "o2"],
       "no checkpoint at step 5; it has steps 3, 6"),
      ("export_hf", ["--workdir", workdir, "--output", tmp_path / "busy"],
       "not an empty directory"),
      ("fill_mask", ["--hf", exported, "--text", "push rbp"], "has no [MASK]"),
      ("fill_mask", ["--hf", exported, "--elf", ELF, "--function", "no_such_fn"],
       "has no function named 'no_such_fn'"),
      ("import_hf", ["--hf", roberta, "--data", data, "--output", tmp_path / "c.py"],
       "only BERT"),
      ("evaluate", ["--workdir", tmp_path / "nowhere", "--data", data], "no such directory"),
  ]
  for name, argv, message in cases:
    code, out, err = run_tool(name, argv, capsys)
    assert code == 1, (name, argv, err)
    assert len(err.strip().splitlines()) == 1 and message in err, (name, err)
  assert not (tmp_path / "o1").exists() and os.listdir(tmp_path / "busy") == ["x"]


def test_pre_ln_run_export_is_not_refused_as_a_bert(run, tmp_path, capsys):
  """A pre-LN run exports with its modeling code (tests/test_hf_variants.py), so export-hf
  takes this config.json past the model check to the restore: its run has no checkpoint."""
  saved = json.loads((run[1] / "config.json").read_text())
  saved["config"]["model"]["norm"] = saved["model"]["norm"] = "pre"
  (tmp_path / "pre").mkdir()
  (tmp_path / "pre" / "config.json").write_text(json.dumps(saved))
  code, _, err = run_tool("export_hf", ["--workdir", tmp_path / "pre", "--output",
                                        tmp_path / "o"], capsys)
  assert code == 1 and "cannot be exported" not in err and "no complete checkpoint" in err
  assert len(err.strip().splitlines()) == 1 and not (tmp_path / "o").exists()
