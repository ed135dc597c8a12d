"""Contrastive fine-tuning end to end (tools/finetune_similarity.py, finetune/contrastive_run.py):
the similarity benchmark built from tests/data/similarity with the machine's gcc (-O0, -O3) as
the pairs, a real pretraining run (2 steps of a 2 × 64 BERT on those sources compiled at -O2,
prepared as tools/prepare_binary.py prepares) to start from; then the fine-tuned workdir used
by tools/embed.py, eval_similarity.py and export_hf.py. Runs are in-process through the
tool's main() except the one killed with SIGKILL.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from lmscale_jax import exits
from lmscale_jax.finetune import pairs as finetune_pairs
from lmscale_jax.inference import model_dir, trained_model
from lmscale_jax.prep import prepare
from lmscale_jax.similarity import function_groups
from lmscale_jax.store import tokenizer as toklib
from lmscale_jax.train import checkpoint as ckpt_lib
from lmscale_jax.train import checkpoint_manifest
from lmscale_jax.pretrain import trainer as train
from tests import test_distributed as dist
from tests.helpers import ROOT, communicate
from tests.test_hf_tools import run_tool, tool

SOURCES = os.path.join(ROOT, "tests", "data", "similarity")
STEPS = 16
CHECKPOINT = 4
pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


def args(pairs, workdir, *extra) -> list[str]:
  """The golden run's command line (the killed run repeats it)."""
  return [str(a) for a in ("--pairs", pairs, "--workdir", workdir, "--steps", STEPS,
                           "--batch-size", 16, "--learning-rate", 2e-3, "--warmup-steps", 3,
                           "--dropout", 0.0, "--proj-dim", 32, "--log-every", 1,
                           "--checkpoint-every", CHECKPOINT, *extra)]


def rows(workdir) -> list[dict]:
  return [json.loads(x) for x in open(os.path.join(workdir, "metrics.jsonl")).read().splitlines()]


def series(workdir, key="loss") -> dict:
  out = {}
  for r in rows(workdir):
    assert r["step"] not in out, f"two rows for step {r['step']}"
    out[r["step"]] = r[key]
  return out


