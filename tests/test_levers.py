"""Memory and communication levers (train.remat, grad_accum_steps, fsdp, grad_allreduce_dtype,
grad_allreduce) against the plain step: same losses, less memory, fewer collectives; FSDP
state through an Orbax checkpoint; config validation.

The multi-device checks run once, in one subprocess with 4 CPU devices (the device count is
fixed when jax starts); each variant trains the same 4 batches from the same initial state.
Tolerances (float32 compute, dropout 0): variants that only reorder float32 sums (remat,
accumulation, FSDP, the shard_map path) agree with the plain step to 2e-6 relative on every
loss and 2e-6 absolute on every parameter after 4 AdamW steps (measured: <= 2e-7 and
<= 2.4e-7); a bfloat16 gradient reduction rounds each gradient to 8 mantissa bits before the
sum: losses within 1e-4 relative (measured 3e-6), parameters visibly different (~2.6e-3).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.helpers import ROOT, make_synthetic_dataset
from tests.helpers import small_train_config as small_config

LOSS_RTOL = 2e-6
PARAM_ATOL = 2e-6
BF16_LOSS_RTOL = 1e-4

# Runs in a fresh interpreter with JAX_NUM_CPU_DEVICES=4; argv: dataset, workdir.
_LEVERS = r"""
import json, sys
import jax, numpy as np
from tests.helpers import small_train_config as small_config
from lmscale_jax.input import grain_pipeline as data_lib, prefetch
from lmscale_jax.model import flops
from lmscale_jax.train import checkpoint as ckpt_lib, sharding, steps as steps_lib
from lmscale_jax.pretrain import mlm
from lmscale_jax.pretrain import trainer as train

data, workdir = sys.argv[1:3]
assert jax.device_count() == 4
BATCH = 64  # 16 sequences per device: activations outweigh the state, as in real runs

def config(**train_kw):
  c = small_config(data, batch_size=BATCH, learning_rate=1e-2, warmup_steps=1)
  for k, v in train_kw.items():
    c.train[k] = v
  return c

base = config()
setup = train.build_setup(base)
meta = setup.meta
host_batches = [b for _, b in zip(range(4), iter(data_lib.make_dataset(base, meta, "train",
                                                                       train=True)))]
init_state = None

def run(name, **kw):
  global init_state
  c = config(**kw)
  s = train.build_setup(c, meta)
  st = mlm.build_steps(c, s.model_cfg, s.predictions)
  if init_state is None:  # one initialization for every variant (same values, host copy)
    init_state = jax.device_get(st.init(jax.random.key(c.train.seed)))
  # One compilation serves both the memory analysis and the run.
  abstract_b = flops.abstract_batch(BATCH, s.meta.seq_len, s.predictions, st.batch_sharding)
  step = st.train_step.lower(st.abstract_state, abstract_b).compile()
  mem = step.memory_analysis()
  # Collectives of the step (lowered StableHLO): one per reduced leaf, or one for them all.
  all_reduces = st.train_step.lower(st.abstract_state, abstract_b).as_text().count(
      "stablehlo.all_reduce")
  state = jax.device_put(init_state, st.state_sharding)
  losses = []
  for hb in host_batches:
    b = jax.tree.map(lambda x: jax.make_array_from_process_local_data(st.batch_sharding, x), hb)
    state, m = step(state, b)
    losses.append(float(m["loss"]))
  leaves = jax.tree.leaves(state.params)
  dev0 = jax.devices()[0]
  per_device = sum(sh.data.nbytes for x in jax.tree.leaves(state)
                   for sh in x.addressable_shards if sh.device == dev0)
  sharded = sum(1 for x in leaves if x.addressable_shards[0].data.shape != x.shape)
  big_matrices = sum(1 for x in leaves if x.ndim == 2 and x.size >= sharding.FSDP_MIN_SIZE)
  return st, state, {"manual": st.manual, "losses": losses,
                     "params": [np.asarray(x).ravel().tolist() for x in leaves],
                     "state_bytes_dev0": per_device, "sharded_param_leaves": sharded,
                     "big_matrices": big_matrices, "peak_bytes": flops.peak_bytes(mem),
                     "argument_bytes": mem.argument_size_in_bytes, "all_reduces": all_reduces,
                     "leaves": len(leaves)}

