"""The model variants of issue 38 (model.positions = absolute | segment | instruction, model.norm =
post | pre; undertale's model is positions="instruction", norm="pre") under every lever and tool.

undertale's rule for the instruction and argument indices is re-implemented here in numpy from
its source (``undertale/models/custom.py``: ``compute_instruction_index`` and
``compute_argument_index``) and applied to each packed function alone. The runs are real
``python -m lmscale_jax.main`` processes (1 and 4 CPU devices, 2 processes over gloo) on one
real binary-code dataset (two system libraries through ``lmscale prepare binary``); the tools
run in-process through their ``main()`` on that run's workdir. The GPU side (cuDNN attention in
bfloat16) is tests/test_model_variants_gpu.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmscale_jax.config import defaults as config_defaults
from lmscale_jax.config import legacy
from lmscale_jax.model import bert as M
from lmscale_jax.prep import prepare
from lmscale_jax.store import dataset
from lmscale_jax.train import optim
from lmscale_jax.train import run_record
from tests import test_distributed as dist
from tests import test_packed_attention as packed
from tests.helpers import ROOT, SPECIAL_IDS, communicate, make_config
from tests.test_hf_tools import ELF, INPUTS, run_tool, tool
from tests.test_levers import LOSS_RTOL

CLS, SEP, PAD, NEXT = (SPECIAL_IDS[t] for t in ("[CLS]", "[SEP]", "[PAD]", "[NEXT]"))
UNDERTALE_MODEL = {"positions": "instruction", "norm": "pre"}
UNDERTALE = {f"model.{k}": v for k, v in UNDERTALE_MODEL.items()}


# --------------------------------------------------------------------------- undertale's rule
def undertale_indices(state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """``compute_instruction_index`` and ``compute_argument_index`` of undertale's
  ``InstructionTracePositionEmbedding`` on one function's tokens [S] (numpy for torch):
  ``starts = roll(state == NEXT, 1); starts[0] = False``; instruction = cumsum(starts);
  argument = position − cummax(position × starts)."""
  starts = np.roll(state == NEXT, 1)
  starts[0] = False
  position = np.arange(len(state))
  return np.cumsum(starts), position - np.maximum.accumulate(position * starts)


def undertale_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """undertale's indices of every function of packed ``rows`` [B,S], each computed alone: a
  function runs from its [CLS] to the next [CLS] (the last one to the row's end, [PAD]s and
  all)."""
  instruction, argument = np.zeros_like(rows), np.zeros_like(rows)
  for r, row in enumerate(rows):
    starts = [*np.flatnonzero(row == CLS).tolist(), len(row)]
    for s, e in zip(starts, starts[1:]):
      instruction[r, s:e], argument[r, s:e] = undertale_indices(row[s:e])
  return instruction, argument


def instruction_functions(rng, n: int) -> list[np.ndarray]:
  """Token ids of ``n`` functions of 1-6 instructions of 1-4 tokens, [NEXT] after each but
  the last (as lmscale prepare binary writes them); every 7th is longer than a sequence, so
  the packer splits it and the continuation starts with its own [CLS]."""
  out = []
  for i in range(n):
    count = 30 if i % 7 == 6 else int(rng.integers(1, 7))
    ids = []
    for k in range(count):
      ids += rng.integers(len(SPECIAL_IDS), packed.VOCAB, int(rng.integers(1, 5))).tolist()
      ids += [NEXT] if k < count - 1 else []
    out.append(np.asarray(ids, np.uint16))
  return out


def test_instruction_positions_equal_undertales_rule_on_each_packed_function():
  rows = packed.pack(instruction_functions(np.random.default_rng(0), 60)).astype(np.int32)
  assert len(rows) > 4 and (rows[:, -1] == PAD).any()  # [PAD] tails
  assert (np.sum(rows == CLS, axis=1) > 1).any()  # packed rows of several functions
  lengths = [len(f) for f in instruction_functions(np.random.default_rng(0), 60)]
  assert max(lengths) > packed.SEQ  # a function split across rows
  instruction, argument = jax.jit(M.instruction_positions, static_argnums=(1, 2))(
      jnp.asarray(rows), CLS, NEXT)
  want_instruction, want_argument = undertale_rows(rows)
  np.testing.assert_array_equal(np.asarray(instruction), want_instruction)
  np.testing.assert_array_equal(np.asarray(argument), want_argument)
  assert want_instruction.max() > 5 and want_argument.max() >= 4


def test_instruction_positions_of_the_docstring_example():
  # [CLS] push rbp [NEXT] mov rbp rsp [NEXT] [SEP]: the [NEXT] ends its instruction
  ids = jnp.asarray([[CLS, 10, 11, NEXT, 12, 11, 13, NEXT, SEP, PAD]])
  instruction, argument = M.instruction_positions(ids, CLS, NEXT)
  assert instruction.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1, 2, 2]]
  assert argument.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 0, 1]]


# --------------------------------------------------------------------------- packed = alone
def perturbed_params(cfg, seed: int = 3):
  """Fresh parameters moved off zero biases and unit LayerNorms (a leak would show)."""
  fresh = jax.jit(lambda r: M.init_params(cfg, r))(jax.random.key(seed))
  leaves, tree = jax.tree_util.tree_flatten(fresh)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  return jax.tree_util.tree_unflatten(
      tree, [x + 0.2 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


@pytest.mark.parametrize("positions,norm", [("instruction", "pre"), ("instruction", "post"),
                                            ("segment", "pre")])
def test_a_packed_function_gets_the_logits_it_gets_alone(positions, norm):
  """packed_attention="segment", fp32, every token of every function (continuations of split
  functions included): the same logits packed as alone in a row (max abs diff < 1e-5)."""
  rows = packed.pack(instruction_functions(np.random.default_rng(2), 40))[:8]
  alone, where = packed.functions_alone(rows)
  assert len(where) > 2 * len(rows)
  cfg = packed.model_cfg("segment", positions=positions, norm=norm)
  params = perturbed_params(cfg)
  packed_logits = packed.logits_all(cfg, params, rows)
  alone_logits = packed.logits_all(cfg, params, np.stack(alone))
  diffs = [np.abs(packed_logits[r, s:e] - alone_logits[i, :e - s]).max()
           for i, (r, s, e) in enumerate(where)]
  assert max(diffs) < 1e-5, max(diffs)


def test_instruction_positions_change_what_the_model_computes():
  """The instruction and argument tables are used: moving a [NEXT] changes the other tokens'
  hidden states (with segment positions it changes only through the [NEXT] token itself)."""
  cfg = packed.model_cfg("segment", positions="instruction", norm="pre")
  params = perturbed_params(cfg)
  a = np.full((1, packed.SEQ), PAD, np.int32)
  a[0, :9] = [CLS, 10, 11, NEXT, 12, 11, 13, NEXT, SEP]
  b = a.copy()
  b[0, 3], b[0, 4] = 12, NEXT  # the same multiset of tokens, one [NEXT] later
  la, lb = packed.logits_all(cfg, params, a), packed.logits_all(cfg, params, b)
  assert np.abs(la[0, 1:3] - lb[0, 1:3]).max() > 1e-2


def test_undertale_variant_params_replace_the_position_table():
  cfg = packed.model_cfg("segment", positions="instruction", norm="pre")
  shapes = jax.eval_shape(lambda r: M.init_params(cfg, r), jax.random.key(0))
  emb = shapes["embeddings"]
  assert "position_embeddings" not in emb and "final_LayerNorm" in shapes
  assert emb["instruction_embeddings"]["embedding"].shape == (packed.SEQ, cfg.hidden)
  assert emb["argument_embeddings"]["embedding"].shape == (packed.SEQ, cfg.hidden)


# --------------------------------------------------------------------------- the schedule
def test_warmup_fraction_is_that_share_of_train_steps():
  t = make_config(train=dict(steps=10_000, warmup_steps=7, warmup_fraction=0.025,
                             learning_rate=1e-4, schedule="cosine")).train
  assert optim.warmup_steps(t) == 250  # undertale: int(0.025 * total_steps)
  schedule = optim.learning_rate_schedule(t)
  assert float(schedule(0)) == 0.0 and float(schedule(250)) == pytest.approx(1e-4)
  assert float(schedule(125)) == pytest.approx(0.5e-4)
  assert float(schedule(10_000)) == pytest.approx(0.0, abs=1e-12)
  t.steps = 2_000  # an override of train.steps keeps 2.5%
  assert optim.warmup_steps(t) == 50
  t.warmup_fraction = 0.0  # the default: train.warmup_steps
  assert optim.warmup_steps(t) == 7


@pytest.mark.parametrize("value", [1.0, -0.1, float("nan")])
def test_bad_warmup_fraction_is_named(value):
  from lmscale_jax.config import checks as config_checks
  from lmscale_jax.errors import ConfigError

  with pytest.raises(ConfigError, match=r"train.warmup_fraction=.*expected a finite number "
                                        r"in \[0, 1\)"):
    config_checks.check_config(make_config(train=dict(warmup_fraction=value)))


# --------------------------------------------------------------------------- runs
@pytest.fixture(scope="module")
def binary(tmp_path_factory):
  """A binary-code dataset ([NEXT] between instructions) from two system libraries."""
  data = tmp_path_factory.mktemp("variants") / "ds"
  prepare.prepare(prepare.PrepareOptions(kind="binary", inputs=INPUTS, output=str(data),
                                         seq_len=64, vocab_size=400, val_fraction=0.1,
                                         workers=1, progress=False))
  return data


def run_args(data, workdir, **over) -> list[str]:
  """tests/test_distributed.py's run (configs/tiny.py, 1 layer × 64, batch 8, 6 steps, a
  checkpoint every 3) as undertale's variant."""
  return dist.train_args(data, workdir, **{**UNDERTALE, **over})


