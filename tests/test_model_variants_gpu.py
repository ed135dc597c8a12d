"""undertale's variant (model.positions="instruction", model.norm="pre") on the GPU: a bf16
loss-and-gradient step with cuDNN attention against XLA's, on packed rows of functions made of
[NEXT]-separated instructions (segment windows: cuDNN takes the block-diagonal mask as its bias).

GPU-only (tools/bench_gpu.sh runs it on the lent GPU); ``LMSCALE_GPU_TESTS_ON_CPU=1`` runs the
code path on the CPU (XLA against itself: no cuDNN there). Synthetic rows, few imports: the GPU
image has no compiler, no prepared dataset, no tokenizer library to rely on.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmscale_jax.model import bert as M
from lmscale_jax.store import dataset
from tests.helpers import SPECIAL_IDS, make_config

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "gpu" and not os.environ.get("LMSCALE_GPU_TESTS_ON_CPU"),
    reason="cuDNN attention needs a GPU (LMSCALE_GPU_TESTS_ON_CPU=1 runs the code path on the "
           "CPU, XLA against itself)")

CLS, SEP, PAD, NEXT = (SPECIAL_IDS[t] for t in ("[CLS]", "[SEP]", "[PAD]", "[NEXT]"))
SEQ, VOCAB, ROWS = 128, 512, 8


def packed_rows(rng) -> np.ndarray:
  """[ROWS, SEQ] rows of whole functions ``[CLS] i1 [NEXT] i2 … [SEP]`` (1-8 instructions of
  1-4 tokens), packed greedily, [PAD] after the last one that fits."""
  rows = np.full((ROWS, SEQ), PAD, np.int32)
  for row in rows:
    at = 0
    while True:
      instructions = [rng.integers(len(SPECIAL_IDS), VOCAB, int(rng.integers(1, 5))).tolist()
                      for _ in range(int(rng.integers(1, 9)))]
      ids = [CLS, *sum((ins + [NEXT] for ins in instructions), [])[:-1], SEP]
      if at + len(ids) > SEQ:
        break
      row[at:at + len(ids)] = ids
      at += len(ids)
  return rows


def loss_and_grads(impl: str, rows, positions, labels):
  model = make_config(model=dict(layers=2, hidden=128, heads=2, ffn=256, dropout=0.0,
                                 dtype="bfloat16", attention_impl=impl, positions="instruction",
                                 norm="pre")).model
  cfg = M.resolve_model_config(model, dataset.DatasetMeta.synthetic(SEQ, VOCAB))
  assert cfg.packed_attention == "segment"
  params = jax.jit(lambda r: M.init_params(cfg, r))(jax.random.key(0))

  def loss(p):
    logits = M.BertForMLM(cfg).apply({"params": p}, jnp.asarray(rows), jnp.asarray(positions))
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.take_along_axis(logp, jnp.asarray(labels)[..., None], -1).mean()

  return jax.jit(jax.value_and_grad(loss))(params)


def test_bf16_undertale_step_with_cudnn_attention_matches_xla():
  """The loss within 2e-2 relative, the gradients within 5e-2 (the global norm of the
  difference over the reference's): bfloat16 rounding, as tests/test_model.py's cuDNN tests
  (atol 2e-2 on attention outputs)."""
  rng = np.random.default_rng(5)
  rows = packed_rows(rng)
  assert (np.sum(rows == CLS, axis=1) > 1).all()  # several functions in every row
  positions = rng.integers(0, SEQ // 2, (ROWS, 12)).astype(np.int32)
  labels = rng.integers(0, VOCAB, positions.shape).astype(np.int32)
  other = "cudnn" if jax.default_backend() == "gpu" else "xla"
  ref_loss, ref_grads = loss_and_grads("xla", rows, positions, labels)
  got_loss, got_grads = loss_and_grads(other, rows, positions, labels)
  assert np.isfinite(float(got_loss))
  assert float(got_loss) == pytest.approx(float(ref_loss), rel=2e-2)
  diff = sum(float(jnp.sum((a.astype(jnp.float32) - b.astype(jnp.float32)) ** 2))
             for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(ref_grads)))
  norm = sum(float(jnp.sum(b.astype(jnp.float32) ** 2)) for b in jax.tree.leaves(ref_grads))
  assert norm > 0 and np.sqrt(diff / norm) < 5e-2, np.sqrt(diff / norm)
