"""An HF directory is checked once, before any weights load, by every command that reads one
(lmscale_jax/model/hf_dir_checks.py): a config.json field of the wrong type or range, a
missing one, a tokenizer.json of the wrong schema or without the special tokens, and an
export's tokenizer.json replaced by another of the same size are each one ``error:`` line
naming the file and the field, never a traceback and never a silent load. A real tiny run,
exported by export-hf, and copies of it with one file edited."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from lmscale_jax.inference import trained_model
from lmscale_jax.model import hf_convert
from lmscale_jax.prep import prepare
from lmscale_jax.store import tokenizer as toklib
from lmscale_jax.pretrain import trainer as train
from tests.hf_helpers import hf_side
from tests.helpers import ROOT, small_train_config

ELF = "/usr/lib/x86_64-linux-gnu/libz.so.1"
INPUTS = [ELF, "/usr/lib/x86_64-linux-gnu/libbz2.so.1.0"]
RECORD = "lmscale_export.json"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
  """(dataset, run, its export, an index of libz built with the export): segment positions,
  the run that exports as transformers' own BertForMaskedLM."""
  base = tmp_path_factory.mktemp("hfdir")
  data, workdir, out = base / "ds", base / "run", base / "hf"
  prepare.prepare(prepare.PrepareOptions(kind="binary", inputs=INPUTS, output=str(data),
                                         seq_len=64, vocab_size=400, val_fraction=0.1,
                                         workers=1, progress=False))
  config = small_train_config(str(data))
  config.model.positions = "segment"
  train.train_and_evaluate(config, str(workdir))
  assert main("export_hf", ["--workdir", workdir, "--output", out]) == 0
  assert main("index", ["--hf", out, "--elf", ELF, "--output", base / "idx"]) == 0
  return data, workdir, out, base / "idx"


def main(module: str, argv) -> int:
  try:
    return importlib.import_module(f"lmscale_jax.cli.{module}").main([str(a) for a in argv])
  except SystemExit as e:  # argparse
    return e.code


def run_cli(module, argv, capsys) -> tuple[int, str]:
  capsys.readouterr()
  code = main(module, argv)
  return code, capsys.readouterr().err


# --------------------------------------------------------------------------- damaged copies
def edited_config(**fields):
  def edit(d):
    config = json.loads((d / "config.json").read_text())
    for key, value in fields.items():
      if value is ...:  # the field left out
        del config[key]
      else:
        config[key] = value
    (d / "config.json").write_text(json.dumps(config))
  return edit


def edited_tokenizer(change, *, keep_record: bool = False):
  """tokenizer.json changed by ``change`` (its JSON → new JSON); without the export record
  (an export written before it, or another BERT) unless ``keep_record``."""
  def edit(d):
    (d / "tokenizer.json").write_text(json.dumps(change(json.loads(
        (d / "tokenizer.json").read_text()))))
    if not keep_record:
      (d / RECORD).unlink()
  return edit


def without_mask(t):
  t["added_tokens"] = [a for a in t["added_tokens"] if a["content"] != "[MASK]"]
  t["model"]["vocab"]["MASKLESS"] = t["model"]["vocab"].pop("[MASK]")
  return t


def two_ids_swapped(t):
  """Another tokenizer of the same size: two words exchange their ids."""
  vocab = t["model"]["vocab"]
  a, b = [w for w in vocab if not w.startswith("[")][-2:]
  vocab[a], vocab[b] = vocab[b], vocab[a]
  return t


CASES = {  # name: (edit, what the one line must say)
    "hidden_size_a_string": (edited_config(hidden_size="big"),
                             ["config.json", "hidden_size='big'", "a positive integer"]),
    "layers_negative": (edited_config(num_hidden_layers=-1),
                        ["config.json", "num_hidden_layers=-1", "a positive integer"]),
    "layers_a_float": (edited_config(num_hidden_layers=2.5),
                       ["config.json", "num_hidden_layers=2.5", "a positive integer"]),
    "heads_missing": (edited_config(num_attention_heads=...),
                      ["config.json", "num_attention_heads is missing", "a positive integer"]),
    "tokenizer_schema": (edited_tokenizer(lambda t: {"version": "1.0",
                                                     "model": {"type": "Nope"}}),
                         ["tokenizer.json", "not a Hugging Face tokenizer.json"]),
    "tokenizer_without_mask": (edited_tokenizer(without_mask),
                               ["tokenizer.json", "lacks special tokens ['[MASK]']"]),
    "tokenizer_replaced": (edited_tokenizer(two_ids_swapped, keep_record=True),
                           ["tokenizer.json", "not the tokenizer", "exported with",
                            "Put back the tokenizer.json"]),
}