def main(args, devices: int = 1, timeout: float = 300) -> subprocess.CompletedProcess:
  p = subprocess.Popen([sys.executable, "-m", "lmscale_jax.main", *map(str, args)], cwd=ROOT,
                       env=dist.base_env(JAX_NUM_CPU_DEVICES=str(devices)),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       start_new_session=True)
  out, err = communicate(p, timeout)
  return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
  assert result.returncode == 0, result.stderr[-4000:]
  return result


@pytest.fixture(scope="module")
def reference(binary, tmp_path_factory):
  """The uninterrupted 1-device run: 6 steps of undertale's variant."""
  workdir = tmp_path_factory.mktemp("vref") / "w"
  ok(main(run_args(binary, workdir)))
  saved = json.loads((workdir / "config.json").read_text())
  assert (saved["model"]["positions"], saved["model"]["norm"]) == ("instruction", "pre")
  return workdir


def test_fsdp_accumulation_and_remat_on_four_devices_equal_one_device(binary, reference,
                                                                      tmp_path):
  ok(main(run_args(binary, tmp_path / "w", **{"train.fsdp": True, "train.grad_accum_steps": 2,
                                               "train.remat": "full"}), devices=4))
  one, four = dist.series(reference), dist.series(tmp_path / "w")
  assert sorted(one) == sorted(four) == [1, 2, 3, 4, 5, 6]
  np.testing.assert_allclose([four[s] for s in one], [one[s] for s in one], rtol=LOSS_RTOL)
  assert abs(one[6] - one[1]) > 1e3 * LOSS_RTOL * one[1]  # the steps moved the loss


