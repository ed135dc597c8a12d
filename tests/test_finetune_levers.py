"""Fine-tuning's levers (train.fsdp, grad_accum_steps, grad_allreduce_dtype, grad_allreduce,
remat, nonfinite): the contrastive task through pretraining's one train step
(lmscale_jax/train/steps.py), against its plain step.

The multi-device checks run once, in one subprocess with 4 CPU devices; each variant trains
the same 3 batches of 16 pairs from the same start (tests/test_finetune.py's pretrained run
and similarity pairs), dropout 0. Variants that only reorder float32 sums (4 devices against
1, the shard_map path, FSDP, accumulation by GradCache, remat) agree with the plain step to
LOSS_RTOL on every loss and PARAM_ATOL on every parameter after 3 AdamW steps (measured
2026-12-04: <= 2.6e-7 and <= 1.8e-6, the largest with accumulation); a bfloat16 gradient
reduction rounds each gradient to 8 mantissa bits: losses within BF16_LOSS_RTOL (measured
1.2e-5), parameters visibly different (1.2e-3).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from lmscale_jax.finetune import contrastive_run as finetune
from lmscale_jax.train import checkpoint as ckpt_lib
from tests.helpers import ROOT
from tests.test_finetune import bench, pretrained, rows, series  # noqa: F401 (fixtures)
from tests.test_hf_tools import run_tool

LOSS_RTOL = 2e-6
PARAM_ATOL = 1e-5
BF16_LOSS_RTOL = 1e-4

# Runs in a fresh interpreter with 4 CPU devices; argv: pairs file, pretrained run, workdir.
_LEVERS = r"""
import json, sys
import jax, numpy as np
from lmscale_jax.finetune import pairs as finetune_pairs, contrastive_run as finetune
from lmscale_jax.train import sharding

pairs_path, start, workdir = sys.argv[1:4]
assert jax.device_count() == 4

def config(**train_kw):
  c = finetune.get_config()
  c.data.pairs, c.init.path = pairs_path, start
  c.finetune.update(dropout=0.0, proj_dim=32)
  c.train.update(batch_size=16, learning_rate=2e-3, warmup_steps=1, steps=3, **train_kw)
  return c

base = config()
pairs = finetune_pairs.load(pairs_path)
start_model = finetune.load_start(base)
cfg = finetune.finetune_cfg(base, start_model.cfg)
batches = finetune_pairs.PairBatches(pairs, start_model, seed=0, batch_size=16,
                                     process_index=0, process_count=1)
host_batches = [next(batches) for _ in range(3)]
init_state = None

def run(devices=4, manual=None, **kw):
  global init_state
  c = config(**kw)
  mesh = sharding.data_mesh(jax.devices()[:devices])
  st = finetune.build_steps(c, finetune.finetune_cfg(c, start_model.cfg), mesh, manual=manual)
  if init_state is None:  # one start for every variant (a host copy)
    bert = finetune.place(start_model.params, st.state_sharding.params["bert"])
    init_state = jax.device_get(st.init(bert, jax.random.key(1)))
  state = jax.device_put(init_state, st.state_sharding)
  losses, accuracy = [], []
  for ids in host_batches:
    state, m = st.train_step(state, jax.device_put(ids, st.batch_sharding))
    losses.append(float(m["loss"]))
    accuracy.append(float(m["accuracy"]))
  leaves = jax.tree.leaves(state.params)
  return {"manual": st.manual, "losses": losses, "accuracy": accuracy,
          "params": [np.asarray(x).ravel().tolist() for x in leaves],
          "sharded_param_leaves": sum(1 for x in leaves
                                      if x.addressable_shards[0].data.shape != x.shape)}

out = {}
for name, kw in [
    ("one_device", {"devices": 1}),
    ("plain", {}),
    ("manual", {"manual": True}),
    ("fsdp", {"fsdp": True}),
    ("accum2", {"grad_accum_steps": 2}),
    ("fsdp_accum4_flat", {"fsdp": True, "grad_accum_steps": 4, "grad_allreduce": "flat"}),
    ("remat_full", {"remat": "full"}),
    ("bf16_reduce", {"grad_allreduce_dtype": "bfloat16"}),
]:
  out[name] = run(**kw)
  if name == "plain":
    out["init_params"] = [np.asarray(x).ravel().tolist()
                          for x in jax.tree.leaves(init_state.params)]