def damaged(made, tmp_path, case: str):
  d = tmp_path / case
  shutil.copytree(made[2], d)
  CASES[case][0](d)
  return d


def commands(made, d, tmp_path) -> dict[str, tuple[str, list]]:
  """Every command that reads an HF directory, on ``d`` (module, argv)."""
  data, _, _, index = made
  labels = tmp_path / "labels.jsonl"
  labels.write_text("".join(json.dumps({"text": f"push rbp [NEXT] mov rbp rsp {i}",
                                        "label": "ab"[i % 2]}) + "\n" for i in range(8)))
  return {
      "fill-mask": ("fill_mask", ["--hf", d, "--text", "push rbp [NEXT] [MASK] rbp rsp"]),
      "embed": ("embed", ["--hf", d, "--elf", ELF, "--output", tmp_path / "e.npz"]),
      "import-hf": ("import_hf", ["--hf", d, "--data", data, "--output", tmp_path / "c.py"]),
      "finetune --init-hf": ("finetune", [
          "--task", "classify", "--labels", labels, "--eval-labels", labels, "--init-hf", d,
          "--workdir", tmp_path / "ft", "--steps", 1, "--batch-size", 4]),
      "index": ("index", ["--hf", d, "--elf", ELF, "--output", tmp_path / "idx"]),
      "search": ("search", ["--index", index, "--hf", d, "--text", "push rbp [NEXT] ret"]),
      "serve": ("serve", ["--hf", d, "--port", 0]),
  }


def assert_one_line(code: int, err: str, says: list[str], where: str) -> None:
  lines = err.strip().splitlines()
  assert code not in (0, None) and "Traceback" not in err, (where, err[-3000:])
  assert len(lines) == 1 and lines[0].startswith("error: "), (where, err[-3000:])
  assert all(s in lines[0] for s in says), (where, lines[0], says)


# --------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_damaged_hf_directory_is_one_error_line_in_every_command_that_reads_it(
    made, tmp_path, capsys, case):
  d = damaged(made, tmp_path, case)
  for name, (module, argv) in commands(made, d, tmp_path).items():
    code, err = run_cli(module, argv, capsys)
    assert_one_line(code, err, CASES[case][1] + [str(d)], f"{name} ({case})")
  assert not (tmp_path / "e.npz").exists() and not (tmp_path / "c.py").exists()
  assert not (tmp_path / "idx").exists()


@pytest.mark.parametrize("fields, says", [
    ({"num_hidden_layers": 2.0}, "num_hidden_layers=2.0: expected a positive integer"),
    ({"num_hidden_layers": True}, "num_hidden_layers=True: expected a positive integer"),
    ({"vocab_size": 0}, "vocab_size=0: expected a positive integer"),
    ({"layer_norm_eps": "tiny"}, "layer_norm_eps='tiny': expected a positive number"),
    ({"initializer_range": "x"}, "initializer_range='x': expected a number >= 0"),
    ({"hidden_dropout_prob": 1.5}, "hidden_dropout_prob=1.5: expected a number in [0, 1)"),
    ({"num_attention_heads": 3}, "hidden_size=64 is not divisible by num_attention_heads=3"),
])
def test_each_model_field_of_config_json_is_checked_for_its_type_and_range(
    made, tmp_path, fields, says):
  d = tmp_path / "hf"
  shutil.copytree(made[2], d)
  edited_config(**fields)(d)
  with pytest.raises(hf_convert.HFError) as e:
    trained_model.from_hf(str(d))
  assert str(e.value).startswith(f"{d}/config.json: {says}"), str(e.value)


def test_an_export_carries_the_digest_of_its_tokenizer(made):
  record = json.loads((made[2] / RECORD).read_text())
  assert record["tokenizer_sha256"] == toklib.digest(str(made[2] / "tokenizer.json"))


def test_the_same_tokenizer_saved_in_another_key_order_still_loads(made, tmp_path):
  """The digest is of canonical JSON: re-saving the same tokenizer is no change."""
  d = tmp_path / "hf"
  shutil.copytree(made[2], d)
  tree = json.loads((d / "tokenizer.json").read_text())
  (d / "tokenizer.json").write_text(json.dumps(dict(reversed(tree.items())), indent=4))
  assert trained_model.from_hf(str(d)).cfg.layers == 2