def tiny_config():
  spec = importlib.util.spec_from_file_location("tiny", os.path.join(ROOT, "configs", "tiny.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
  header, groups = function_groups.build([SOURCES], ["gcc"], ["O0", "O3"], say=print)
  out = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
  function_groups.write(str(out), header, groups)
  return out


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  """(ELF directory, pretraining workdir): the sources at -O2, prepared, 2 training steps of
  configs/tiny.py cut to 2 layers × 64."""
  base = tmp_path_factory.mktemp("pre")
  (base / "elf").mkdir()
  for name in ("codecs", "containers", "numeric", "strings"):
    subprocess.run(["gcc", "-O2", *function_groups.BASE_FLAGS, f"-I{SOURCES}", "-o",
                    str(base / "elf" / f"lib{name}.so"), os.path.join(SOURCES, f"{name}.c")],
                   check=True, timeout=120)
  prepare.prepare(prepare.PrepareOptions(kind="binary", inputs=[str(base / "elf")],
                                  output=str(base / "ds"), seq_len=64, vocab_size=400,
                                  val_fraction=0.1, workers=1, progress=False))
  config = tiny_config()
  config.data.path = str(base / "ds")
  config.model.update(layers=2, hidden=64, heads=2, ffn=128)
  config.train.update(batch_size=8, steps=2, warmup_steps=1, eval_every=2, eval_batches=1)
  config.checkpoint.every = 2
  train.train_and_evaluate(config, str(base / "run"))
  return base / "elf", base / "run"


@pytest.fixture(scope="module")
def tuned(bench, pretrained, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("ft") / "ft"
  assert tool("finetune_similarity").main(args(bench, workdir, "--init-workdir",
                                               pretrained[1])) == 0
  return workdir


def test_finetuning_lowers_the_infonce_loss_and_raises_in_batch_accuracy(tuned, pretrained):
  loss, acc = series(tuned), series(tuned, "accuracy")
  assert sorted(loss) == list(range(1, STEPS + 1))
  first, last = np.mean([loss[s] for s in range(1, 6)]), np.mean([loss[s] for s in
                                                                  range(STEPS - 4, STEPS + 1)])
  print(f"InfoNCE loss steps 1-5 {first:.4f}, steps {STEPS - 4}-{STEPS} {last:.4f}; accuracy "
        f"{np.mean([acc[s] for s in range(1, 6)]):.3f} → "
        f"{np.mean([acc[s] for s in range(STEPS - 4, STEPS + 1)]):.3f}")
  assert last < first - 0.5  # ln(16) = 2.77 at chance
  assert np.mean([acc[s] for s in range(STEPS - 4, STEPS + 1)]) > \
      np.mean([acc[s] for s in range(1, 6)]) + 0.2
  row = rows(tuned)[-1]
  assert row["samples_per_sec"] > 0 and row["tokens_per_sec"] > 0 and 0 <= row["truncated_frac"]
  assert "first_step_seconds" in rows(tuned)[0]
  # The encoder trained; the MLM head, outside the loss, is exactly the pretrained one.
  ft, pre = trained_model.load(workdir=str(tuned)), trained_model.load(workdir=str(pretrained[1]))
  assert ft.step == STEPS and ft.head["pool"] == "mean"
  assert ft.head["projection"]["kernel"].shape == (64, 32)
  for key in ("mlm_transform", "mlm_LayerNorm", "mlm_bias"):
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(ft.params[key]),
                                                    _leaves(pre.params[key]))), key
  for key in ("embeddings", "layer_0", "layer_1"):
    assert not any(np.array_equal(a, b) for a, b in zip(_leaves(ft.params[key]),
                                                        _leaves(pre.params[key]))), key


def _leaves(tree):
  import jax

  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_random_init_with_frozen_layers_keeps_them_and_trains_the_rest(bench, pretrained,
                                                                       tmp_path):
  """--init-random: the pretrained run's architecture and tokenizer with the weights of
  eval_similarity.py's random-init row (same seed); --freeze-layers 1 keeps the embeddings
  and layer 0 at those weights, bit for bit, while layer 1 trains."""
  workdir = tmp_path / "frozen"
  assert tool("finetune_similarity").main(
      [str(a) for a in ("--pairs", bench, "--workdir", workdir, "--init-random", pretrained[1],
                        "--steps", 1, "--warmup-steps", 0, "--batch-size", 8, "--freeze-layers",
                        1, "--pool", "cls", "--learning-rate", 1e-2, "--seed", 3)]) == 0
  ft = trained_model.load(workdir=str(workdir))
  start = trained_model.random_init(
      trained_model.architecture(model_dir.read(str(pretrained[1]))), 3)
  for key in ("embeddings", "layer_0", "mlm_transform", "mlm_bias"):
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(ft.params[key]),
                                                    _leaves(start.params[key]))), key
  assert not any(np.array_equal(a, b) for a, b in zip(_leaves(ft.params["layer_1"]),
                                                      _leaves(start.params["layer_1"])))
  assert ft.head["pool"] == "cls" and ft.run_config.init.source == "random"


def test_max_groups_trains_on_a_seeded_subset_in_file_order(bench):
  """--max-groups N: N of the file's groups, the same N for the same seed (a resumed run and
  every process draw them alike), other ones for another seed; 0 or N >= all: every group."""
  full = finetune_pairs.load(str(bench))
  subset = finetune_pairs.load(str(bench), max_groups=10, seed=0)
  assert len(subset) == 10 and subset.sha256 == full.sha256
  where = [full.texts.index(t) for t in subset.texts]
  assert where == sorted(where)
  assert finetune_pairs.load(str(bench), 10, 0).texts == subset.texts
  assert finetune_pairs.load(str(bench), 10, 1).texts != subset.texts
  for everything in (0, len(full), len(full) + 1):
    assert finetune_pairs.load(str(bench), everything, 0).texts == full.texts


