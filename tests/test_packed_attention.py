"""model.packed_attention="segment": every packed function is computed as it is alone.

The datasets here are real packed ArrayRecord datasets written through the production packer
(:class:`lmscale_jax.prep.packing.Packer`) and ``dataset.finalize``; runs are real
``python -m lmscale_jax.main`` processes (1 and 2 of them, and one killed with SIGKILL).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmscale_jax.config import checks as config_checks
from lmscale_jax.errors import ConfigError
from lmscale_jax.input import grain_pipeline as data
from lmscale_jax.model import bert as M
from lmscale_jax.prep.packing import Packer
from lmscale_jax.store import dataset, file_io
from tests.helpers import SPECIAL_IDS, make_config, make_synthetic_dataset
from tests.test_distributed import local_sh
from tests.test_faults import args as run_args
from tests.test_faults import kill, last_step, run, saving, series, start, wait_for

CLS, SEP, PAD = SPECIAL_IDS["[CLS]"], SPECIAL_IDS["[SEP]"], SPECIAL_IDS["[PAD]"]
SEQ, VOCAB = 64, 128


def random_functions(rng, n: int, long_every: int = 9) -> list[np.ndarray]:
  """Token ids of ``n`` functions of 1..40 tokens; every ``long_every``-th is longer than a
  sequence, so the packer splits it."""
  nspecial = len(SPECIAL_IDS)
  lengths = [int(rng.integers(1, 41)) if i % long_every else SEQ + 20 for i in range(n)]
  return [rng.integers(nspecial, VOCAB, length).astype(np.uint16) for length in lengths]


def pack(functions, seq_len: int = SEQ, mode: str = "greedy") -> np.ndarray:
  packer = Packer(seq_len, CLS, SEP, PAD, mode)
  rows = [row for f in functions for row in packer.add(f)] + list(packer.flush())
  return np.stack(rows)


def make_packed_dataset(directory, *, n_train: int = 600, n_val: int = 80, seed: int = 0,
                        mode: str = "greedy") -> dataset.DatasetMeta:
  """A packed dataset: make_synthetic_dataset's layout and tokenizer, the packer's records."""
  make_synthetic_dataset(str(directory), seq_len=SEQ, vocab_size=VOCAB, n_train=4, n_val=4)
  rng = np.random.default_rng(seed)
  splits = {}
  for split, n in (("train", n_train), ("validation", n_val)):
    rows = pack(random_functions(rng, n), mode=mode)
    for old in dataset.DatasetMeta.load(str(directory)).shard_paths(split):
      os.remove(old)
    fname = dataset.shard_filename("synthetic", split, 0, 1)
    info = dataset.write_array_record(os.path.join(directory, fname),
                                      (dataset.encode_record(r) for r in rows))
    splits[split] = [{"file": fname, **info}]
  return dataset.finalize(str(directory), name="synthetic", seq_len=SEQ, vocab_size=VOCAB,
                          special_ids=SPECIAL_IDS, splits=splits,
                          extra={"kind": "synthetic", "packing": mode})


def spans(row: np.ndarray) -> list[tuple[int, int]]:
  """[start, end) of every [CLS] … [SEP] span of a packed record."""
  starts = np.flatnonzero(row == CLS).tolist()
  return [(s, s + int(np.argmax(row[s:] == SEP)) + 1) for s in starts]


def functions_alone(rows: np.ndarray, dtype=np.uint16):
  """Every [CLS] … [SEP] span of ``rows`` alone in its own padded sequence, and where it came
  from: (row, start, end)."""
  alone, where = [], []
  for r, row in enumerate(rows):
    for s, e in spans(row):
      one = np.full(SEQ, PAD, dtype)
      one[:e - s] = row[s:e]
      alone.append(one)
      where.append((r, s, e))
  return alone, where


def model_cfg(packed_attention: str, **model):
  """BERT's position table unless ``positions`` is given (the default on binary code, auto →
  instruction, packs the same way: tests/test_model_variants.py)."""
  model = {"positions": "segment", **model}
  c = make_config(model=dict(layers=2, hidden=32, heads=4, ffn=64, dropout=0.0,
                             dtype="float32", packed_attention=packed_attention, **model))
  return M.resolve_model_config(c.model, dataset.DatasetMeta.synthetic(SEQ, VOCAB))


@pytest.fixture(scope="module")
def params():
  cfg = model_cfg("segment")
  fresh = jax.jit(lambda r: M.init_params(cfg, r))(jax.random.key(3))
  # Perturbed (no zero bias / unit LayerNorm) and larger positions: a leak would show.
  leaves, tree = jax.tree_util.tree_flatten(fresh)
  keys = jax.random.split(jax.random.key(4), len(leaves))
  return jax.tree_util.tree_unflatten(
      tree, [x + 0.2 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def logits_all(cfg, params, ids: np.ndarray) -> np.ndarray:
  """fp32 MLM logits at every position of every row [B,S,V]."""
  positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
  fn = jax.jit(M.BertForMLM(cfg).apply)
  return np.asarray(fn({"params": params}, jnp.asarray(ids, jnp.int32), positions))


# --------------------------------------------------------------------------- the packer
def test_every_packed_function_is_its_own_cls_sep_span_and_split_pieces_one_in_each():
  rng = np.random.default_rng(0)
  functions = random_functions(rng, 60)
  rows = pack(functions)
  pieces = []
  for row in rows:
    found = spans(row)
    assert found[0][0] == 0  # a record starts with [CLS]
    assert all(b == a for (_, a), (b, _) in zip(found, found[1:]))  # spans are contiguous
    assert (row[found[-1][1]:] == PAD).all()
    pieces += [row[s + 1:e - 1] for s, e in found]
    for s, e in found:
      assert not np.isin(row[s + 1:e - 1], [CLS, SEP, PAD]).any()
  # Every function is there whole or as consecutive pieces, each a span of its own.
  expected = sorted(f[i:i + SEQ - 2].tobytes() for f in functions
                    for i in range(0, len(f), SEQ - 2))
  assert sorted(p.tobytes() for p in pieces) == expected
  assert len(pieces) > len(rows) > len(functions) // 20  # packing happened


def test_packing_none_is_byte_identical_to_format_1():
  rng = np.random.default_rng(1)
  rows = pack(random_functions(rng, 20), mode="none")
  for row in rows:  # format 1's `none` records: [CLS] f [SEP] [PAD]…
    (s, e), = spans(row)
    assert s == 0 and (row[e:] == PAD).all()


# --------------------------------------------------------------------------- invariance
def test_segment_logits_of_a_packed_function_equal_its_logits_alone(params):
  """fp32, every token of every function (pieces of split functions included): the logits
  in a packed record equal those of the function alone in its own sequence (max abs diff
  < 1e-5); in "cross" mode they do not (the test can tell)."""
  rows = pack(random_functions(np.random.default_rng(2), 40))[:8]
  alone, where = functions_alone(rows)
  assert len(where) > 2 * len(rows)
  for mode, close in (("segment", True), ("cross", False)):
    cfg = model_cfg(mode)
    packed_logits = logits_all(cfg, params, rows)
    alone_logits = logits_all(cfg, params, np.stack(alone))
    diffs = [np.abs(packed_logits[r, s:e] - alone_logits[i, :e - s]).max()
             for i, (r, s, e) in enumerate(where)]
    if close:
      assert max(diffs) < 1e-5, max(diffs)
    else:  # the first function of a record is unaffected by what follows only with "segment"
      assert np.median(diffs) > 1e-2, np.median(diffs)


def test_one_function_per_row_is_the_same_in_both_modes(params):
  """A `--packing none` dataset behaves identically either way."""
  rows = pack(random_functions(np.random.default_rng(3), 12), mode="none")
  segment = logits_all(model_cfg("segment"), params, rows)
  cross = logits_all(model_cfg("cross"), params, rows)
  for row, a, b in zip(rows, segment, cross):
    n = int((row != PAD).sum())
    np.testing.assert_allclose(a[:n], b[:n], atol=1e-6)


def test_segment_mode_on_a_packing_none_dataset_resolves_to_one_window(tmp_path):
  """Identical computation (above), so the cheaper path: cuDNN keeps its key-length mask."""
  meta = make_packed_dataset(tmp_path / "none", n_train=40, n_val=10, mode="none")
  segment = make_config(model=dict(packed_attention="segment")).model
  assert M.resolve_model_config(segment, meta).packed_attention == "cross"
  packed = make_packed_dataset(tmp_path / "greedy", n_train=40, n_val=10)
  assert M.resolve_model_config(segment, packed).packed_attention == "segment"


def test_masked_loader_batches_keep_the_segments_of_their_records(tmp_path):
  """The model derives segments from the masked ids: [CLS]/[PAD] are never masked nor drawn
  as replacements, so the loader's batches carry the records' segments unchanged."""
  meta = make_packed_dataset(tmp_path / "ds")
  config = make_config(tmp_path / "ds", train=dict(batch_size=16),
                       model=dict(packed_attention="segment"))
  loader = data.make_batch_loader(config, meta, "train", train=True)
  batch = loader(0)
  indices = loader.record_indices(loader.positions(0))
  raw = loader.records.decode(loader.records.read(indices), indices,
                              meta.vocab_size).astype(np.int32)
  assert (batch["input_ids"] != raw).any()  # masking happened
  for fn in (lambda x: M.segment_ids(x, CLS, PAD), lambda x: M.segment_positions(x, CLS)):
    np.testing.assert_array_equal(fn(jnp.asarray(batch["input_ids"])), fn(jnp.asarray(raw)))


# --------------------------------------------------------------------------- datasets
def _as_format_1(meta: dataset.DatasetMeta) -> None:
  path = os.path.join(meta.path, dataset.METADATA)
  raw = dict(meta.raw, format=dataset.FORMAT_1)
  file_io.atomic_write_json(path, raw)


def test_format_1_datasets_load_and_segment_mode_needs_a_cls_per_function(tmp_path):
  greedy = make_packed_dataset(tmp_path / "greedy", n_train=40, n_val=10)
  none = make_packed_dataset(tmp_path / "none", n_train=40, n_val=10, mode="none")
  assert greedy.raw["format"] == dataset.FORMAT == "lmscale_jax.dataset/2"
  _as_format_1(greedy)
  _as_format_1(none)
  old_greedy = dataset.DatasetMeta.load(str(tmp_path / "greedy"))
  old_none = dataset.DatasetMeta.load(str(tmp_path / "none"))
  cross, segment = (make_config(model=dict(packed_attention=m)).model
                    for m in ("cross", "segment"))
  config_checks.check_model_fits_dataset(cross, old_greedy)
  config_checks.check_model_fits_dataset(segment, old_none)  # one function per record: fine
  with pytest.raises(ConfigError, match=r"model.packed_attention='segment' needs a \[CLS\] "
                     r"before every packed function.*greedy.*metadata.json.*"
                     r"lmscale_jax.dataset/1.*re-prepare.*packed_attention=cross"):
    config_checks.check_model_fits_dataset(segment, old_greedy)
  raw = dict(old_greedy.raw, format="lmscale_jax.dataset/0")
  file_io.atomic_write_json(os.path.join(old_greedy.path, dataset.METADATA), raw)
  with pytest.raises(dataset.DatasetError, match="format 'lmscale_jax.dataset/0'.*re-prepare"):
    dataset.DatasetMeta.load(str(tmp_path / "greedy"))


def test_bad_packed_attention_value_is_named():
  with pytest.raises(ConfigError, match=r"model.packed_attention='segments': expected one of "
                     r"\['segment', 'cross'\]"):
    config_checks.check_config(make_config(model=dict(packed_attention="segments")))


# --------------------------------------------------------------------------- runs
@pytest.fixture(scope="module")
def packed(tmp_path_factory):
  return make_packed_dataset(tmp_path_factory.mktemp("pdata") / "ds").path


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  return tmp_path_factory.mktemp("xla_cache")


def segment_args(data_path, workdir):
  return run_args(data_path, workdir, **{"model.packed_attention": "segment"})


@pytest.fixture(scope="module")
def reference(packed, cache, tmp_path_factory):
  """One uninterrupted 1-process segment-mode run."""
  workdir = tmp_path_factory.mktemp("pref") / "w"
  run(segment_args(packed, workdir), cache)
  with open(workdir / "config.json") as f:
    assert json.load(f)["config"]["model"]["packed_attention"] == "segment"
  return workdir


def test_segment_mode_two_processes_match_one(packed, reference, tmp_path):
  result = local_sh(2, segment_args(packed, tmp_path / "w2"), timeout=240)
  assert result.returncode == 0, result.stderr[-5000:]
  one, two = series(reference), series(tmp_path / "w2")
  assert sorted(two) == sorted(one)
  np.testing.assert_allclose([two[s] for s in one], [one[s] for s in one], rtol=1e-5)
  ev1, ev2 = series(reference, "eval_loss"), series(tmp_path / "w2", "eval_loss")
  assert ev1 and sorted(ev2) == sorted(ev1)
  np.testing.assert_allclose([ev2[s] for s in ev1], [ev1[s] for s in ev1], rtol=1e-5)


def test_segment_mode_kill9_between_checkpoints_resumes_bitwise(packed, cache, reference,
                                                               tmp_path):
  workdir = tmp_path / "w"
  p = start(segment_args(packed, workdir), cache)
  try:
    wait_for(p, lambda: last_step(workdir) >= 6 and not saving(workdir), poll=0.002)
    kill(p)
  finally:
    kill(p)
    p.communicate()
  killed_at = last_step(workdir)
  assert killed_at < max(series(reference))
  run(segment_args(packed, workdir), cache)
  for key in ("loss", "mlm_accuracy", "eval_loss"):
    assert series(workdir, key) == series(reference, key), (key, killed_at)

