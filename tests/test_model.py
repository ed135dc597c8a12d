"""BERT model, FLOPs/param accounting and config files."""

from __future__ import annotations

import importlib.machinery
import os
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from lmscale_jax.model import bert as M
from lmscale_jax.model import flops
from lmscale_jax.store import dataset
from tests.helpers import ROOT, SPECIAL_IDS, make_config

CONFIGS = ("tiny", "bert120m", "bert350m", "undertale_medium")
PAD = SPECIAL_IDS["[PAD]"]


def fake_meta(seq_len=16, vocab_size=64, path="/data/ds"):
  return dataset.DatasetMeta(path=path, name="t", seq_len=seq_len, vocab_size=vocab_size,
                             special_ids=dict(SPECIAL_IDS), splits={}, raw={})


def small_cfg(remat="none", meta=None, **overrides):
  model = make_config(model={**dict(layers=2, hidden=32, heads=4, ffn=64, dropout=0.0,
                                    dtype="float32"), **overrides}).model
  return M.resolve_model_config(model, meta or fake_meta(), remat=remat)


def random_batch(cfg, b=3, p=5, seed=1, pad_from=12):
  rng = np.random.default_rng(seed)
  ids = rng.integers(len(SPECIAL_IDS), cfg.vocab_size, (b, cfg.seq_len)).astype(np.int32)
  ids[:, pad_from:] = PAD
  positions = rng.integers(0, pad_from, (b, p)).astype(np.int32)
  return jnp.asarray(ids), jnp.asarray(positions)


def apply(cfg, params, ids, positions, deterministic=True, rngs=None):
  # One compilation per config is much cheaper on CPU than op-by-op dispatch.
  return _jitted_apply(cfg)({"params": params}, ids, positions, deterministic=deterministic,
                            rngs=rngs)


_JITTED = {}


def _jitted_apply(cfg):
  key = repr(sorted(cfg.to_dict().items()))
  if key not in _JITTED:
    _JITTED[key] = jax.jit(M.BertForMLM(cfg).apply, static_argnames="deterministic")
  return _JITTED[key]


def flat_names(tree) -> list[str]:
  return ["/".join(str(k.key) for k in path)
          for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


@pytest.fixture(scope="module")
def cfg():
  return small_cfg()


def init(cfg):
  # Jitted: op-by-op initialization is many times slower on CPU.
  return jax.jit(lambda r: M.init_params(cfg, r))(jax.random.key(0))


@pytest.fixture(scope="module")
def params(cfg):
  # dtype, dropout, remat and attention settings do not change parameter shapes, so the
  # variants below share these parameters.
  return init(cfg)


# --------------------------------------------------------------------------- forward pass
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shapes_and_dtypes(dtype, params):
  cfg = small_cfg(dtype=dtype)
  assert {x.dtype for x in jax.tree_util.tree_leaves(params)} == {jnp.dtype("float32")}
  ids, positions = random_batch(cfg, b=3, p=5)
  logits = apply(cfg, params, ids, positions)
  assert logits.shape == (3, 5, cfg.vocab_size)
  assert logits.dtype == jnp.float32
  assert np.isfinite(np.asarray(logits)).all()


def test_bfloat16_close_to_float32(params):
  cfg32, cfg16 = small_cfg(), small_cfg(dtype="bfloat16")
  ids, positions = random_batch(cfg32)
  a = apply(cfg32, params, ids, positions)
  b = apply(cfg16, params, ids, positions)
  assert float(jnp.std(a)) > 0.05
  np.testing.assert_allclose(a, b, atol=5e-3)


def test_padding_does_not_affect_real_positions(cfg, params):
  ids, positions = random_batch(cfg, pad_from=10)
  padded = apply(cfg, params, ids, positions)
  # The same real tokens with no padding at all (positions are absolute, so identical).
  unpadded = apply(cfg, params, ids[:, :10], positions)
  np.testing.assert_allclose(padded, unpadded, atol=1e-5)
  # Moving the padding boundary changes real positions: the mask is what isolates them.
  more = apply(cfg, params, ids.at[:, 10].set(7), positions)
  assert not np.allclose(padded, more, atol=1e-5)


def test_logits_only_at_requested_positions(cfg, params):
  ids, positions = random_batch(cfg, b=3, p=5)
  every = jnp.broadcast_to(jnp.arange(cfg.seq_len, dtype=jnp.int32), (3, cfg.seq_len))
  full = apply(cfg, params, ids, every)
  some = apply(cfg, params, ids, positions)
  assert some.shape == (3, 5, cfg.vocab_size)
  np.testing.assert_allclose(some, np.take_along_axis(np.asarray(full),
                                                      np.asarray(positions)[..., None], 1),
                             atol=1e-5)


def test_decoder_is_tied_to_word_embeddings(cfg, params):
  assert not any("decoder" in n for n in flat_names(params))
  ids, positions = random_batch(cfg)
  unused = next(v for v in range(len(SPECIAL_IDS), cfg.vocab_size)
                if v not in np.asarray(ids))
  emb = params["embeddings"]["word_embeddings"]["embedding"]
  bumped = jax.tree_util.tree_map(lambda x: x, params)
  # Not a constant shift: the head's LayerNorm output has zero mean, so a constant would cancel.
  bumped["embeddings"]["word_embeddings"]["embedding"] = emb.at[unused].add(
      jax.random.normal(jax.random.key(9), (cfg.hidden,)))
  a, b = apply(cfg, params, ids, positions), apply(cfg, bumped, ids, positions)
  changed = ~np.isclose(a, b, atol=1e-6).all(axis=(0, 1))
  assert changed[unused] and changed.sum() == 1  # only that token's output logit moved


def test_dropout_needs_and_uses_rng(params):
  cfg = small_cfg(dropout=0.1, attention_dropout=0.1)
  ids, positions = random_batch(cfg)
  det = apply(cfg, params, ids, positions, deterministic=True)
  np.testing.assert_allclose(det, apply(small_cfg(), params, ids, positions), atol=1e-6)
  r1 = apply(cfg, params, ids, positions, deterministic=False,
             rngs={"dropout": jax.random.key(1)})
  r2 = apply(cfg, params, ids, positions, deterministic=False,
             rngs={"dropout": jax.random.key(2)})
  assert not np.allclose(r1, r2) and not np.allclose(r1, det)


def test_explicit_attention_matches_fused():
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (2, 8, 4, 16)) for key in (k1, k2, k3))
  mask = jnp.arange(8)[None, :] < jnp.array([[5], [8]])
  attend = jax.jit(M.dot_product_attention, static_argnames="impl")
  fused = attend(q, k, v, mask, impl="xla")
  explicit = attend(q, k, v, mask, impl="explicit")
  np.testing.assert_allclose(fused, explicit, atol=1e-5)