def test_bfloat16_compute_runs_finite(binary, tmp_path):
  ok(main(run_args(binary, tmp_path / "w", **{"model.dtype": "bfloat16", "train.steps": 3})))
  losses = dist.series(tmp_path / "w")
  assert sorted(losses) == [1, 2, 3] and np.isfinite(list(losses.values())).all()


def test_two_processes_equal_one(binary, reference, tmp_path):
  ok(dist.local_sh(2, run_args(binary, tmp_path / "w"), timeout=300))
  one, two = dist.series(reference), dist.series(tmp_path / "w")
  assert sorted(two) == sorted(one)
  np.testing.assert_allclose([two[s] for s in one], [one[s] for s in one], rtol=1e-5)


def test_stopped_at_a_checkpoint_and_resumed_is_bitwise_the_uninterrupted_run(binary, reference,
                                                                            tmp_path):
  workdir = tmp_path / "w"
  ok(main(run_args(binary, workdir, **{"train.steps": 3})))
  assert sorted(os.listdir(workdir / "checkpoints")) == ["3"]
  assert "resumed from" in ok(main(run_args(binary, workdir))).stderr
  for key in ("loss", "mlm_accuracy", "eval_loss"):
    assert dist.series(workdir, key) == dist.series(reference, key), key


# --------------------------------------------------------------------------- the tools
def test_evaluate_gives_the_runs_own_eval_loss(binary, reference, capsys):
  want = dist.series(reference, "eval_loss")[6]
  code, out, err = run_tool("evaluate", ["--workdir", reference, "--data", binary, "--batches",
                                         2], capsys)
  assert code == 0, err
  got = json.loads(out)
  assert got["step"] == 6 and got["loss"] == pytest.approx(want, abs=1e-5)


