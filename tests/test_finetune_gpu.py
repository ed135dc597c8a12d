"""Fine-tuning's GPU path: the contrastive task through the one train step in bfloat16, with
the levers (manual path, GradCache accumulation, remat), and the naming task's bf16 step, on
whatever accelerator is there.

GPU-only (tools/bench_gpu.sh runs it on the lent GPU); ``LMSCALE_GPU_TESTS_ON_CPU=1`` runs it
on the CPU too, which checks the code path but not the GPU's numerics. Synthetic pairs (no
compiler, no pretrained run): the GPU image has neither.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from lmscale_jax.config import defaults as config_defaults
from lmscale_jax.finetune import contrastive_run as finetune
from lmscale_jax.model import bert as model_lib
from lmscale_jax.store import dataset
from lmscale_jax.train import sharding

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "gpu" and not os.environ.get("LMSCALE_GPU_TESTS_ON_CPU"),
    reason="fine-tuning's bf16 path on a GPU (LMSCALE_GPU_TESTS_ON_CPU=1 forces it on the CPU)")

SEQ, VOCAB, BATCH, STEPS = 128, 512, 32, 6


def _config(dtype: str, **train_kw):
  c = finetune.get_config()
  c.data.pairs, c.init.path = "<synthetic>", "<synthetic>"
  c.finetune.update(dropout=0.0, proj_dim=64, dtype=dtype)
  c.train.update(batch_size=BATCH, learning_rate=1e-3, warmup_steps=1, steps=STEPS, **train_kw)
  return c


def _pairs(seed: int = 0) -> np.ndarray:
  """[STEPS, B, 2, S] ids: each pair is one random sequence and a copy with 10% of its tokens
  changed (a learnable notion of "the same function"), padded after a random length."""
  rng = np.random.default_rng(seed)
  a = rng.integers(6, VOCAB, (STEPS, BATCH, SEQ))
  b = np.where(rng.random(a.shape) < 0.1, rng.integers(6, VOCAB, a.shape), a)
  ids = np.stack([a, b], axis=2)
  ids[..., 0] = 2  # [CLS]
  lengths = rng.integers(SEQ // 2, SEQ + 1, (STEPS, BATCH, 1, 1))
  return np.where(np.arange(SEQ) < lengths, ids, 0).astype(np.int32)


def _train(dtype: str, manual=None, **train_kw) -> list[float]:
  c = _config(dtype, **train_kw)
  base = config_defaults.get_base_config().model
  base.update(layers=2, hidden=128, heads=4, ffn=512, seq_len=SEQ, vocab_size=VOCAB)
  cfg = model_lib.resolve_model_config(base, dataset.DatasetMeta.synthetic(SEQ, VOCAB))
  cfg = finetune.finetune_cfg(c, cfg)
  steps = finetune.build_steps(c, cfg, sharding.data_mesh(), manual=manual)
  bert = model_lib.init_params(cfg, jax.random.key(0))
  state = steps.init(finetune.place(bert, steps.state_sharding.params["bert"]),
                     jax.random.key(1))
  losses = []
  for ids in _pairs():
    state, metrics = steps.train_step(state, jax.device_put(ids, steps.batch_sharding))
    losses.append(float(metrics["loss"]))
  return losses


@pytest.fixture(scope="module")
def float32_losses():
  return _train("float32")


def _tracks(losses, reference) -> None:
  """Learns (the last loss under half the first) and follows ``reference`` over the first
  steps; later the loss falls steeply (3.16 -> 0.18 in 6 steps) and rounding differences move
  the trajectories apart (measured on the CPU, forced: 12% at step 6, under 1% to step 4)."""
  assert all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0], losses
  np.testing.assert_allclose(losses[:4], reference[:4], rtol=3e-2)


def test_bf16_finetuning_learns_and_tracks_float32(float32_losses):
  _tracks(_train("bfloat16"), float32_losses)


def test_bf16_gradcache_accumulation_and_remat_track_the_plain_bf16_step():
  plain = _train("bfloat16")
  _tracks(_train("bfloat16", grad_accum_steps=2, remat="full"), plain)


def test_bf16_manual_path_with_a_bf16_reduction_tracks_the_plain_step(float32_losses):
  _tracks(_train("bfloat16", manual=True, grad_allreduce_dtype="bfloat16"), float32_losses)


# ----------------------------------------------------------------------------- naming (--task name)
NAME_TOKENS = 32


def _names() -> tuple[np.ndarray, np.ndarray]:
  """[STEPS, B, S] ids and [STEPS, B, V] targets: token v is in a row's "name" when id 6 + v
  occurs in its code (learnable through mean pooling, as a real name's tokens follow its code)."""
  ids = _pairs(1)[:, :, 0]
  present = (ids[..., None] == 6 + np.arange(NAME_TOKENS)).any(axis=2)
  return ids, present.astype(np.float32)


def _train_names(dtype: str) -> list[float]:
  from lmscale_jax.finetune import name_run

  c = _config(dtype)
  c.finetune.task = "name"
  base = config_defaults.get_base_config().model
  base.update(layers=2, hidden=128, heads=4, ffn=512, seq_len=SEQ, vocab_size=VOCAB)
  cfg = finetune.finetune_cfg(c, model_lib.resolve_model_config(
      base, dataset.DatasetMeta.synthetic(SEQ, VOCAB)))
  ids, targets = _names()
  steps = name_run.build_steps(c, cfg, targets.reshape(-1, NAME_TOKENS).mean(0),
                               sharding.data_mesh())
  bert = model_lib.init_params(cfg, jax.random.key(0))
  state = steps.init(finetune.place(bert, steps.state_sharding.params["bert"]),
                     jax.random.key(1))
  losses = []
  for x, y in zip(ids, targets):
    batch = jax.device_put({"ids": x, "targets": y}, steps.batch_sharding)
    state, metrics = steps.train_step(state, batch)
    losses.append(float(metrics["loss"]))
  return losses


def test_bf16_naming_step_tracks_float32():
  """The naming head's bf16 path (its logits and loss in float32: name_run.naming_task) follows
  the float32 one. Six random batches teach it little (forced on the CPU: 15.1 -> 15.2), so
  what is checked is the path: finite, and bf16's losses those of float32."""
  reference, losses = _train_names("float32"), _train_names("bfloat16")
  assert all(np.isfinite(losses)), losses
  np.testing.assert_allclose(losses[:4], reference[:4], rtol=3e-2)