@pytest.mark.skipif(jax.default_backend() != "gpu",
                    reason="cuDNN attention needs a GPU (run with JAX_PLATFORMS=cuda)")
@pytest.mark.parametrize("cudnn_mask", M.CUDNN_MASKS)
def test_cudnn_attention_matches_xla(cudnn_mask):
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (2, 128, 4, 64), jnp.bfloat16) for key in (k1, k2, k3))
  mask = jnp.arange(128)[None, :] < jnp.array([[100], [128]])
  cudnn = M.dot_product_attention(q, k, v, mask, impl="cudnn", cudnn_mask=cudnn_mask)
  xla = M.dot_product_attention(q, k, v, mask, impl="xla")
  np.testing.assert_allclose(np.asarray(cudnn, np.float32), np.asarray(xla, np.float32),
                             atol=2e-2)


# Two packed rows (segments 1,2,3 then 1,2) with trailing [PAD]: the segment-mode attention
# tests' input, as model.segment_ids gives it.
def packed_segments(s=128):
  ids = np.full((2, s), 9, np.int32)
  ids[0, [0, 40, 90]] = SPECIAL_IDS["[CLS]"]
  ids[1, [0, 70]] = SPECIAL_IDS["[CLS]"]
  ids[0, 120:] = PAD
  ids[1, 100:] = PAD
  return M.segment_ids(jnp.asarray(ids), SPECIAL_IDS["[CLS]"], PAD)


def qkv(shape, dtype=jnp.float32):
  keys = jax.random.split(jax.random.key(0), 3)
  return [jax.random.normal(key, shape, dtype) for key in keys]


