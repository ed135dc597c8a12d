"""The model variants transformers' BERT has no form for (model.norm=pre,
model.positions=instruction) and the sequence classifier, exported with their own modeling
code (lmscale_jax/model/hf_remote/) and loaded by transformers with trust_remote_code=True
(run in .venv-hf, like the other tests/test_hf_*.py)."""

from __future__ import annotations

import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmscale_jax.cli import export_hf, fill_mask, import_hf
from lmscale_jax.inference import trained_model
from lmscale_jax.model import contrastive, hf_classifier, hf_convert
from lmscale_jax.store import dataset
from lmscale_jax.store import tokenizer as toklib
from lmscale_jax.pretrain import trainer
from tests.hf_helpers import hf_side
from tests.helpers import SPECIAL_IDS, make_synthetic_dataset, small_train_config
from tests.test_model import apply, init, small_cfg

SEQ = 32
WORDS = ("push pop mov sub add xor lea call ret nop rbp rsp rax rdi eax qword [ ] - + 0x10 "
         "0x18").split()
TEXTS = ["push rbp [NEXT] mov rbp rsp [NEXT] sub rsp 0x10 [NEXT] mov rax qword [ rbp - 0x18 ] "
         "[NEXT] call 0x10 [NEXT] ret",
         "xor eax eax [NEXT] ret",
         "push rbp [NEXT] lea rdi [ rbp + 0x10 ] [NEXT] pop rbp [NEXT] nop [NEXT] ret"]
VARIANTS = {"pre_instruction": dict(norm="pre", positions="instruction"),
            "pre_segment": dict(norm="pre", positions="segment"),
            "post_instruction": dict(norm="post", positions="instruction",
                                     packed_attention="cross")}
LABELS = ["compression", "crypto", "network"]


def tokenizer():
  """A word-level tokenizer of instruction text: the specials, then WORDS."""
  from tokenizers import Tokenizer, models, pre_tokenizers

  vocab = dict(SPECIAL_IDS)
  vocab.update({w: len(SPECIAL_IDS) + i for i, w in enumerate(WORDS)})
  tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(list(dataset.SPECIAL_TOKENS))
  return toklib.with_hf_roles(tok)


def variant_cfg(**options):
  meta = dataset.DatasetMeta(path="/data/ds", name="t", seq_len=SEQ,
                             vocab_size=len(SPECIAL_IDS) + len(WORDS),
                             special_ids=dict(SPECIAL_IDS), splits={}, raw={})
  return small_cfg(meta=meta, layer_norm_eps=1e-7, **options)


def perturbed(tree, seed: int):
  """Every parameter perturbed: no zero bias, no unit LayerNorm, so a mix-up shows."""
  leaves, structure = jax.tree_util.tree_flatten(tree)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  noisy = [np.asarray(x + 0.2 * jax.random.normal(k, x.shape)) for x, k in zip(leaves, keys)]
  return jax.tree_util.tree_unflatten(structure, noisy)


def export(params, cfg, out) -> str:
  out.mkdir()
  hf_convert.save_model(params, cfg, str(out))
  toklib.write_hf_files(tokenizer(), str(out), model_max_length=SEQ)
  return str(out)


def packed_row() -> list[int]:
  """Two functions in one row, then padding: positions restart at the second [CLS]."""
  enc = lambda t: tokenizer().encode(t).ids
  row = enc(TEXTS[1]) + enc(TEXTS[2])
  return row + [SPECIAL_IDS["[PAD]"]] * (SEQ - len(row))


def all_logits(cfg, params, ids):
  ids = jnp.asarray(ids, jnp.int32)
  every = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
  return np.asarray(apply(cfg, params, ids, every))


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
  """{variant: (cfg, params, export directory)}"""
  base = tmp_path_factory.mktemp("variants")
  out = {}
  for i, (name, options) in enumerate(VARIANTS.items()):
    cfg = variant_cfg(**options)
    params = perturbed(init(cfg), 11 + i)
    out[name] = (cfg, params, export(params, cfg, base / name))
  return out


# --------------------------------------------------------------------------- files
def test_variants_export_with_their_modeling_code(exports):
  for name, (cfg, _, out) in exports.items():
    config = json.loads(open(os.path.join(out, "config.json")).read())
    assert config["model_type"] == "lmscale_bert", name
    assert config["architectures"] == ["LmscaleForMaskedLM"]
    assert config["auto_map"]["AutoModelForMaskedLM"] == "modeling_lmscale.LmscaleForMaskedLM"
    assert (config["norm"], config["positions"]) == (cfg.norm, cfg.positions)
    assert (config["cls_token_id"], config["next_token_id"]) == (2, 5)
    assert {"modeling_lmscale.py", "configuration_lmscale.py"} <= set(os.listdir(out))


