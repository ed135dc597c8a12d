"""A naming fine-tune exported to Hugging Face (lmscale export-hf of tests/test_finetune_name.py's
run): transformers loads it as a multi-label LmscaleForSequenceClassification whose sigmoids
are the run's, and lmscale name --hf suggests what lmscale name --workdir does."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from lmscale_jax.finetune import labels as labels_lib
from lmscale_jax.finetune import name_run
from lmscale_jax.inference import trained_model
from lmscale_jax.model import hf_classifier, hf_convert, name_head
from tests.hf_helpers import hf_side
from tests.test_finetune import bench, pretrained, rows  # noqa: F401 (fixtures)
from tests.test_finetune_name import named, task_dir  # noqa: F401 (fixtures)
from tests.test_hf_tools import run_tool
from tests.test_name_command import pytestmark, stripped  # noqa: F401 (fixture, gcc + strip)


@pytest.fixture(scope="module")
def exported(named, tmp_path_factory):
  out = tmp_path_factory.mktemp("export") / "namer"
  from lmscale_jax.cli import export_hf

  assert export_hf.main(["--workdir", str(named), "--output", str(out)]) == 0
  return out


def test_the_export_in_transformers_gives_the_runs_sigmoid_probabilities(named, task_dir,
                                                                        exported, tmp_path):
  config = json.load(open(exported / "config.json"))
  tokens = name_head.load_vocab(str(named))["tokens"]
  rule = json.load(open(named / name_run.EVAL_REPORT))["rule"]
  assert config["problem_type"] == "multi_label_classification"
  assert config["naming_rule"] == rule
  texts = [json.loads(x)["text"] for x in open(task_dir / "test.jsonl").read().splitlines()]
  model = trained_model.from_workdir(str(named))
  ids, _ = labels_lib.encode_all(model, texts)
  ours = trained_model.name_probs(model, ids)
  theirs, = hf_side(tmp_path, [{"op": "remote", "dir": str(exported), "ids": ids.tolist(),
                                "auto": "AutoModelForSequenceClassification"}])
  assert theirs["class"] == "LmscaleForSequenceClassification"
  assert not any(theirs["info"].values()), theirs["info"]
  assert theirs["id2label"] == {str(i): t for i, t in enumerate(tokens)}
  probs = name_head.sigmoid(np.asarray(theirs["logits"]))
  diff = np.abs(probs - ours).max()
  print(f"{len(texts)} held-out functions × {len(tokens)} sub-tokens: max |p diff| {diff:.2e}, "
        f"p std {ours.std():.3f}")
  assert diff < 1e-5 and ours.std() > 0.01, diff
  # lmscale reads the export back into the run's parameters, bit for bit (the MLM head the run
  # started from is not exported: naming does not use it).
  back = trained_model.from_hf(str(exported), naming=True)
  assert back.namer["tokens"] == tokens and back.namer["rule"] == rule
  run = trained_model.namer_params(model)
  run["bert"] = {k: v for k, v in run["bert"].items() if not k.startswith("mlm_")}
  jax.tree_util.tree_map(np.testing.assert_array_equal, trained_model.namer_params(back), run)
  # The tools that run the MLM head refuse it in one line, as they refuse a classifier.
  with pytest.raises(hf_convert.HFError, match="sequence classifier"):
    trained_model.from_hf(str(exported))
  card = (exported / "README.md").read_text()
  assert "function namer" in card and f"| name sub-tokens | {len(tokens)}" in card
  assert ("scored together by the rule's gate" in card) == ("gate" in rule)


def test_lmscale_name_from_the_export_suggests_what_the_run_does(named, exported, stripped,
                                                                  tmp_path, capsys):
  got = {}
  for flag, source in (("--workdir", named), ("--hf", exported)):
    out = tmp_path / f"{flag[2:]}.json"
    code, _, err = run_tool("name", [flag, source, "--elf", stripped[0], "--top", 4, "--json",
                                     out], capsys)
    assert code == 0, err
    got[flag] = json.load(open(out))
  assert got["--hf"]["model"] == str(exported) and got["--hf"]["rule"] == got["--workdir"]["rule"]
  run, hf = got["--workdir"]["functions"], got["--hf"]["functions"]
  assert len(run) >= 20 and [f["suggested"] for f in hf] == [f["suggested"] for f in run]
  assert [[t for t, _ in f["tokens"]] for f in hf] == [[t for t, _ in f["tokens"]] for f in run]
  diff = max(abs(p - q) for a, b in zip(hf, run) for (_, p), (_, q) in zip(a["tokens"],
                                                                            b["tokens"]))
  assert diff <= 1e-4, diff  # probabilities rounded to 4 places on both sides


def test_an_export_that_is_not_a_namer_is_refused_in_one_line(named, exported, stripped,
                                                              tmp_path, capsys):
  code, _, err = run_tool("name", ["--hf", exported, "--step", 60, "--elf", stripped[0]],
                          capsys)
  assert code == 1 and err.count("\n") == 1 and "--step" in err, err
  broken = tmp_path / "broken"
  broken.mkdir()
  for f in exported.iterdir():
    (broken / f.name).write_bytes(f.read_bytes())
  config = json.load(open(broken / "config.json"))
  config["naming_rule"] = {"kind": "best-guess"}
  (broken / "config.json").write_text(json.dumps(config))
  code, _, err = run_tool("name", ["--hf", broken, "--elf", stripped[0]], capsys)
  assert code == 1 and err.count("\n") == 1, err
  assert "naming_rule" in err and "not a naming model" in err
  assert hf_classifier.is_namer(config)