def test_segment_ids_positions_and_block_diagonal_mask():
  cls = SPECIAL_IDS["[CLS]"]
  ids = jnp.array([[cls, 7, 8, 3, cls, 9, 3, PAD, PAD], [7, 8, cls, 9, 9, 9, 3, cls, 3]])
  seg = M.segment_ids(ids, cls, PAD)
  np.testing.assert_array_equal(seg, [[1, 1, 1, 1, 2, 2, 2, 0, 0], [1, 1, 2, 2, 2, 2, 2, 3, 3]])
  np.testing.assert_array_equal(M.segment_positions(ids, cls),
                                [[0, 1, 2, 3, 0, 1, 2, 3, 4], [0, 1, 0, 1, 2, 3, 4, 0, 1]])
  mask = np.asarray(M.segment_mask(seg))
  assert mask.shape == (2, 1, 9, 9)
  np.testing.assert_array_equal(mask[0, 0, 4], [0, 0, 0, 0, 1, 1, 1, 0, 0])
  np.testing.assert_array_equal(mask[0, 0, 8], [0, 0, 0, 0, 0, 0, 0, 1, 1])  # [PAD] → [PAD]


def test_segment_attention_is_attention_over_each_segment_alone():
  q, k, v = qkv((2, 128, 4, 16))
  seg = packed_segments()
  attend = jax.jit(M.dot_product_attention, static_argnames="impl")
  xla = np.asarray(attend(q, k, v, seg > 0, impl="xla", segments=seg))
  explicit = attend(q, k, v, seg > 0, impl="explicit", segments=seg)
  np.testing.assert_allclose(xla, explicit, atol=1e-5)
  for row, (a, b) in ((0, (40, 90)), (1, (70, 100))):  # one segment through the plain path
    sl = slice(a, b)
    alone = attend(q[row:row + 1, sl], k[row:row + 1, sl], v[row:row + 1, sl],
                   jnp.ones((1, b - a), bool), impl="xla")
    np.testing.assert_allclose(xla[row, sl], alone[0], atol=1e-5)


def test_pallas_segment_attention_matches_xla_values_and_gradients():
  """The Pallas flash kernel (interpreted off GPU) against the dense-mask XLA path."""
  q, k, v = qkv((2, 128, 2, 16))
  seg = packed_segments()
  real = np.asarray(seg > 0)[:, :, None, None]

  def loss(impl):
    return lambda q, k, v: jnp.sum(jnp.where(real, M.dot_product_attention(
        q, k, v, seg > 0, impl=impl, segments=seg), 0.0) ** 2)

  pallas = jax.jit(jax.value_and_grad(loss("pallas"), argnums=(0, 1, 2)))(q, k, v)
  xla = jax.jit(jax.value_and_grad(loss("xla"), argnums=(0, 1, 2)))(q, k, v)
  np.testing.assert_allclose(pallas[0], xla[0], rtol=1e-5)
  for a, b in zip(pallas[1], xla[1]):
    np.testing.assert_allclose(a, b, atol=1e-4)


@pytest.mark.skipif(jax.default_backend() != "gpu",
                    reason="cuDNN / Pallas GPU attention needs a GPU (JAX_PLATFORMS=cuda)")
@pytest.mark.parametrize("impl", ["cudnn", "pallas"])
def test_gpu_segment_attention_matches_xla(impl):
  q, k, v = qkv((2, 128, 4, 64), jnp.bfloat16)
  seg = packed_segments()
  real = np.asarray(seg > 0)[:, :, None, None]
  out = M.dot_product_attention(q, k, v, seg > 0, impl=impl, segments=seg)
  xla = M.dot_product_attention(q, k, v, seg > 0, impl="xla", segments=seg)
  diff = np.where(real, np.abs(np.asarray(out, np.float32) - np.asarray(xla, np.float32)), 0)
  assert diff.max() < 2e-2, diff.max()


def test_attention_impl_selection():
  assert M.attention_impl(small_cfg(attention_impl="xla"), deterministic=False) == "xla"
  assert M.attention_impl(small_cfg(attention_dropout=0.1), deterministic=False) == "explicit"
  assert M.attention_impl(small_cfg(attention_dropout=0.1), deterministic=True) != "explicit"
  if jax.default_backend() == "cpu":
    assert M.attention_impl(small_cfg(dtype="bfloat16"), deterministic=False) == "xla"
    assert M.attention_impl(small_cfg(dtype="bfloat16", packed_attention="segment"),
                            deterministic=False) == "xla"
  assert M.attention_impl(small_cfg(attention_impl="pallas"), deterministic=True) == "pallas"


def test_pre_ln_variant_runs_and_has_final_layernorm(params):
  cfg = small_cfg(norm="pre")
  shapes = jax.eval_shape(lambda r: M.init_params(cfg, r), jax.random.key(0))
  assert set(shapes) == set(params) | {"final_LayerNorm"}
  params = dict(params, final_LayerNorm={"scale": jnp.ones(cfg.hidden),
                                         "bias": jnp.zeros(cfg.hidden)})
  ids, positions = random_batch(cfg)
  assert np.isfinite(np.asarray(apply(cfg, params, ids, positions))).all()