out = {}
for name, kw in [
    ("plain", {}),
    ("remat_full", {"remat": "full"}),
    ("accum4", {"grad_accum_steps": 4}),
    ("fsdp_accum2_dots", {"fsdp": True, "grad_accum_steps": 2, "remat": "dots"}),
    ("bf16_reduce", {"grad_allreduce_dtype": "bfloat16"}),
    ("fsdp_bf16_reduce", {"fsdp": True, "grad_allreduce_dtype": "bfloat16"}),
    ("flat_reduce", {"grad_allreduce": "flat"}),
    ("fsdp_flat_reduce", {"fsdp": True, "grad_allreduce": "flat"}),
    ("per_tensor", {"grad_allreduce": "per_tensor"}),
]:
  st, state, out[name] = run(name, **kw)
  if name == "plain":
    out["init_params"] = [np.asarray(x).ravel().tolist()
                          for x in jax.tree.leaves(init_state.params)]
    # grad_allreduce_dtype=float32 must be the plain step itself: the same program.
    abstract_b = flops.abstract_batch(BATCH, setup.meta.seq_len, setup.predictions,
                                      st.batch_sharding)
    fp32 = config(grad_allreduce_dtype="float32")
    fp32_st = mlm.build_steps(fp32, train.build_setup(fp32, meta).model_cfg,
                                    setup.predictions)
    out["fp32_same_program"] = (
        fp32_st.train_step.lower(fp32_st.abstract_state, abstract_b).as_text()
        == st.train_step.lower(st.abstract_state, abstract_b).as_text())
  if name == "fsdp_accum2_dots":
    # Orbax: save the sharded state, restore it FSDP-sharded and replicated.
    it = prefetch.DevicePrefetcher(st.batch_sharding, reopen=lambda k: iter(
        data_lib.make_dataset(base, meta, "train", train=True, start_batch=k)))
    ck = ckpt_lib.Checkpointer(workdir, keep=1, use_async=False)
    ck.save(4, state, it)
    ck.wait()
    fsdp_restored = ck.restore(4, st.abstract_state, it)
    plain_st = mlm.build_steps(base, setup.model_cfg, setup.predictions)
    repl_restored = ck.restore(4, plain_st.abstract_state, it)
    ck.close()
    same = lambda a, b: all(np.array_equal(np.asarray(x), np.asarray(y))
                            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    out["restore"] = {
        "fsdp_equal": same(fsdp_restored, state),
        "fsdp_shardings_kept": all(x.sharding == y.sharding for x, y in zip(
            jax.tree.leaves(fsdp_restored), jax.tree.leaves(st.abstract_state))),
        "replicated_equal": same(repl_restored, state),
        "replicated_is_replicated": all(x.sharding.is_fully_replicated
                                        for x in jax.tree.leaves(repl_restored)),
    }
print("LEVERS_JSON " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  d = tmp_path_factory.mktemp("levers") / "ds"
  make_synthetic_dataset(str(d), seq_len=64, vocab_size=128, n_train=256, n_val=32)
  return d


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
  # Level 0 LLVM backend optimisation: compiles ~2x faster on CPU (every variant uses it).
  # The memory-minimizing scheduler: with XLA:CPU's concurrency-optimized default, remat
  # saves no memory at all on CPU.
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="4",
             XLA_FLAGS="--xla_backend_optimization_level=0 "
                       "--xla_cpu_enable_concurrency_optimized_scheduler=false")
  r = subprocess.run([sys.executable, "-c", _LEVERS, str(data),
                      str(tmp_path_factory.mktemp("levers_ckpt"))],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-4000:]
  line = next(l for l in r.stdout.splitlines() if l.startswith("LEVERS_JSON "))
  return json.loads(line.removeprefix("LEVERS_JSON "))


def _assert_matches_plain(runs, name, loss_rtol=LOSS_RTOL, param_atol=PARAM_ATOL):
  plain, other = runs["plain"], runs[name]
  np.testing.assert_allclose(other["losses"], plain["losses"], rtol=loss_rtol, err_msg=name)
  for a, b in zip(other["params"], plain["params"]):
    np.testing.assert_allclose(a, b, atol=param_atol, rtol=0, err_msg=name)


def test_training_moves(runs):
  """The comparisons below mean something only if 4 steps move the parameters and the loss
  far more than the tolerances."""
  plain = runs["plain"]
  moved = max(np.abs(np.subtract(a, b)).max() for a, b in zip(plain["params"],
                                                               runs["init_params"]))
  assert moved > 1000 * PARAM_ATOL, moved
  losses = np.asarray(plain["losses"])
  assert np.abs(losses - losses[0]).max() > 1000 * LOSS_RTOL * losses[0], losses
  assert not plain["manual"]


@pytest.mark.parametrize("name", ["remat_full", "accum4"])
def test_remat_and_accumulation_match_plain(runs, name):
  # Every remat policy is also checked against none in tests/test_model.py (loss and grads).
  _assert_matches_plain(runs, name)
  assert runs[name]["manual"] == (name == "accum4")


def test_fsdp_matches_replicated_and_shards_the_state(runs):
  name = "fsdp_accum2_dots"
  _assert_matches_plain(runs, name)
  r, plain = runs[name], runs["plain"]
  assert r["manual"]
  # Every matrix but the 2x64 token-type table: 12 kernels, 3 embeddings, the head transform.
  assert r["sharded_param_leaves"] == r["big_matrices"] == 15
  # Params + both Adam moments of the sharded leaves live in quarters on each device.
  assert r["state_bytes_dev0"] < 0.5 * plain["state_bytes_dev0"]
  assert r["argument_bytes"] < 0.5 * plain["argument_bytes"]


def test_fsdp_state_restores_through_orbax(runs):
  assert runs["restore"] == {"fsdp_equal": True, "fsdp_shardings_kept": True,
                             "replicated_equal": True, "replicated_is_replicated": True}


def test_grad_allreduce_dtype(runs):
  # float32 (the default) is the plain step itself: the same lowered program.
  assert runs["fp32_same_program"]
  for name in ("bf16_reduce", "fsdp_bf16_reduce"):
    r = runs[name]
    assert r["manual"]
    # The first loss is computed before any update: the same. Later ones stay close, and the
    # parameters differ (the reduction really ran in bfloat16).
    assert r["losses"][0] == pytest.approx(runs["plain"]["losses"][0], rel=LOSS_RTOL)
    np.testing.assert_allclose(r["losses"], runs["plain"]["losses"], rtol=BF16_LOSS_RTOL)
    assert r["params"] != runs["plain"]["params"]


def test_flat_grad_allreduce_is_one_collective_with_the_same_result(runs):
  # "flat" concatenates the replicated gradients into one psum: the sums are the same
  # elementwise sums as one psum per leaf, so it matches the plain step like any manual path.
  for name in ("flat_reduce", "fsdp_flat_reduce"):
    assert runs[name]["manual"]
    _assert_matches_plain(runs, name)
  # The per-leaf manual path (accum4) reduces each of the model's leaves on its own; flat has
  # one gradient all-reduce plus the step's scalar sums (prediction weight, metrics).
  leaves = runs["plain"]["leaves"]
  assert runs["accum4"]["all_reduces"] >= leaves
  assert runs["flat_reduce"]["all_reduces"] <= runs["accum4"]["all_reduces"] - leaves + 1
  # "auto" on one process is "per_tensor": the plain step, not the manual path.
  assert not runs["plain"]["manual"] and not runs["per_tensor"]["manual"]
  assert runs["per_tensor"]["losses"] == runs["plain"]["losses"]


# ----------------------------------------------------------------------------- memory
def test_compiled_memory_of_the_levers(runs):
  """Peak bytes per device from ``.compile().memory_analysis()`` of the steps above (16
  sequences per device): full remat and accumulation below the plain step.

  XLA:CPU's scheduler does not place recomputation as tightly as XLA:GPU's (with its default
  concurrency-optimized scheduler it realizes no remat saving at all, hence the flag in
  ``runs``), so the CPU saving understates the GPU one; lmscale max-batch measures the levers
  on the GPU itself.
  """
  plain = runs["plain"]["peak_bytes"]
  assert runs["remat_full"]["peak_bytes"] < 0.95 * plain, runs["remat_full"]["peak_bytes"]
  assert runs["accum4"]["peak_bytes"] < 0.6 * plain, runs["accum4"]["peak_bytes"]
  assert runs["remat_full"]["argument_bytes"] == runs["plain"]["argument_bytes"]


# ----------------------------------------------------------------------------- units
def test_fsdp_spec_rules():
  from jax.sharding import PartitionSpec as P

  from lmscale_jax.train.sharding import fsdp_spec

  assert fsdp_spec((768, 3072), 4) == P(None, "data")  # largest divisible dimension
  assert fsdp_spec((30522, 768), 4) == P(None, "data")  # 30522 % 4 != 0
  assert fsdp_spec((22016, 768), 8) == P("data", None)
  assert fsdp_spec((768,), 4) == P()  # small leaves stay replicated
  assert fsdp_spec((4099, 4099), 4) == P()  # nothing divides
  assert fsdp_spec((1024, 1024), 1) == P()
  assert fsdp_spec((), 4) == P()


def test_lever_config_validation(data):
  from lmscale_jax.errors import ConfigError
  from lmscale_jax.pretrain import trainer as train

  with pytest.raises(ConfigError, match="not divisible by train.grad_accum_steps=3"):
    train.build_setup(small_config(data, grad_accum_steps=3))
  with pytest.raises(ConfigError, match="grad_accum_steps=0"):
    train.build_setup(small_config(data, grad_accum_steps=0))
  with pytest.raises(ConfigError, match="grad_allreduce_dtype='float16'"):
    train.build_setup(small_config(data, grad_allreduce_dtype="float16"))
  with pytest.raises(ConfigError, match="grad_allreduce='bucketed'"):
    train.build_setup(small_config(data, grad_allreduce="bucketed"))
  with pytest.raises(ConfigError, match="dropout_rng='philox'"):
    train.build_setup(small_config(data, dropout_rng="philox"))
  assert jax.device_count() == 1  # the in-process tests above run on one CPU device


# ----------------------------------------------------------------------------- loader autotune
class _SlowBatches:
  """A Grain map producing one "batch" per 40 ms of (sleeping) work: picklable for workers."""

  def __call__(self, i):
    import time

    time.sleep(0.04)
    return {"x": np.full((4,), i, np.int32)}


def _slow_iterator(workers: int):
  import grain

  ds = grain.MapDataset.range(10_000).map(_SlowBatches()).to_iter_dataset(
      grain.ReadOptions(num_threads=1, prefetch_buffer_size=2))
  if workers:
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
  return iter(ds)


def test_autotune_raises_workers_until_the_wait_is_small():
  """40 ms batches, 25 ms steps: 0 and 1 workers leave ~40% input wait; 2 workers (20 ms per
  batch) keep up."""
  from lmscale_jax.input import autotune

  workers, results = autotune.choose_workers(_slow_iterator, 0.025, target=0.1, max_workers=4,
                                             steps=20, drain=6)
  # 2 workers is enough (measured ~4 % wait); on a loaded machine 4 may be needed instead.
  assert [r["workers"] for r in results] in ([0, 1, 2], [0, 1, 2, 4])
  assert workers == results[-1]["workers"] and results[-1]["wait_frac"] < 0.1
  assert results[0]["wait_frac"] > 0.25 and results[1]["wait_frac"] > 0.25
  assert autotune.candidates(6) == [0, 1, 2, 4, 6] and autotune.candidates(0) == [0]


def test_autotune_record_makes_resume_deterministic(tmp_path):
  from lmscale_jax.input import autotune
  from tests.helpers import make_config

  data = make_config(data=dict(workers=3, autotune_max_workers=2, autotune_target=0.5)).data
  calls = []

  def measure_once(workers):
    calls.append(workers)
    return iter(range(10**6))  # an instant loader: 0 workers already meets the target

  def never(*_):
    raise AssertionError("a recorded run must not measure")

  w = autotune.resolve_workers(str(tmp_path / "fresh"), data, is_writer=True,
                               step_seconds=lambda: 0.001, make_iterator=measure_once)
  record = json.loads((tmp_path / "fresh" / autotune.FILENAME).read_text())
  assert w == 0 and calls == [0] and record["workers"] == 0 and record["reason"] == "measured"
  assert record["measurements"][0]["wait_frac"] < 0.5
  # The resume reads the record back, whatever data.workers says now, and does not measure.
  data.workers = 5
  assert autotune.resolve_workers(str(tmp_path / "fresh"), data, is_writer=True,
                                  step_seconds=never, make_iterator=never) == 0


def test_train_with_loader_autotune(data, tmp_path):
  """train_and_evaluate measures its own step, records the choice, trains with it."""
  from lmscale_jax.input import autotune
  from lmscale_jax.pretrain import trainer as train

  c = small_config(data, steps=2, eval_every=2)
  c.data.autotune = True
  c.data.autotune_max_workers = 1
  c.data.autotune_target = 0.5  # a tiny CPU step: any loader keeps up; 0 workers must win
  out = train.train_and_evaluate(c, str(tmp_path / "w"))
  record = json.loads((tmp_path / "w" / autotune.FILENAME).read_text())
  assert record["workers"] == 0 and record["reason"] == "measured"
  assert 0 < record["step_seconds"] < 5 and record["measurements"][0]["batches"] > 0
  assert out["step"] == 2 and np.isfinite(out["loss"])
  # Decided before config.json is written, which records the workers the run used.
  saved = json.loads((tmp_path / "w" / "config.json").read_text())
  assert saved["config"]["data"]["workers"] == 0 and saved["config"]["data"]["autotune"]


# ----------------------------------------------------------------------------- max batch search
@pytest.mark.parametrize("fixed,per_seq,bump,accum,granularity", [
    (10.0, 1.0, 0.0, 1, 1),    # affine: the fit is exact
    (10.0, 1.0, 0.002, 1, 1),  # convex: the fit from small probes overshoots; walks down
    (50.0, 3.0, -0.0001, 4, 1),  # concave: undershoots; walks up; multiples of accum
    (10.0, 1.0, 0.0, 2, 8),    # coarse: multiples of lcm(2, 8)
])
def test_max_batch_search_finds_the_boundary(fixed, per_seq, bump, accum, granularity):
  from lmscale_jax.cli import max_batch

  calls = []

  def probe(b):  # stands in for a compilation: peak bytes of per-device batch b
    calls.append(b)
    return {"peak": fixed + per_seq * b + bump * b * b}

  budget = 400
  r = max_batch.max_batch(probe, budget, accum, (4, 8), limit=4096, granularity=granularity)
  compiles = len(set(calls))
  step = np.lcm(accum, granularity)
  best = max(b for b in range(step, 4096, step) if probe(b)["peak"] <= budget)
  assert r["max_per_device"] == best and r["step"] == step
  assert compiles <= 10  # it searched, not scanned
  assert max_batch.max_batch(probe, 5, accum, (4, 8))["max_per_device"] == 0  # nothing fits


# ----------------------------------------------------------------------------- cuDNN padding
def test_key_lengths_mask_equals_the_boolean_mask():
  """The cuDNN path passes padding as key lengths (model.padding_lengths); with trailing
  padding that is the same attention as the boolean key mask (checked through XLA's
  implementation of both arguments; the cuDNN kernel itself needs a GPU:
  tests/test_model.py::test_cudnn_attention_matches_xla)."""
  import jax.numpy as jnp

  from lmscale_jax.model import bert as M

  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (3, 32, 2, 16), jnp.float32) for key in (k1, k2, k3))
  mask = jnp.arange(32)[None, :] < jnp.array([[20], [32], [1]])
  lengths = M.padding_lengths(mask)
  assert lengths.tolist() == [20, 32, 1] and lengths.dtype == jnp.int32
  by_mask = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None, None, :],
                                         implementation="xla")
  by_lengths = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                            implementation="xla")
  np.testing.assert_allclose(by_lengths, by_mask, atol=1e-6)