def test_freeze_layers_labels_the_embeddings_and_the_lowest_layers_frozen(pretrained):
  """Which leaves train, for every k."""
  import jax

  from lmscale_jax.finetune import contrastive_run as finetune

  model = model_dir.read(str(pretrained[1]))
  config = finetune.get_config()
  abstract = finetune.build_steps(config, model.cfg).abstract_state.params
  for k, frozen in ((0, set()), (1, {"embeddings", "layer_0"}),
                    (2, {"embeddings", "layer_0", "layer_1"})):
    labels = finetune.trainable_labels(abstract, k)
    got = {part: set(jax.tree.leaves(tree)) for part, tree in labels["bert"].items()}
    assert {p for p, lab in got.items() if lab == {"frozen"}} == frozen | {
        "mlm_transform", "mlm_LayerNorm", "mlm_bias"}, k
    assert all(lab == {"train"} for p, lab in got.items() if p.startswith("layer_") and
               p not in frozen) and set(jax.tree.leaves(labels["projection"])) == {"train"}


def test_a_killed_finetune_resumes_with_the_uninterrupted_losses_bitwise(bench, pretrained,
                                                                         tuned, tmp_path,
                                                                         capsys):
  """The golden run again, in a process killed with SIGKILL once its first checkpoint is
  committed (saved synchronously here, a neutral key: the kill then lands with steps left),
  then rerun: every step's numbers equal the uninterrupted run's."""
  workdir = tmp_path / "killed"
  argv = args(bench, workdir, "--init-workdir", pretrained[1],
              "--config.checkpoint.async_save=false")
  p = subprocess.Popen([sys.executable, os.path.join(ROOT, "tools", "finetune_similarity.py"),
                        *argv], cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       start_new_session=True)
  try:
    deadline = time.monotonic() + 180
    while not ckpt_lib.complete_steps(str(workdir)):
      assert p.poll() is None, p.communicate()[1][-3000:]
      assert time.monotonic() < deadline, "no checkpoint within 180 s"
      time.sleep(0.01)
  finally:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGKILL)
    p.communicate()
  assert p.returncode == -signal.SIGKILL, "the run finished before the kill: nothing to resume"
  killed_at = max(r["step"] for r in rows(workdir))
  code, out, _ = run_tool("finetune_similarity", argv, capsys)
  assert code == 0 and f"resumed from {ckpt_lib.step_dir(str(workdir), CHECKPOINT)}" in out
  print(f"killed with step {killed_at} logged; resumed from the checkpoint at step {CHECKPOINT}")
  for key in ("loss", "accuracy", "grad_norm"):
    assert series(workdir, key) == series(tuned, key), key


# --------------------------------------------------------------------------- processes
FINETUNE = (os.path.join(ROOT, "tools", "finetune_similarity.py"),)


def start_job(argv, processes: int = 2, **env) -> list[subprocess.Popen]:
  """The tool in ``processes`` processes on localhost (LMSCALE_* variables, 1 CPU device
  each), as launch/local.sh and Slurm start main."""
  port = dist.free_port()
  return [dist.spawn(i, processes, port, argv, program=FINETUNE, **env)
          for i in range(processes)]