# The whole run on 4 devices with FSDP, accumulation and a skipped NaN step at 3: it saves
# its sharded state, and its rows are the parent's 1-device run's.
c = config(fsdp=True, grad_accum_steps=2, nonfinite="skip", inject_nonfinite_steps="3")
c.train.update(steps=6, log_every=1)
c.checkpoint.every = 3
out["run"] = finetune.finetune(c, workdir, inputs=finetune.base_run.Checked(pairs), say=print)
print("LEVERS_JSON " + json.dumps(out))
"""


def lever_config(bench, start, **train_kw):
  c = finetune.get_config()
  c.data.pairs, c.init.path = str(bench), str(start)
  c.finetune.update(dropout=0.0, proj_dim=32)
  c.train.update(batch_size=16, learning_rate=2e-3, warmup_steps=1, steps=6, log_every=1,
                 **train_kw)
  c.checkpoint.every = 3
  return c


@pytest.fixture(scope="module")
def runs(bench, pretrained, tmp_path_factory):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=4 "
                       "--xla_backend_optimization_level=0")
  workdir = tmp_path_factory.mktemp("ft_levers") / "run"
  r = subprocess.run([sys.executable, "-c", _LEVERS, str(bench), str(pretrained[1]),
                      str(workdir)], cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=900)
  assert r.returncode == 0, r.stderr[-4000:]
  line = next(x for x in r.stdout.splitlines() if x.startswith("LEVERS_JSON "))
  return {**json.loads(line.removeprefix("LEVERS_JSON ")), "workdir": workdir}


def _assert_matches(runs, name, against="plain", loss_rtol=LOSS_RTOL, param_atol=PARAM_ATOL):
  ref, other = runs[against], runs[name]
  rel = max(abs(a - b) / abs(b) for a, b in zip(other["losses"], ref["losses"]))
  diff = max(np.abs(np.asarray(a) - np.asarray(b)).max()
             for a, b in zip(other["params"], ref["params"]))
  print(f"{name} vs {against}: losses rel {rel:.1e}, parameters abs {diff:.1e}")
  np.testing.assert_allclose(other["losses"], ref["losses"], rtol=loss_rtol, err_msg=name)
  np.testing.assert_allclose(other["accuracy"], ref["accuracy"], atol=1e-6, err_msg=name)
  if param_atol is not None:
    assert diff <= param_atol, name


def test_the_three_steps_move_the_parameters_far_beyond_the_tolerances(runs):
  plain = runs["plain"]
  moved = max(np.abs(np.asarray(a) - np.asarray(b)).max()
              for a, b in zip(plain["params"], runs["init_params"]))
  assert moved > 100 * PARAM_ATOL and plain["losses"][0] != plain["losses"][-1]
  assert not plain["manual"] and runs["manual"]["manual"]


def test_finetune_on_four_devices_equals_one_device(runs):
  _assert_matches(runs, "plain", against="one_device")


def test_the_shard_map_path_gathers_the_negatives_of_the_global_batch(runs):
  """Each device embeds its 4 pairs; the 16 × 16 similarity matrix is the global batch's (a
  per-device loss would be a different number, ln 4 at chance against ln 16)."""
  _assert_matches(runs, "manual")


def test_finetune_fsdp_equals_replicated_and_shards_the_state(runs):
  _assert_matches(runs, "fsdp")
  assert runs["fsdp"]["manual"] and runs["fsdp"]["sharded_param_leaves"] > 0
  assert runs["plain"]["sharded_param_leaves"] == 0


@pytest.mark.parametrize("name", ["accum2", "fsdp_accum4_flat"])
def test_finetune_accumulation_equals_one_microbatch(runs, name):
  """GradCache: the microbatches' embeddings computed first, the loss over all of them, then
  each microbatch's gradient through its own rows: the same gradient as one microbatch."""
  _assert_matches(runs, name)


def test_finetune_remat_equals_no_remat(runs):
  _assert_matches(runs, "remat_full")


def test_finetune_bf16_gradient_reduction_is_close_to_float32(runs):
  _assert_matches(runs, "bf16_reduce", loss_rtol=BF16_LOSS_RTOL, param_atol=None)


def test_the_run_on_four_devices_with_the_levers_skips_the_nan_step_like_one_device(
    runs, bench, pretrained, tmp_path):
  """The whole loop: 6 steps on 4 devices with FSDP and 2 microbatches, step 3 poisoned and
  skipped, checkpoints of the sharded state at 3 and 6, against the same run on this
  process's one device, plain."""
  one = tmp_path / "one"
  last = finetune.finetune(lever_config(bench, pretrained[1], nonfinite="skip",
                                        inject_nonfinite_steps="3"), str(one))
  assert last["step"] == 6 and runs["run"]["step"] == 6
  four = runs["workdir"]
  for workdir in (one, four):
    skipped = {r["step"]: r["nonfinite_skipped"] for r in rows(workdir)}
    assert skipped == {1: 0, 2: 0, 3: 1, 4: 0, 5: 0, 6: 0}
  got, want = ({s: v for s, v in series(w).items() if v is not None} for w in (four, one))
  assert set(got) == set(want) == {1, 2, 4, 5, 6}  # step 3's loss was NaN (written as null)
  np.testing.assert_allclose([got[s] for s in sorted(want)], [want[s] for s in sorted(want)],
                             rtol=LOSS_RTOL)


def test_nonfinite_error_stops_with_one_line_naming_the_step(bench, pretrained, tmp_path,
                                                           capsys):
  workdir = tmp_path / "nan"
  code, _, err = run_tool("finetune_similarity", [
      "--pairs", bench, "--init-workdir", pretrained[1], "--workdir", workdir, "--steps", 4,
      "--batch-size", 8, "--checkpoint-every", 2, "--log-every", 1,
      "--config.train.inject_nonfinite_steps=3", "--config.checkpoint.async_save=false"],
                          capsys)
  assert code != 0 and err.count("\n") == 1, err
  assert "non-finite loss or gradient at step 3" in err, err
  assert f"last good checkpoint: {ckpt_lib.step_dir(str(workdir), 2)}" in err, err


def test_lever_config_values_are_checked_before_anything_runs(bench, pretrained):
  for key, value, message in (("grad_accum_steps", 0, "train.grad_accum_steps"),
                              ("nonfinite", "ignore", "train.nonfinite"),
                              ("grad_allreduce_dtype", "float16", "train.grad_allreduce_dtype"),
                              ("remat", "all", "train.remat"),
                              ("inject_nonfinite_steps", "x", "train.inject_nonfinite_steps")):
    c = lever_config(bench, pretrained[1], **{key: value})
    with pytest.raises(finetune.ConfigError, match=message):
      finetune.check_config(c)