def test_fill_mask_predicts_finite_probabilities(reference, capsys):
  text = "push rbp [NEXT] mov rbp rsp [NEXT] [MASK] rsp 0x10 [NEXT] [MASK] eax eax"
  code, out, err = run_tool("fill_mask", ["--workdir", reference, "--text", text, "--json"],
                            capsys)
  assert code == 0, err
  masks = json.loads(out)
  assert len(masks) == 2 and all(len(m) == 5 for m in masks)
  probs = [p["probability"] for m in masks for p in m]
  assert np.isfinite(probs).all() and 0 < sum(probs) <= 2 + 1e-6


def test_embed_gives_finite_vectors(reference, tmp_path, capsys):
  out = tmp_path / "e.npz"
  code, _, err = run_tool("embed", ["--workdir", reference, "--elf", ELF, "--output", out],
                          capsys)
  assert code == 0, err
  e = np.load(out)
  assert e["embeddings"].shape == (len(e["names"]), 64) and len(e["names"]) > 50
  assert np.isfinite(e["embeddings"]).all()


@pytest.mark.skipif(shutil.which("gcc") is None, reason="the pairs need gcc")
def test_contrastive_finetune_from_the_run(reference, tmp_path):
  from tests.test_finetune import SOURCES, args
  from lmscale_jax.similarity import function_groups

  header, groups = function_groups.build([SOURCES], ["gcc"], ["O0", "O3"], say=print)
  pairs = tmp_path / "pairs.jsonl"
  function_groups.write(str(pairs), header, groups)
  workdir = tmp_path / "ft"
  assert tool("finetune_similarity").main(args(pairs, workdir, "--init-workdir", reference,
                                               "--steps", 3, "--checkpoint-every", 3)) == 0
  rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  losses = [r["loss"] for r in rows if "loss" in r]
  assert len(losses) == 3 and np.isfinite(losses).all()
  saved = json.loads((workdir / "config.json").read_text())
  assert (saved["model"]["positions"], saved["model"]["norm"]) == ("instruction", "pre")


# --------------------------------------------------------------------------- old runs, bad input
@pytest.mark.parametrize("windows,positions", [("segment", "segment"), ("cross", "absolute")])
def test_an_old_pre_ln_record_reads_as_norm_pre(reference, tmp_path, windows, positions):
  """config.json from before model.norm and model.positions: ``"pre_ln": true`` is norm=pre,
  and the positions were those of its attention windows."""
  saved = json.loads((reference / "config.json").read_text())
  for model in (saved["config"]["model"], saved["model"]):
    for key in ("norm", "positions"):
      model.pop(key)
    model["pre_ln"] = True
  saved["config"]["model"]["packed_attention"] = saved["model"]["packed_attention"] = windows
  path = tmp_path / "config.json"
  path.write_text(json.dumps(saved))
  record = run_record.load_record(str(path))
  for model in (record["config"]["model"], record["model"]):
    assert (model["norm"], model["positions"]) == ("pre", positions)
    assert "pre_ln" not in model
  assert legacy.complete({"model": {"pre_ln": False}})["model"]["norm"] == "post"


def test_pre_ln_on_the_command_line_is_refused_naming_model_norm(binary, tmp_path):
  r = main([f"--config={ROOT}/configs/tiny.py", f"--workdir={tmp_path / 'w'}",
            f"--config.data.path={binary}", "--config.model.pre_ln=True"], timeout=120)
  assert r.returncode == 1 and "Traceback" not in r.stderr
  assert r.stderr.strip().splitlines()[-1].startswith("error: ")
  assert "model.pre_ln was renamed" in r.stderr and "model.norm" in r.stderr
  assert not (tmp_path / "w").exists()


def text_dataset(tmp_path):
  """A text corpus prepared as users do (lmscale prepare text): no [NEXT] in it."""
  corpus = tmp_path / "a.txt"
  corpus.write_text("".join(f"the quick brown fox {i} jumps over the lazy dog\n"
                            for i in range(300)))
  text = tmp_path / "text"
  prepare.prepare(prepare.PrepareOptions(kind="text", inputs=[str(corpus)], output=str(text),
                                         seq_len=64, vocab_size=300, val_fraction=0.05,
                                         workers=1, progress=False))
  return text