def test_two_processes_log_the_one_process_losses(bench, pretrained, tuned, tmp_path):
  """The golden run in 2 processes (gloo): its 16 pairs a step are split 8/8 and the 16 × 16
  similarity matrix spans both. Every step's loss, in-batch accuracy and gradient norm are the
  in-process run's (rtol 1e-5: the gradient all-reduce sums in another order). XLA_FLAGS are
  this process's, so both compile alike."""
  workdir = tmp_path / "two"
  procs = start_job(args(bench, workdir, "--init-workdir", pretrained[1]),
                    XLA_FLAGS=os.environ.get("XLA_FLAGS", ""))
  try:
    results = [communicate(p, 300) for p in procs]
  finally:
    dist.kill_all(procs)
  for p, (_, err) in zip(procs, results):
    assert p.returncode == 0, err[-3000:]
  assert "done: step 16" in results[0][0] and "done:" not in results[1][0]
  for key in ("loss", "accuracy", "grad_norm"):
    two, one = series(workdir, key), series(tuned, key)
    assert sorted(two) == sorted(one) == list(range(1, STEPS + 1)), key
    np.testing.assert_allclose([two[s] for s in one], [one[s] for s in one], rtol=1e-5,
                               err_msg=key)
  two, one = series(workdir), series(tuned)
  rel = max(abs(two[s] - one[s]) / one[s] for s in one)
  print(f"2 processes vs 1: max relative loss difference {rel:.1e} over {STEPS} steps")