def test_plain_post_ln_run_still_exports_as_bert_without_code(tmp_path):
  cfg = variant_cfg(positions="segment")  # norm=post (the default), BERT's position table
  out = export(init(cfg), cfg, tmp_path / "bert")
  config = json.loads(open(os.path.join(out, "config.json")).read())
  assert (config["model_type"], config["architectures"]) == ("bert", ["BertForMaskedLM"])
  assert "auto_map" not in config
  assert not [n for n in os.listdir(out) if n.endswith(".py")]


def test_export_import_round_trips_parameters_exactly(exports):
  for name, (cfg, params, out) in exports.items():
    back = trained_model.from_hf(out)
    assert jax.tree_util.tree_structure(back.params) == jax.tree_util.tree_structure(params)
    jax.tree_util.tree_map(np.testing.assert_array_equal, back.params, params)
    for key in ("norm", "positions", "packed_attention", "layers", "seq_len", "layer_norm_eps"):
      assert back.cfg[key] == cfg[key], (name, key)


def test_unknown_positions_in_config_json_is_one_line(exports, tmp_path):
  bad = tmp_path / "bad"
  bad.mkdir()
  _, _, out = exports["pre_instruction"]
  for name in os.listdir(out):
    (bad / name).write_bytes(open(os.path.join(out, name), "rb").read())
  config = json.loads((bad / "config.json").read_text())
  (bad / "config.json").write_text(json.dumps(dict(config, positions="rotary")))
  with pytest.raises(hf_convert.HFError) as e:
    trained_model.from_hf(str(bad))
  message = str(e.value)
  assert "positions='rotary'" in message and "'instruction'" in message
  assert len(message.splitlines()) == 1


def test_what_no_export_represents_is_refused_in_one_line(exports, tmp_path):
  cfg, params, _ = exports["pre_segment"]
  newer = cfg.copy_and_resolve_references()
  newer.positions = "rotary"  # a config.json from a later lmscale_jax
  with pytest.raises(hf_convert.HFError, match="model.positions='rotary' cannot be exported"):
    hf_convert.save_model(params, newer, str(tmp_path))
  head = {"kernel": np.zeros((cfg.hidden, 2), np.float32), "bias": np.zeros(2, np.float32)}
  with pytest.raises(hf_convert.HFError, match="2 classes but 3 labels"):
    hf_classifier.save_classifier({"bert": params, "classifier": head}, cfg, LABELS,
                                  str(tmp_path))
  assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- against transformers
def test_transformers_with_remote_code_gives_our_logits(exports, tmp_path):
  """Each variant in transformers (AutoTokenizer + AutoModelForMaskedLM, trust_remote_code):
  nothing missing or unexpected on load, and the MLM logits at every position of a padded batch
  of instruction text, and of a row packing two functions, equal ours."""
  jobs = []
  for _, _, out in exports.values():
    jobs += [{"op": "remote", "dir": out, "auto": "AutoModelForMaskedLM", "texts": TEXTS},
             {"op": "remote", "dir": out, "auto": "AutoModelForMaskedLM", "ids": [packed_row()]}]
  results = hf_side(tmp_path, jobs, timeout=300)
  ours_ids = [tokenizer().encode(t).ids for t in TEXTS]
  for i, (name, (cfg, params, _)) in enumerate(exports.items()):
    texts, packed = results[2 * i], results[2 * i + 1]
    assert texts["class"] == "LmscaleForMaskedLM"
    assert not any(texts["info"].values()), texts["info"]
    ids = np.asarray(texts["ids"])
    assert [list(r[:len(o)]) for r, o in zip(ids, ours_ids)] == ours_ids
    assert (ids == SPECIAL_IDS["[PAD]"]).any() and (ids == SPECIAL_IDS["[NEXT]"]).any()
    for result in (texts, packed):
      ours = all_logits(cfg, params, result["ids"])
      keep = np.asarray(result["ids"]) != SPECIAL_IDS["[PAD]"]
      diff = np.abs(np.asarray(result["logits"]) - ours)[keep].max()
      print(f"{name}: max |logits diff| {diff:.2e}, logits std {ours.std():.2f}")
      assert diff < 1e-5, (name, diff)
      assert float(np.std(ours)) > 0.5  # the perturbation shows in the logits