def test_instruction_positions_on_a_text_dataset_is_one_line(tmp_path):
  text = text_dataset(tmp_path)
  r = main([f"--config={ROOT}/configs/tiny.py", f"--workdir={tmp_path / 'w'}",
            f"--config.data.path={text}", "--config.model.positions=instruction"], timeout=120)
  assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith("error: model.positions='instruction' counts instructions by [NEXT]")
  assert str(text) in last and "model.positions=segment" in last
  # Found where the dataset is read, as a model.seq_len that disagrees with it: the workdir
  # holds at most its (released) lock file, no config.json, metrics or checkpoint.
  assert not (tmp_path / "w").exists() or set(os.listdir(tmp_path / "w")) <= {".lock"}


# --------------------------------------------------------------------------- positions "auto"
def test_auto_positions_are_instruction_on_binary_code_and_segment_on_text(binary, tmp_path):
  model = config_defaults.get_base_config().model
  assert model.positions == "auto"  # the default
  resolve = lambda data: M.resolve_model_config(model, dataset.DatasetMeta.load(str(data)))
  assert resolve(binary).positions == "instruction"
  assert resolve(text_dataset(tmp_path)).positions == "segment"
  given = M.resolve_model_config(model, dataset.DatasetMeta.load(str(binary)),
                                 start_positions="absolute")
  assert given.positions == "absolute"  # the start model's, where there is one


def test_auto_keeps_the_positions_of_the_run_it_resumes(binary, tmp_path):
  """A run begun with segment positions (the default before "auto") resumes under the default
  as the model it is; a new run under the default is instruction (binary code)."""
  workdir = tmp_path / "w"
  ok(main(dist.train_args(binary, workdir, **{"model.positions": "segment",
                                               "train.steps": 3})))
  r = ok(main(dist.train_args(binary, workdir)))
  assert "resumed from" in r.stderr and "segment positions, post-LN" in r.stderr
  saved = json.loads((workdir / "config.json").read_text())
  assert saved["model"]["positions"] == "segment" and sorted(dist.series(workdir))[-1] == 6
  fresh = ok(main([*dist.train_args(binary, tmp_path / "new"), "--dry_run"]))
  assert "instruction positions, post-LN" in fresh.stdout


# --------------------------------------------------------------------------- the paper's config
def test_undertale_medium_dry_run_prints_its_size_and_memory(binary, tmp_path):
  r = ok(main([f"--config={ROOT}/configs/undertale_medium.py", f"--workdir={tmp_path / 'w'}",
               f"--config.data.path={binary}", "--config.model.seq_len=0", "--dry_run"],
              timeout=120))
  line = next(x for x in r.stdout.splitlines() if x.startswith("model: "))
  count = int(line.split()[1].replace(",", ""))
  assert 85e6 < count < 87e6, line  # 85.0M encoder + embeddings of a 400-token vocabulary
  assert "(12 layers × 768" in line and "global batch 11776" in line and "GiB per device" in line
  for want in ("norm: pre", "positions: instruction", "warmup_fraction: 0.025",
               "schedule: cosine"):
    assert want in r.stdout, want
  assert not (tmp_path / "w").exists()


def test_undertale_medium_is_the_papers_model_and_optimiser():
  from tests.test_model import fake_meta, load_config

  c = load_config("undertale_medium")
  assert (c.model.layers, c.model.hidden, c.model.heads, c.model.ffn, c.model.seq_len) == \
      (12, 768, 12, 3072, 512)
  assert (c.model.norm, c.model.positions, c.model.dropout, c.model.layer_norm_eps) == \
      ("pre", "instruction", 0.1, 1e-12)
  t = c.train
  assert (t.learning_rate, t.b1, t.b2, t.eps, t.weight_decay) == (1e-4, 0.9, 0.999, 1e-8, 0.01)
  assert (t.batch_size, t.warmup_fraction, t.schedule, t.end_lr_frac) == \
      (184 * 64, 0.025, "cosine", 0.0)
  cfg = M.resolve_model_config(c.model, fake_meta(seq_len=512, vocab_size=30522))
  shapes = jax.eval_shape(lambda r: M.init_params(cfg, r), jax.random.key(0))
  from lmscale_jax.model import flops

  assert flops.param_count(shapes) == flops.count_params_from_config(cfg)
  assert set(config_defaults.get_base_config().train) == set(t)  # no key of its own