def test_a_lost_process_ends_the_other_with_one_line_and_the_job_resumes(bench, pretrained,
                                                                         tmp_path):
  """kill -9 of process 1 once a checkpoint verifies (both processes' manifests written):
  process 0 exits 75 within the heartbeat timeout with one ``error:`` line naming it (as main
  does: lmscale_jax.cluster.supervisor); the same job, rerun, resumes from a checkpoint and finishes."""
  heartbeat, every = 5, 4
  workdir = tmp_path / "lost"
  argv = args(bench, workdir, "--init-workdir", pretrained[1], "--steps", 100000,
              "--checkpoint-every", every, f"--config.distributed.heartbeat_timeout={heartbeat}")
  procs = start_job(argv)
  try:
    deadline = time.monotonic() + 200
    while not any(not checkpoint_manifest.verify(ckpt_lib.step_dir(str(workdir), step))
                  for step in ckpt_lib.complete_steps(str(workdir))):
      assert time.monotonic() < deadline, "no checkpoint verifies within 200 s"
      assert all(p.poll() is None for p in procs), procs[0].communicate()[1][-3000:]
      time.sleep(0.05)
    procs[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    procs[0].wait(timeout=heartbeat + 30)
    took = time.monotonic() - killed
  finally:
    dist.kill_all(procs)
  err = dist._stderr[procs[0].pid]
  print(f"process 1 killed: process 0 exited {procs[0].returncode} after {took:.1f} s")
  assert procs[0].returncode == exits.EXIT_LOST_PROCESS, err[-3000:]
  assert took < heartbeat + 10
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and errors[0].startswith(
      f"error: process 0: lost process 1 on {socket.gethostname()}"), err[-3000:]
  for trace in ("Check failure stack trace", "Fatal Python error", "Traceback", "@ 0x"):
    assert trace not in err, err[-3000:]
  saved = max(step for step in ckpt_lib.complete_steps(str(workdir))
              if not checkpoint_manifest.verify(ckpt_lib.step_dir(str(workdir), step)))
  procs = start_job([*argv, "--steps", str(saved + 2)])
  try:
    results = [communicate(p, 300) for p in procs]
  finally:
    dist.kill_all(procs)
  assert [p.returncode for p in procs] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
  assert f"resumed from {ckpt_lib.step_dir(str(workdir), saved)}" in results[0][0]
  assert max(series(workdir)) == saved + 2


def test_embed_and_eval_use_the_head_and_show_it_beside_the_pretrained_run(
    bench, pretrained, tuned, tmp_path, capsys):
  elf = str(pretrained[0] / "libstrings.so")
  out = tmp_path / "e.npz"
  code, text, _ = run_tool("embed", ["--workdir", tuned, "--elf", elf, "--output", out], capsys)
  assert code == 0 and "projection head" in text
  e = np.load(out)
  assert e["embeddings"].shape[1] == 32 and bool(e["projection"]) and str(e["pool"]) == "mean"
  np.testing.assert_allclose(np.linalg.norm(e["embeddings"], axis=1), 1.0, atol=1e-5)
  code, _, err = run_tool("embed", ["--workdir", tuned, "--elf", elf, "--pool", "cls",
                                    "--output", tmp_path / "c.npz"], capsys)
  assert code == 1 and "leave --pool out" in err and err.count("\n") == 1
  doc = tmp_path / "eval.json"
  code, text, err = run_tool("eval_similarity", [
      "--bench", bench, "--workdir", pretrained[1], "--workdir", tuned, "--pool", "10",
      "--pairs", "gcc-O0:gcc-O3", "--no-random-init", "--json", doc], capsys)
  assert code == 0, err
  got = json.load(open(doc))
  info = got["methods"]
  assert info[f"ft@{STEPS}"]["kind"] == "fine-tuned" and info["run@2"]["kind"] == "pretrained"
  assert info[f"ft@{STEPS}"]["init"] == f"workdir:{pretrained[1]}"
  # How much of each function the models see: the share cut at their sequence length.
  model = trained_model.load(workdir=str(pretrained[1]))
  _, groups = function_groups.load(str(bench))
  cut = np.mean([trained_model.encode(model, v["text"])[1] for g in groups
                 for v in g["variants"].values()])
  assert info["run@2"]["seq_len"] == 64 and info["run@2"]["cut_frac"] == pytest.approx(cut)
  assert f"cut at sequence length 64: {cut:.1%} of the" in text and f"ft@{STEPS}" in text
  r1 = {r["method"]: r["recall_at_1"] for r in got["results"] if r["pair"] == "gcc-O0↔gcc-O3"}
  print(f"R@1, pool 10, O0↔O3 (the pairs it was tuned on): {r1}")
  assert set(r1) == {"tfidf", "run@2", f"ft@{STEPS}"}
  assert r1[f"ft@{STEPS}"] > r1["run@2"] + 0.1


@pytest.fixture(scope="module")
def exported(tuned, tmp_path_factory):
  """(directory, the tool's summary line)."""
  out = tmp_path_factory.mktemp("export") / "hf"
  export = tool("export_hf")
  return out, export.export(export.parser().parse_args(["--workdir", str(tuned), "--output",
                                                        str(out)]))


def test_export_writes_the_encoder_and_the_head_that_give_the_same_embedding(
    bench, tuned, exported):
  out, line = exported
  assert "projection head 64→32 (mean pooling)" in line
  assert {"projection.safetensors", "projection.json", "model.safetensors"} <= set(
      os.listdir(out))
  assert "feature-extraction" in (out / "README.md").read_text()
  ft, hf = trained_model.load(workdir=str(tuned)), trained_model.load(hf=str(out))
  _, groups = function_groups.load(str(bench))
  ids = trained_model.pad_batch([trained_model.encode(ft, g["variants"][v]["text"])[0]
                                 for g in groups[:16] for v in ("gcc-O0", "gcc-O3")],
                                ft.cfg.seq_len, 0)
  np.testing.assert_allclose(trained_model.embeddings(hf, ids),
                             trained_model.embeddings(ft, ids), atol=1e-6)
  # The definition, in numpy from the last hidden layer: pool, project, normalise.
  h, keep = trained_model.last_hidden(ft, ids), (ids != 0)[..., None]
  for pool, v in (("mean", (h * keep).sum(1) / keep.sum(1)), ("cls", h[:, 0])):
    head = {**ft.head, "pool": pool}
    z = v @ head["projection"]["kernel"] + head["projection"]["bias"]
    np.testing.assert_allclose(trained_model.embeddings(dataclasses.replace(ft, head=head), ids),
                               z / np.linalg.norm(z, axis=1, keepdims=True), atol=2e-5)


def test_the_export_in_transformers_gives_the_same_embedding(bench, tuned, exported, tmp_path):
  """docs/finetune.md's recipe (AutoTokenizer, AutoModel, projection.*) against JAX (in
  .venv-hf, as every HF parity test: tools/test.sh makes it)."""
  from tests.hf_helpers import hf_side

  _, groups = function_groups.load(str(bench))
  texts = [g["variants"][v]["text"] for g in groups[:6] for v in ("gcc-O0", "gcc-O3")]
  theirs = hf_side(tmp_path, [{"op": "embed", "dir": str(exported[0]), "texts": texts}])[0]
  ft = trained_model.load(workdir=str(tuned))
  rows = [trained_model.encode(ft, t)[0] for t in texts]
  ids = np.asarray(theirs["ids"])  # padded to the longest, cut at seq_len keeping [SEP]
  np.testing.assert_array_equal(ids, trained_model.pad_batch(rows, ids.shape[1], 0))
  ours = trained_model.embeddings(ft, trained_model.pad_batch(rows, ft.cfg.seq_len, 0))
  assert np.abs(np.asarray(theirs["embeddings"]) - ours).max() < 1e-5


# --------------------------------------------------------------------------- bad input
def test_bad_inputs_are_one_line_each(bench, pretrained, tmp_path,
                                                            capsys):
  empty, header_only, other = (tmp_path / n for n in ("empty.jsonl", "header.jsonl", "o.jsonl"))
  empty.write_text("")
  lines = open(bench).read().splitlines()
  header_only.write_text(lines[0] + "\n")
  other.write_text('{"format": "something else"}\n')
  no_ckpt = tmp_path / "no_ckpt"
  no_ckpt.mkdir()
  shutil.copy(pretrained[1] / "config.json", no_ckpt / "config.json")
  # An HF directory whose tokenizer is not the model's: one trained to another vocabulary.
  hf = tmp_path / "hf"
  assert tool("export_hf").main(["--workdir", str(pretrained[1]), "--output", str(hf)]) == 0
  texts = [json.loads(x)["variants"]["gcc-O0"]["text"] for x in lines[1:]]
  toklib.write_hf_files(toklib.train(texts, vocab_size=300, kind="binary"), str(hf),
                        model_max_length=64)
  few = tmp_path / "few.jsonl"
  few.write_text("\n".join(lines[:5]) + "\n")
  start = ["--init-workdir", str(pretrained[1])]
  cases = [
      (["--pairs", tmp_path / "none.jsonl", *start], "--pairs", "no such file"),
      (["--pairs", empty, *start], "--pairs", "not a similarity benchmark"),
      (["--pairs", other, *start], "--pairs", "format 'something else'"),
      (["--pairs", header_only, *start], "--pairs", "no function groups"),
      (["--pairs", bench, "--init-workdir", no_ckpt], str(no_ckpt), "no complete checkpoint"),
      (["--pairs", bench, "--init-hf", hf], str(hf), "not the tokenizer"),
      (["--pairs", bench, "--init-workdir", hf], str(hf), "give --init-hf"),
      (["--pairs", bench, "--init-hf", pretrained[1]], str(pretrained[1]), "give --init-workdir"),
      (["--pairs", few, *start], "4 groups", "fewer than train.batch_size=8"),
      (["--pairs", bench, *start, "--config.finetune.pool=max"], "finetune.pool", "expected one"),
      (["--pairs", bench, *start, "--max-groups", "-1"], "--max-groups", "expected an integer"),
      (["--pairs", bench, *start, "--max-groups", "4"], "4 groups", "fewer than train.batch_size=8"),
  ]
  for argv, where, message in cases:
    workdir = tmp_path / "out"
    code, _, err = run_tool("finetune_similarity", [*argv, "--workdir", workdir,
                                                    "--batch-size", 8], capsys)
    assert code == 1, (argv, err)
    assert err.count("\n") == 1 and where in err and message in err, (argv, err)
    # Input checked before the workdir is locked leaves nothing; a model that fails to load
    # (found once the run holds the workdir) leaves its lock file only.
    assert not workdir.exists() or os.listdir(workdir) == [".lock"], argv
    shutil.rmtree(workdir, ignore_errors=True)
  code, _, err = run_tool("finetune_similarity", ["--pairs", bench, "--workdir", tmp_path / "x"],
                          capsys)
  assert code == 1 and "one of the arguments --init-workdir --init-hf --init-random" in err
