"""The BertForMaskedLM mapping (lmscale_jax/model/hf_convert.py) against transformers itself."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from lmscale_jax.inference import trained_model
from lmscale_jax.model import hf_convert
from lmscale_jax.store import tokenizer as toklib
from tests.hf_helpers import hf_side
from tests.test_model import apply, init, random_batch, small_cfg


def expected_hf_keys(layers: int) -> set[str]:
  keys = {f"bert.embeddings.{n}.weight" for n in
          ("word_embeddings", "position_embeddings", "token_type_embeddings")}
  keys |= {"bert.embeddings.LayerNorm.weight", "bert.embeddings.LayerNorm.bias",
           "cls.predictions.bias", "cls.predictions.decoder.weight",
           "cls.predictions.decoder.bias"}
  keys |= {f"cls.predictions.transform.{m}.{p}" for m in ("dense", "LayerNorm")
           for p in ("weight", "bias")}
  for i in range(layers):
    for m in ("attention.self.query", "attention.self.key", "attention.self.value",
              "attention.output.dense", "attention.output.LayerNorm", "intermediate.dense",
              "output.dense", "output.LayerNorm"):
      keys |= {f"bert.encoder.layer.{i}.{m}.weight", f"bert.encoder.layer.{i}.{m}.bias"}
  return keys


@pytest.fixture(scope="module")
def cfg():
  # layer_norm_eps: not transformers' default, so it must travel in config.json; BERT's
  # position table (the default on binary code, instruction positions, has no BERT form).
  return small_cfg(layer_norm_eps=1e-7, positions="segment")


@pytest.fixture(scope="module")
def params(cfg):
  """Every parameter perturbed: no zero bias, no unit LayerNorm, so a mix-up shows."""
  fresh = init(cfg)
  leaves, tree = jax.tree_util.tree_flatten(fresh)
  keys = jax.random.split(jax.random.key(7), len(leaves))
  noisy = [np.asarray(x + 0.2 * jax.random.normal(k, x.shape)) for x, k in zip(leaves, keys)]
  return jax.tree_util.tree_unflatten(tree, noisy)


def write_tokenizer(directory, vocab_size: int, seq_len: int) -> None:
  from tokenizers import Tokenizer, models, pre_tokenizers

  vocab = {t: i for i, t in enumerate(toklib.dataset.SPECIAL_TOKENS)}
  vocab.update({f"t{i}": i for i in range(len(vocab), vocab_size)})
  tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(list(toklib.dataset.SPECIAL_TOKENS))
  toklib.write_hf_files(tok, str(directory), model_max_length=seq_len)


@pytest.fixture(scope="module")
def exported(cfg, params, tmp_path_factory):
  out = tmp_path_factory.mktemp("hf") / "model"
  out.mkdir()
  hf_convert.save_model(params, cfg, str(out))
  write_tokenizer(out, cfg.vocab_size, cfg.seq_len)
  return out


# --------------------------------------------------------------------------- mapping alone
def test_hf_state_dict_keys_and_layout(cfg, params):
  sd = hf_convert.to_hf_state_dict(params, cfg)
  assert set(sd) == expected_hf_keys(cfg.layers)
  assert all(isinstance(v, np.ndarray) and v.dtype == np.float32 for v in sd.values())
  h, f, v = cfg.hidden, cfg.ffn, cfg.vocab_size
  assert sd["bert.encoder.layer.0.intermediate.dense.weight"].shape == (f, h)  # (out, in)
  assert sd["bert.encoder.layer.1.output.dense.weight"].shape == (h, f)
  assert sd["bert.embeddings.word_embeddings.weight"].shape == (v, h)
  np.testing.assert_array_equal(sd["bert.encoder.layer.0.attention.self.query.weight"],
                                np.asarray(params["layer_0"]["query"]["kernel"]).T)
  np.testing.assert_array_equal(sd["cls.predictions.decoder.weight"],
                                sd["bert.embeddings.word_embeddings.weight"])


def test_from_hf_rejects_bad_state_dicts(cfg, params):
  sd = hf_convert.to_hf_state_dict(params, cfg)
  untied = dict(sd, **{"cls.predictions.decoder.weight": sd["cls.predictions.decoder.weight"] + 1})
  with pytest.raises(hf_convert.HFError, match="ties"):
    hf_convert.from_hf_state_dict(untied, cfg)
  with pytest.raises(hf_convert.HFError, match="lacks 'bert.encoder.layer.1.output.dense.bias'"):
    hf_convert.from_hf_state_dict({k: v for k, v in sd.items()
                                   if k != "bert.encoder.layer.1.output.dense.bias"}, cfg)
  with pytest.raises(hf_convert.HFError, match="does not map.*layer.2"):
    hf_convert.from_hf_state_dict(
        dict(sd, **{"bert.encoder.layer.2.output.dense.bias": np.zeros(cfg.hidden)}), cfg)
  with pytest.raises(hf_convert.HFError, match="shape"):
    hf_convert.from_hf_state_dict(sd, small_cfg(ffn=48, positions="segment"))
  # BertForPreTraining's pooler and next-sentence head: not part of a masked LM, ignored.
  hf_convert.from_hf_state_dict(dict(sd, **{"bert.pooler.dense.bias": np.zeros(cfg.hidden)}),
                                cfg)


def test_pre_ln_is_refused_as_a_bert_in_one_line(cfg):
  pre = small_cfg(norm="pre")
  with pytest.raises(hf_convert.HFError, match="norm='pre' cannot be exported.*Megatron"):
    hf_convert.hf_config(pre)
  with pytest.raises(hf_convert.HFError, match="norm='pre'"):
    hf_convert.to_hf_state_dict({}, pre)


def test_instruction_positions_are_refused_as_a_bert_in_one_line(cfg):
  with pytest.raises(hf_convert.HFError, match="positions='instruction' cannot be exported"):
    hf_convert.hf_config(small_cfg(positions="instruction"))


def test_export_import_round_trips_parameters_exactly(cfg, params, exported):
  back = trained_model.from_hf(str(exported))
  assert jax.tree_util.tree_structure(back.params) == jax.tree_util.tree_structure(params)
  jax.tree_util.tree_map(np.testing.assert_array_equal, back.params, params)
  for key in ("layers", "hidden", "heads", "ffn", "vocab_size", "seq_len", "layer_norm_eps"):
    assert back.cfg[key] == cfg[key], key


def test_import_refuses_a_directory_that_is_not_bert(exported, tmp_path):
  other = tmp_path / "roberta"
  other.mkdir()
  config = json.loads((exported / "config.json").read_text())
  (other / "config.json").write_text(json.dumps(dict(config, model_type="roberta",
                                                     architectures=["RobertaForMaskedLM"])))
  with pytest.raises(hf_convert.HFError, match="model_type='roberta'.*only BERT"):
    trained_model.from_hf(str(other))
  with pytest.raises(hf_convert.HFError, match="no config.json"):
    trained_model.from_hf(str(tmp_path))
  (other / "config.json").write_text(json.dumps(dict(config, hidden_act="relu")))
  with pytest.raises(hf_convert.HFError, match="hidden_act='relu'"):
    trained_model.from_hf(str(other))


# --------------------------------------------------------------------------- against transformers
def test_transformers_gives_the_same_logits_and_tokens(cfg, params, exported, tmp_path):
  """The exported directory in transformers: strict load (from_pretrained and load_state_dict),
  the same MLM logits on a padded batch (eager and sdpa attention), the tokenizer's roles and
  [CLS] … [SEP] framing, [NEXT] kept by decode; and a model transformers saved itself imports
  with the same logits."""
  ids, positions = random_batch(cfg, pad_from=11)
  ours = np.asarray(apply(cfg, params, ids, positions))
  np.savez(tmp_path / "sd.npz", **hf_convert.to_hf_state_dict(params, cfg))
  saved = tmp_path / "saved_by_hf"
  hf_cfg = dict(hf_convert.hf_config(cfg), layer_norm_eps=1e-6)
  job = {"ids": np.asarray(ids).tolist(), "positions": np.asarray(positions).tolist()}
  eager, sdpa, strict, tok, _, theirs = hf_side(tmp_path, [
      dict(job, op="logits", dir=str(exported)),
      dict(job, op="logits", dir=str(exported), attn="sdpa"),
      {"op": "strict", "dir": str(exported), "npz": str(tmp_path / "sd.npz")},
      {"op": "tokenize", "dir": str(exported), "text": "t6 [NEXT] t7 [MASK]"},
      {"op": "save_random", "dir": str(saved), "config": hf_cfg},
      dict(job, op="logits", dir=str(saved)),
  ])
  assert eager["class"] == "BertForMaskedLM"
  assert not any(eager["info"].values()), eager["info"]  # nothing missing/unexpected/mismatched
  assert strict == {"missing": [], "unexpected": []}
  for result in (eager, sdpa):
    diff = np.abs(np.asarray(result["logits"]) - ours).max()
    assert diff < 1e-4, diff
  assert float(np.std(ours)) > 0.5  # the perturbation shows in the logits
  assert tok["ids"] == [2, 6, 5, 7, 4, 3]  # [CLS] t6 [NEXT] t7 [MASK] [SEP]
  assert tok["decoded"] == "t6 [NEXT] t7"
  assert tok["roles"] == {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]",
                          "sep_token": "[SEP]", "mask_token": "[MASK]"}
  write_tokenizer(saved, cfg.vocab_size, cfg.seq_len)
  imported = trained_model.from_hf(str(saved))
  assert imported.cfg.layer_norm_eps == 1e-6
  mine = trained_model.mlm_logits(imported, np.asarray(ids), np.asarray(positions))
  assert np.abs(mine - np.asarray(theirs["logits"])).max() < 1e-4