def test_init_params_is_eval_shape_friendly(cfg, params):
  shapes = jax.eval_shape(lambda r: M.init_params(cfg, r), jax.random.key(0))
  assert jax.tree_util.tree_map(lambda s: s.shape, shapes) == \
      jax.tree_util.tree_map(lambda x: x.shape, params)
  w = params["layer_0"]["query"]["kernel"]
  assert abs(float(jnp.std(w)) - cfg.initializer_range) < 0.005
  assert not np.asarray(params["layer_0"]["query"]["bias"]).any()
  np.testing.assert_array_equal(params["layer_0"]["output_LayerNorm"]["scale"], 1.0)


# --------------------------------------------------------------------------- remat
def test_remat_policies_give_identical_loss_and_grads():
  # One layer keeps compilation (three value_and_grad programs) short; remat wraps each layer.
  params = init(small_cfg(layers=1))
  ids, positions = random_batch(small_cfg())
  labels = jnp.asarray(np.random.default_rng(3).integers(0, 64, positions.shape), jnp.int32)

  def loss_and_grads(remat):
    cfg = small_cfg(remat=remat, dropout=0.1, layers=1)

    def loss(p):
      logits = apply(cfg, p, ids, positions, deterministic=False,
                     rngs={"dropout": jax.random.key(5)})
      logp = jax.nn.log_softmax(logits)
      return -jnp.take_along_axis(logp, labels[..., None], -1).mean()

    return jax.jit(jax.value_and_grad(loss))(params)

  ref_loss, ref_grads = loss_and_grads("none")
  for remat in ("dots", "full"):
    l, g = loss_and_grads(remat)
    np.testing.assert_allclose(l, ref_loss, rtol=1e-6, atol=1e-6)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6),
                           g, ref_grads)


# --------------------------------------------------------------------------- accounting
@pytest.mark.parametrize("overrides", [{}, {"norm": "pre"}, {"positions": "instruction"}, {"layers": 3, "ffn": 48}])
def test_analytic_param_count(overrides):
  cfg = small_cfg(**overrides)
  shapes = jax.eval_shape(lambda r: M.init_params(cfg, r), jax.random.key(0))
  assert flops.count_params_from_config(cfg) == flops.param_count(shapes)


@pytest.mark.parametrize("name,lo,hi", [("bert120m", 100e6, 130e6), ("bert350m", 320e6, 370e6),
                                         ("undertale_medium", 105e6, 115e6)])
def test_named_configs_have_their_size(name, lo, hi):
  c = load_config(name)
  cfg = M.resolve_model_config(c.model, fake_meta(seq_len=512, vocab_size=30522),
                               remat=c.train.remat)
  shapes = jax.eval_shape(lambda r: M.init_params(cfg, r), jax.random.key(0))
  n = flops.param_count(shapes)
  assert n == flops.count_params_from_config(cfg)
  assert lo < n < hi


def test_flops_formula_hand_computed():
  cfg = small_cfg(meta=fake_meta(seq_len=3, vocab_size=10), layers=2, hidden=4, heads=1, ffn=8)
  # encoder 6·L·(4H²+2HF)·S = 6·2·(64+64)·3 = 4608; attention 3·(2·2·S²·H)·L = 12·9·4·2 = 864;
  # head 6·P·(H²+H·V) = 6·2·(16+40) = 672.
  assert flops.train_flops_per_sequence(cfg, seq_len=3, num_predictions=2) == 4608 + 864 + 672
  assert flops.train_flops_per_step(cfg, 5, 3, 2) == 5 * 6144


def test_memory_estimate_is_plausible():
  est = {r: flops.memory_estimate_bytes(small_cfg(remat=r, layers=6), 8, 16, 3)
         for r in ("none", "dots", "full")}
  state = 16 * flops.count_params_from_config(small_cfg(layers=6))
  assert state < est["full"] < est["dots"] < est["none"]
  big = flops.memory_estimate_bytes(small_cfg(layers=6), 16, 16, 3)
  assert big > est["none"]


@pytest.mark.parametrize("kind,tflops", [
    ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H200", 989), ("NVIDIA H100 PCIe", 756),
    ("NVIDIA H100 NVL", 835), ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA A100-PCIE-40GB", 312),
    ("NVIDIA GH200 480GB", 989)])