def test_an_export_written_before_the_digest_keeps_loading(made, tmp_path, capsys):
  d = tmp_path / "old_export"
  shutil.copytree(made[2], d)
  (d / RECORD).unlink()
  code, err = run_cli("fill_mask", ["--hf", d, "--text", "push rbp [NEXT] [MASK] rbp rsp"],
                      capsys)
  assert code == 0, err


@pytest.mark.parametrize("record, says", [
    ('{"tokenizer_sha256": 5}', "tokenizer_sha256=5: expected a JSON object"),
    ("[1, 2]", "tokenizer_sha256=None: expected a JSON object"),
    ("{", "cannot read it"),
])
def test_a_damaged_export_record_is_one_line_naming_it(made, tmp_path, capsys, record, says):
  d = tmp_path / "hf"
  shutil.copytree(made[2], d)
  (d / RECORD).write_text(record)
  code, err = run_cli("fill_mask", ["--hf", d, "--text", "push rbp [NEXT] [MASK] rbp rsp"],
                      capsys)
  assert_one_line(code, err, [f"{d}/{RECORD}", says, "remove lmscale_export.json"], record)


def test_a_replaced_tokenizer_is_refused_even_where_the_dataset_was_prepared_with_it(
    made, tmp_path, capsys):
  """import-hf and init_from compare the HF vocabulary with the dataset's: a dataset
  tokenized with the replacement passes that comparison; the digest does not."""
  d = damaged(made, tmp_path, "tokenizer_replaced")
  data = tmp_path / "ds"
  shutil.copytree(made[0], data)
  shutil.copyfile(d / "tokenizer.json", data / "tokenizer.json")
  code, err = run_cli("import_hf", ["--hf", d, "--data", data, "--output", tmp_path / "c.py"],
                      capsys)
  assert_one_line(code, err, CASES["tokenizer_replaced"][1], "import-hf")
  assert not (tmp_path / "c.py").exists()


def test_pretraining_from_a_damaged_hf_directory_is_one_line(made, tmp_path, capsys):
  """``lmscale train`` with init_from (the config import-hf writes) checks it too."""
  config = tmp_path / "from_hf.py"
  assert main("import_hf", ["--hf", made[2], "--data", made[0], "--output", config]) == 0
  for case in ("hidden_size_a_string", "tokenizer_replaced"):
    d = damaged(made, tmp_path, case)
    text = config.read_text().replace(repr(str(made[2])), repr(str(d)))
    (tmp_path / f"{case}.py").write_text(text)
    out = subprocess.run(
        [sys.executable, "-m", "lmscale_jax.cli.lmscale", "train",
         f"--config={tmp_path / case}.py", f"--workdir={tmp_path / case}_run",
         "--config.train.steps=2", "--config.train.batch_size=8"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"))
    errors = [x for x in out.stderr.splitlines() if x.startswith("error: ")]
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert len(errors) == 1 and all(s in errors[0] for s in CASES[case][1]), out.stderr[-3000:]


def test_the_lmscale_command_says_one_line_for_a_wrong_typed_field(made, tmp_path):
  d = damaged(made, tmp_path, "hidden_size_a_string")
  out = subprocess.run([sys.executable, "-m", "lmscale_jax.cli.lmscale", "fill-mask", "--hf",
                        str(d), "--text", "push rbp [NEXT] [MASK] rbp rsp"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 1, out.stderr[-3000:]
  assert out.stderr.strip() == (f"error: {d}/config.json: hidden_size='big': expected a "
                                "positive integer (a Hugging Face model's config.json)")


def test_transformers_still_loads_an_export_with_its_digest(made, tmp_path):
  """The record is a side file: transformers reads config.json and tokenizer.json as before."""
  out = made[2]
  [tokens, fill] = hf_side(tmp_path, [
      {"op": "tokenize", "dir": str(out), "text": "push rbp [NEXT] mov rbp rsp"},
      {"op": "fill_mask", "dir": str(out), "text": "push rbp [NEXT] [MASK] rbp rsp",
       "top_k": 3}])
  ours = trained_model.from_hf(str(out))
  assert tokens["ids"] == ours.tokenizer.encode("push rbp [NEXT] mov rbp rsp").ids
  assert len(fill[0]) == 3