def test_sequence_classifier_in_transformers_equals_mean_pool_and_dense(exports, tmp_path):
  """hf_classifier.save_classifier → AutoModelForSequenceClassification (trust_remote_code):
  its logits = the encoder's last layer, mean-pooled over non-pad tokens, → dense, in flax; the
  labels travel as id2label; load_classifier gives the parameters back bit for bit."""
  cfg, params, _ = exports["pre_instruction"]
  rng = np.random.default_rng(3)
  head = {"kernel": rng.normal(size=(cfg.hidden, len(LABELS))).astype(np.float32),
          "bias": rng.normal(size=(len(LABELS),)).astype(np.float32)}
  tree = {"bert": params, "classifier": head}
  out = tmp_path / "classifier"
  out.mkdir()
  hf_classifier.save_classifier(tree, cfg, LABELS, str(out))
  toklib.write_hf_files(tokenizer(), str(out), model_max_length=SEQ)
  theirs, = hf_side(tmp_path, [{"op": "remote", "dir": str(out), "texts": TEXTS,
                                "auto": "AutoModelForSequenceClassification"}])
  assert theirs["class"] == "LmscaleForSequenceClassification"
  assert not any(theirs["info"].values()), theirs["info"]
  assert theirs["id2label"] == {str(i): name for i, name in enumerate(LABELS)}
  ids = jnp.asarray(theirs["ids"], jnp.int32)
  h = apply(cfg, params, ids, None)
  ours = np.asarray(contrastive.pool(h, ids, cfg.pad_id, "mean") @ head["kernel"] + head["bias"])
  diff = np.abs(np.asarray(theirs["logits"]) - ours).max()
  print(f"classifier: max |logits diff| {diff:.2e}")
  assert diff < 1e-5, diff
  back, names = hf_classifier.load_classifier(str(out), cfg)
  assert names == LABELS
  encoder = {k: v for k, v in params.items() if not k.startswith("mlm_")}
  jax.tree_util.tree_map(np.testing.assert_array_equal, back, {"bert": encoder,
                                                               "classifier": head})
  with pytest.raises(hf_convert.HFError, match="sequence classifier"):
    trained_model.from_hf(str(out))


# --------------------------------------------------------------------------- lmscale export-hf
@pytest.fixture(scope="module")
def undertale_run(tmp_path_factory):
  """A 2-step pre-LN, instruction-position run (undertale's model, small) on a real dataset."""
  base = tmp_path_factory.mktemp("undertale")
  make_synthetic_dataset(str(base / "ds"), seq_len=32, vocab_size=64, n_train=32, n_val=16)
  meta_path = base / "ds" / "metadata.json"  # its tokens stand in for instruction text
  meta_path.write_text(json.dumps(dict(json.loads(meta_path.read_text()), kind="binary")))
  config = small_train_config(str(base / "ds"), steps=2, eval_every=2)
  config.model.update(norm="pre", positions="instruction")
  config.checkpoint.every = 2
  trainer.train_and_evaluate(config, str(base / "run"))
  return base / "ds", base / "run"


def test_export_hf_of_a_pre_ln_instruction_run_loads_with_trust_remote_code(
    undertale_run, tmp_path, capsys):
  """lmscale export-hf writes the modeling code and a card that loads it with
  trust_remote_code=True; transformers' logits = the run's; lmscale fill-mask --hf and
  import-hf (+ init_from) take the directory."""
  data, run = undertale_run
  out = tmp_path / "hf"
  assert export_hf.main(["--workdir", str(run), "--output", str(out)]) == 0
  assert "LmscaleForMaskedLM" in capsys.readouterr().out
  assert {"modeling_lmscale.py", "configuration_lmscale.py", "tokenizer.json"} <= set(
      os.listdir(out))
  assert "trust_remote_code=True" in (out / "README.md").read_text()
  model = trained_model.from_workdir(str(run))
  ids = [[2, 6, 7, 5, 8, 9, 10, 5, 11, 3, 0, 0],  # [CLS] t6 t7 [NEXT] t8 … [SEP] [PAD] [PAD]
         [2, 12, 5, 13, 3, 2, 14, 5, 15, 3, 0, 0]]  # two functions packed in one row
  theirs, = hf_side(tmp_path, [{"op": "remote", "dir": str(out), "ids": ids,
                                "auto": "AutoModelForMaskedLM"}])
  every = np.broadcast_to(np.arange(12), (2, 12))
  ours = trained_model.mlm_logits(model, np.asarray(ids, np.int32), every)
  assert np.abs(np.asarray(theirs["logits"]) - ours)[np.asarray(ids) != 0].max() < 1e-5
  assert fill_mask.main(["--hf", str(out), "--text", "t7 [NEXT] [MASK] t9"]) == 0
  config_file = tmp_path / "from_hf.py"
  assert import_hf.main(["--hf", str(out), "--data", str(data), "--output",
                         str(config_file)]) == 0
  spec = importlib.util.spec_from_file_location("from_hf", config_file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  assert (config.model.norm, config.model.positions) == ("pre", "instruction")
  config.train.batch_size = 8
  setup = trainer.build_setup(config)
  start = hf_convert.init_params(config.init_from, setup.model_cfg, setup.meta)
  jax.tree_util.tree_map(np.testing.assert_array_equal, start, model.params)