def test_device_peak_flops(kind, tflops):
  assert flops.device_peak_flops(kind) == tflops * 1e12


def test_device_peak_flops_unknown_and_override():
  assert flops.device_peak_flops("cpu") is None
  assert flops.device_peak_flops("NVIDIA GeForce RTX 3090") is None
  assert flops.device_peak_flops("cpu", override_tflops=2.5) == 2.5e12
  assert flops.device_peak_flops("NVIDIA A100-SXM4-40GB", dtype="float32") == 156e12


# --------------------------------------------------------------------------- configs
def load_config(name: str) -> ml_collections.ConfigDict:
  """Loads configs/<name>.py the way ml_collections.config_flags does: by path, outside any
  package (here from another working directory)."""
  path = os.path.join(ROOT, "configs", f"{name}.py")
  cwd = os.getcwd()
  os.chdir("/")
  try:
    module = importlib.machinery.SourceFileLoader(f"config_{name}", path).load_module()
  finally:
    os.chdir(cwd)
  return module.get_config()


def design_config_keys() -> list[str]:
  """Every key documented in docs/design.md's config block, as section.key."""
  with open(os.path.join(ROOT, "docs", "design.md")) as f:
    text = f.read()
  block = text.split("## Config", 1)[1].split("```", 2)[1]
  keys = []
  for line in block.splitlines()[1:]:
    head = re.split(r"\s{2,}", line.strip())[0]
    if not head:
      continue
    if "." not in head.split()[0]:  # a top-level key (init_from)
      keys.append(head.split()[0])
      continue
    section, rest = head.split(".", 1)
    for key in rest.split(","):
      key = re.sub(r"\(.*?\)", "", key).strip()
      if key:
        keys.append(f"{section}.{key}")
  return keys


def test_design_key_parser_sees_the_documented_keys():
  keys = design_config_keys()
  for k in ("data.path", "model.norm", "model.positions", "model.type_vocab_size", "train.eval_batches",
            "checkpoint.async_save", "metrics.peak_tflops"):
    assert k in keys
  assert len(keys) == len(set(keys)) >= 39


@pytest.mark.parametrize("name", CONFIGS)
def test_config_has_every_design_key(name):
  c = load_config(name)
  for key in design_config_keys() + ["train.remat", "train.grad_accum_steps",
                                     "train.nonfinite", "model.attention_impl"]:
    section, _, leaf = key.rpartition(".")
    assert leaf in (c[section] if section else c), f"configs/{name}.py lacks {key}"
  assert c.train.remat in M.REMAT_POLICIES and c.model.dtype in M.DTYPES
  assert c.model.attention_dropout == 0.0  # keeps training on the fused attention path


def test_tiny_config_builds_a_model_from_dataset_metadata():
  c = load_config("tiny")
  assert c.model.seq_len == 0 and c.model.vocab_size == 0 and c.model.dtype == "float32"
  cfg = M.resolve_model_config(c.model, fake_meta(seq_len=128, vocab_size=500),
                               remat=c.train.remat)
  assert (cfg.seq_len, cfg.vocab_size, cfg.pad_id, cfg.remat) == (128, 500, PAD, "none")
  shapes = jax.eval_shape(lambda r: M.init_params(cfg, r), jax.random.key(0))
  # Binary-code metadata: the default positions (auto) are undertale's two [S, H] tables.
  assert cfg.positions == "instruction" and "position_embeddings" not in shapes["embeddings"]
  for table in ("instruction_embeddings", "argument_embeddings"):
    assert shapes["embeddings"][table]["embedding"].shape == (128, 128)


def test_resolve_model_config_mismatch_names_everything():
  model = load_config("bert120m").model
  with pytest.raises(ValueError) as e:
    M.resolve_model_config(model, fake_meta(seq_len=128, vocab_size=30522, path="/data/wiki"))
  msg = str(e.value)
  for part in ("model.seq_len=512", "seq_len=128", "/data/wiki/metadata.json"):
    assert part in msg
  model.vocab_size = 100
  with pytest.raises(ValueError, match="model.vocab_size=100 .*vocab_size=30522"):
    M.resolve_model_config(model, fake_meta(seq_len=512, vocab_size=30522))


def test_resolve_model_config_validates():
  with pytest.raises(ValueError, match="divisible"):
    small_cfg(heads=5)
  with pytest.raises(ValueError, match="train.remat"):
    small_cfg(remat="some")
  with pytest.raises(ValueError, match="model.dtype"):
    small_cfg(dtype="float16")
