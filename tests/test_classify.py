"""Classification fine-tuning end to end (lmscale finetune --task classify,
finetune/classify_run.py; lmscale classify): a toy compiler-provenance task built from tests/data/similarity with the
machine's gcc (each function at -O0 and at -O3, labelled by its level; the held-out split is
other source functions), started from tests/test_finetune.py's real 2-step pretraining run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from lmscale_jax.evals import classification
from lmscale_jax.finetune import classify_run
from lmscale_jax.inference import trained_model
from lmscale_jax.train import checkpoint as ckpt_lib
from tests.helpers import ROOT, communicate, lmscale
from tests.test_finetune import bench, pretrained, rows, start_job  # noqa: F401 (fixtures)
from tests import test_distributed as dist
from tests.test_hf_tools import run_tool

STEPS = 40
EVAL_EVERY = 20
pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


def write_jsonl(path, objects) -> None:
  path.write_text("".join(json.dumps(o) + "\n" for o in objects))


@pytest.fixture(scope="module")
def task(bench, tmp_path_factory):
  """(train.jsonl, test.jsonl): the first 70 source functions' two variants to train on, the
  other 31's held out; the label is the optimisation level."""
  groups = [json.loads(x) for x in open(bench).read().splitlines()[1:]]
  out = tmp_path_factory.mktemp("task")

  def examples(part):
    return [{"text": v["text"], "label": name.split("-")[1], "library": g["source"],
             "function": g["name"]} for g in part for name, v in sorted(g["variants"].items())]

  write_jsonl(out / "train.jsonl", examples(groups[:70]))
  write_jsonl(out / "test.jsonl", examples(groups[70:]))
  return out / "train.jsonl", out / "test.jsonl"


def args(task, pretrained, workdir, *extra) -> list[str]:
  """The golden run's command line (the stopped run and the 2-device run repeat it)."""
  return [str(a) for a in (
      "--task", "classify", "--labels", task[0], "--eval-labels", task[1], "--workdir", workdir,
      "--init-workdir", pretrained[1], "--steps", STEPS, "--batch-size", 16,
      "--learning-rate", 2e-3, "--warmup-steps", 3, "--dropout", 0.0, "--log-every", 1,
      "--eval-every", EVAL_EVERY, "--checkpoint-every", 4, *extra)]


def train_rows(workdir, key="loss") -> dict:
  return {r["step"]: r[key] for r in rows(workdir) if key in r}


@pytest.fixture(scope="module")
def classified(task, pretrained, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("cls") / "run"
  from lmscale_jax.cli import finetune

  assert finetune.main(args(task, pretrained, workdir)) == 0
  return workdir


def test_a_classification_finetune_learns_a_separable_task(classified, task):
  report = json.load(open(classified / classify_run.EVAL_REPORT))
  print(f"held-out accuracy {report['accuracy']:.3f}, macro-F1 {report['macro_f1']:.3f} "
        f"(majority {report['majority']['accuracy']:.3f}); loss "
        f"{train_rows(classified)[1]:.4f} → {train_rows(classified)[STEPS]:.4f}")
  assert report["step"] == STEPS and report["labels"] == ["O0", "O3"]
  assert report["accuracy"] > 0.9 and report["macro_f1"] > 0.9
  assert report["examples"] == 62 and sum(map(sum, report["confusion"])) == 62
  assert {k: v["support"] for k, v in report["per_label"].items()} == {"O0": 31, "O3": 31}
  evals = {r["step"]: r for r in rows(classified) if "eval_accuracy" in r}
  assert sorted(evals) == [EVAL_EVERY, STEPS]
  assert evals[STEPS]["eval_accuracy"] == report["accuracy"]
  assert sorted(train_rows(classified)) == list(range(1, STEPS + 1))
  assert json.load(open(classified / "labels.json"))["labels"] == ["O0", "O3"]


def test_lmscale_classify_scores_a_finished_run_as_its_last_evaluation(classified, task,
                                                                       tmp_path, capsys):
  out = tmp_path / "scores.json"
  code, said, err = run_tool("classify", ["--workdir", classified, "--labels", task[1],
                                          "--json", out], capsys)
  assert code == 0, err
  scores, report = json.load(open(out)), json.load(open(classified / classify_run.EVAL_REPORT))
  assert scores["accuracy"] == report["accuracy"] and scores["confusion"] == report["confusion"]
  assert f"accuracy {report['accuracy']:.4f}" in said
  lines = open(task[1]).read().splitlines()
  first = scores["predictions"][0]
  assert len(scores["predictions"]) == len(lines) and first["line"] == 1
  assert first["label"] == json.loads(lines[0])["label"] and first["predicted"] in ("O0", "O3")
  assert first["library"] and first["function"]
  again = classification.classification_scores(
      [p["label"] for p in scores["predictions"]], [p["predicted"] for p in scores["predictions"]],
      ["O0", "O3"])
  assert again["macro_f1"] == scores["macro_f1"]
  model = trained_model.load(workdir=str(classified))
  assert model.step == STEPS and model.classifier["labels"] == ["O0", "O3"]
  assert model.classifier["kernel"].shape == (64, 2) and model.head is None
  other = tmp_path / "other.jsonl"
  write_jsonl(other, [{"text": "ret", "label": "O0"}, {"text": "ret", "label": "O2"}])
  code, _, err = run_tool("classify", ["--workdir", classified, "--labels", other], capsys)
  assert code == 1 and err.count("\n") == 1, err
  assert f"unknown label 'O2' at {other}:2; the training labels are 'O0', 'O3'" in err


def test_a_stopped_classification_run_resumes_with_the_uninterrupted_losses_bitwise(
    classified, task, pretrained, tmp_path):
  """The golden run as the lmscale command, stopped by SIGTERM once a checkpoint is saved (it
  saves one and exits 0), then rerun: every step's numbers, and the held-out scores, equal the
  uninterrupted run's."""
  workdir = tmp_path / "stopped"
  argv = [*lmscale("finetune"), *args(task, pretrained, workdir)]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, start_new_session=True)
  deadline = time.monotonic() + 240
  while not ckpt_lib.complete_steps(str(workdir)):
    assert p.poll() is None, p.communicate()[1][-3000:]
    assert time.monotonic() < deadline, "no checkpoint within 240 s"
    time.sleep(0.01)
  p.send_signal(signal.SIGTERM)
  out, err = communicate(p)
  assert p.returncode == 0 and "preempted: stopped after step" in out, err[-3000:]
  stopped = max(ckpt_lib.complete_steps(str(workdir)))
  assert stopped < STEPS, "the run finished before the signal: nothing to resume"
  r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0 and "resumed from" in r.stdout, r.stderr[-3000:]
  print(f"stopped at step {stopped}, resumed")
  for key in ("loss", "accuracy", "grad_norm", "eval_accuracy", "eval_macro_f1"):
    assert train_rows(workdir, key) == train_rows(classified, key), key


def on_two_devices(task, pretrained, workdir, *levers) -> dict:
  """The golden run (with ``levers``) on 2 host devices: its losses by step."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=2")
  r = subprocess.run([*lmscale("finetune"), *args(task, pretrained, workdir, *levers)],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0 and "2 device(s)" in r.stdout, r.stderr[-3000:]
  return train_rows(workdir)


def test_two_devices_equal_one_device(classified, task, pretrained, tmp_path):
  """The golden run on 2 host devices (the batch split 8/8, XLA's all-reduce): the same
  losses to float32 rounding, the same held-out predictions."""
  one, two = train_rows(classified), on_two_devices(task, pretrained, tmp_path / "two")
  assert sorted(one) == sorted(two)
  diff = max(abs(one[s] - two[s]) for s in one)
  print(f"largest loss difference over {STEPS} steps: {diff:.2e}")  # 6.0e-08 measured
  assert diff < 1e-6
  assert train_rows(tmp_path / "two", "eval_accuracy") == train_rows(classified,
                                                                     "eval_accuracy")


def test_fsdp_accumulation_and_remat_give_the_plain_step_losses(classified, task, pretrained,
                                                                tmp_path):
  """Pretraining's levers through the classification task (the shard_map path: parameters
  and moments sharded over 2 devices, 2 microbatches a step, the encoder recomputed): the
  plain step's losses to float32 rounding."""
  levers = on_two_devices(task, pretrained, tmp_path / "levers", "--config.train.fsdp=true",
                          "--config.train.grad_accum_steps=2", "--config.train.remat=full")
  one = train_rows(classified)
  rel = max(abs(levers[s] - one[s]) / one[s] for s in one)
  print(f"fsdp + accumulation + remat: largest relative loss difference {rel:.2e}")
  assert rel < 1e-5  # 8.3e-07 measured


def test_two_processes_log_the_one_process_losses_and_scores(classified, task, pretrained,
                                                             tmp_path):
  """The golden run in 2 processes (gloo, 8 rows each a step; the held-out batches split the
  same way): every loss as the in-process run's to rtol 1e-5, the same held-out scores."""
  workdir = tmp_path / "procs"
  procs = start_job(args(task, pretrained, workdir), XLA_FLAGS=os.environ.get("XLA_FLAGS", ""))
  try:
    results = [communicate(p, 300) for p in procs]
  finally:
    dist.kill_all(procs)
  for p, (_, err) in zip(procs, results):
    assert p.returncode == 0, err[-3000:]
  assert f"done: step {STEPS}" in results[0][0] and "done:" not in results[1][0]
  one, two = train_rows(classified), train_rows(workdir)
  np.testing.assert_allclose([two[s] for s in sorted(one)], [one[s] for s in sorted(one)],
                             rtol=1e-5)
  assert train_rows(workdir, "eval_accuracy") == train_rows(classified, "eval_accuracy")
  report = json.load(open(workdir / classify_run.EVAL_REPORT))
  assert report["confusion"] == json.load(open(classified / classify_run.EVAL_REPORT))["confusion"]


# --------------------------------------------------------------------------- bad input
def test_bad_labels_files_are_one_line_each_before_any_work(task, pretrained, tmp_path):
  good = [json.loads(x) for x in open(task[0]).read().splitlines()]
  files = {
      "empty": "",
      "notjson": json.dumps(good[0]) + "\n{text: oops\n",
      "nolabel": json.dumps(good[0]) + "\n" + json.dumps({"text": "ret"}) + "\n",
      "array": "[1, 2]\n",
      "oneclass": "".join(json.dumps(dict(g, label="O0")) + "\n" for g in good),
      "unknown": json.dumps(good[0]) + "\n" + json.dumps(dict(good[1], label="O2")) + "\n",
  }
  for name, text in files.items():
    (tmp_path / f"{name}.jsonl").write_text(text)
  f = lambda name: str(tmp_path / f"{name}.jsonl")  # noqa: E731
  train, test = str(task[0]), str(task[1])
  cases = [
      ([train, f("empty")], f("empty"), "no examples (an empty file"),
      ([f("notjson"), test], f"{f('notjson')}:2", "not a JSON object"),
      ([f("nolabel"), test], f"{f('nolabel')}:2", '"label" is missing, expected a string'),
      ([f("array"), test], f"{f('array')}:1", "a JSON list, expected an object"),
      ([f("oneclass"), test], f("oneclass"), "a classifier needs two or more classes"),
      ([train, f("unknown")], f"unknown label 'O2' at {f('unknown')}:2",
       "the training labels are 'O0', 'O3' (2)"),
      ([str(tmp_path / "none.jsonl"), test], "none.jsonl", "no such file"),
  ]
  for (train_file, test_file), where, message in cases:
    workdir = tmp_path / "out"
    r = subprocess.run([*lmscale("finetune"), "--task", "classify", "--labels", train_file,
                        "--eval-labels", test_file, "--workdir", workdir, "--init-workdir",
                        pretrained[1], "--batch-size", "8"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 1, (where, r.stderr)
    assert r.stderr.count("\n") == 1 and where in r.stderr and message in r.stderr, r.stderr
    assert not workdir.exists(), where  # refused before the workdir, the runtime, a checkpoint
  r = subprocess.run([*lmscale("finetune"), "--task", "classify", "--labels", train,
                      "--workdir", tmp_path / "out", "--init-workdir", pretrained[1]],
                     cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert r.returncode == 1 and "--eval-labels" in r.stderr and r.stderr.count("\n") == 1


def test_a_resume_over_another_labels_file_is_one_line(classified, task, pretrained, tmp_path,
                                                       capsys):
  """Extending the finished run with another training file (a line dropped; the path change
  allowed) is refused before a step: its batches would not be the checkpoint's."""
  from lmscale_jax.cli import finetune

  workdir = tmp_path / "run"
  shutil.copytree(classified, workdir)
  other = tmp_path / "other.jsonl"
  other.write_text("".join(open(task[0]).readlines()[:-1]))
  argv = args((other, task[1]), pretrained, workdir, "--allow-config-change")
  argv[argv.index("--steps") + 1] = str(STEPS + 4)
  assert finetune.main(argv) == 1
  err = capsys.readouterr().err
  assert f"--labels {other} is not the file the checkpoint was trained on" in err, err
  assert err.count("error:") == 1
  assert max(train_rows(workdir)) == STEPS  # nothing trained


def test_a_contrastive_workdir_is_not_resumed_as_a_classifier(task, pretrained, tmp_path,
                                                              capsys):
  workdir = tmp_path / "ft"
  workdir.mkdir()
  record = json.load(open(pretrained[1] / "config.json"))
  record["config"] = {**record["config"], "finetune": {"task": "contrastive"}}
  (workdir / "config.json").write_text(json.dumps(record))
  code, _, err = run_tool("finetune", args(task, pretrained, workdir), capsys)
  assert code == 1 and "holds a --task contrastive fine-tuning run" in err, err


# --------------------------------------------------------------------------- export
def test_the_exported_classifier_in_transformers_gives_our_logits(classified, task, tmp_path,
                                                                  capsys):
  """lmscale export-hf of the classification run (model/hf_classifier.save_classifier) →
  AutoModelForSequenceClassification (trust_remote_code): the held-out texts' logits are ours,
  its id2label the run's classes, and the card names the held-out scores."""
  from tests.hf_helpers import hf_side

  out = tmp_path / "hf"
  code, printed, err = run_tool("export_hf", ["--workdir", classified, "--output", out], capsys)
  assert code == 0, err
  assert "LmscaleForSequenceClassification, 2 classes" in printed
  card = (out / "README.md").read_text()
  assert "pipeline_tag: text-classification" in card and "macro-F1" in card
  model = trained_model.load(workdir=str(classified))
  texts = [json.loads(x)["text"] for x in open(task[1]).read().splitlines()[:8]]
  ids = trained_model.pad_batch([trained_model.encode(model, t)[0] for t in texts],
                                model.cfg.seq_len, model.special_ids["[PAD]"])
  theirs, = hf_side(tmp_path, [{"op": "remote", "dir": str(out), "ids": ids.tolist(),
                                "auto": "AutoModelForSequenceClassification"}])
  assert theirs["class"] == "LmscaleForSequenceClassification"
  assert theirs["id2label"] == {"0": "O0", "1": "O3"}
  diff = np.abs(np.asarray(theirs["logits"]) - trained_model.class_logits(model, ids)).max()
  print(f"exported classifier: max |logits diff| {diff:.2e}")
  assert diff < 1e-4


def test_the_text_an_encoder_reads_gives_its_ids_and_limits_the_baseline(task, pretrained,
                                                                        tmp_path):
  """trained_model.text_read: the prefix of a function whose ids are the ones the encoder keeps
  (seq_len 64 here: most functions are cut); provenance_baseline.py --read-as fits on those."""
  model = trained_model.from_workdir(str(pretrained[1]))
  texts = [json.loads(x)["text"] for x in open(task[0])]
  cut = 0
  for text in texts:
    read = trained_model.text_read(model, text)
    ids, was_cut = trained_model.encode(model, text)
    assert text.startswith(read) and (read == text) != was_cut
    assert trained_model.encode(model, read)[0].tolist() == ids.tolist()
    cut += was_cut
  assert cut > len(texts) // 2
  r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "provenance_baseline.py"),
                      "--task", os.path.dirname(task[0]), "--read-as", str(pretrained[1]),
                      "--json", str(tmp_path / "b.json")], capture_output=True, text=True,
                     timeout=300, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert r.returncode == 0, r.stderr
  doc = json.load(open(tmp_path / "b.json"))
  assert doc["read_as"] == os.path.abspath(pretrained[1]) and "texts cut to what" in r.stdout


# --------------------------------------------------------------------------- windows
def test_a_long_function_reads_as_windows_cut_at_instructions_in_order(task, pretrained):
  """trained_model.text_windows: consecutive windows that together are the function (joined at
  the [NEXT] each cut falls on), each kept whole by encode, at most the number asked for."""
  model = trained_model.from_workdir(str(pretrained[1]))
  texts = [json.loads(x)["text"] for x in open(task[0])]
  counts = []
  for text in texts:
    windows = trained_model.text_windows(model, text, 1000)
    assert " [NEXT] ".join(windows) == text
    assert not any(trained_model.encode(model, w)[1] for w in windows)
    assert trained_model.text_windows(model, text, 2) == windows[:2]
    assert windows[0] == text or trained_model.text_read(model, text).startswith(windows[0])
    counts.append(len(windows))
  print(f"windows per function: max {max(counts)}, mean {np.mean(counts):.2f}")
  assert min(counts) == 1 and max(counts) >= 3
  assert trained_model.text_windows(model, "", 4) == [""]


WINDOWS = 4


@pytest.fixture(scope="module")
def windowed(task, pretrained, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("cls-windows") / "run"
  from lmscale_jax.cli import finetune

  argv = args(task, pretrained, workdir, "--windows", WINDOWS)
  argv[argv.index("--steps") + 1] = argv[argv.index("--eval-every") + 1] = "20"
  assert finetune.main(argv) == 0
  return workdir


def test_a_run_on_windows_trains_on_each_and_scores_a_function_by_their_mean(windowed, task,
                                                                             tmp_path, capsys):
  """--windows 4: every training function's windows are rows of its label; the held-out report
  counts functions (62), and lmscale classify scores them as the run's last evaluation did,
  from the mean of each function's window log-probabilities (checked against the model)."""
  report = json.load(open(windowed / classify_run.EVAL_REPORT))
  assert report["examples"] == 62 and sum(map(sum, report["confusion"])) == 62
  assert json.load(open(windowed / "config.json"))["config"]["finetune"]["windows"] == WINDOWS
  out = tmp_path / "scores.json"
  code, said, err = run_tool("classify", ["--workdir", windowed, "--labels", task[1],
                                          "--json", out, "--batch-size", 5], capsys)
  assert code == 0, err
  scores = json.load(open(out))
  assert scores["confusion"] == report["confusion"] and len(scores["predictions"]) == 62
  model = trained_model.load(workdir=str(windowed))
  texts = [json.loads(x)["text"] for x in open(task[1]).read().splitlines()]
  mine = []
  for text in texts:
    windows = trained_model.text_windows(model, text, WINDOWS)
    ids = trained_model.pad_batch([trained_model.encode(model, w)[0] for w in windows],
                                  model.cfg.seq_len, model.special_ids["[PAD]"])
    logits = trained_model.class_logits(model, ids).astype(np.float64)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    mine.append(model.classifier["labels"][int(np.argmax(log_probs.mean(0)))])
  assert [p["predicted"] for p in scores["predictions"]] == mine
  code, printed, err = run_tool("export_hf", ["--workdir", windowed, "--output",
                                              tmp_path / "hf"], capsys)
  assert code == 0, err
  assert json.load(open(tmp_path / "hf" / "config.json"))["windows"] == WINDOWS
  assert f"up to {WINDOWS} windows" in (tmp_path / "hf" / "README.md").read_text()


def test_windows_on_another_task_are_one_line_before_any_work(bench, pretrained, tmp_path):
  r = subprocess.run([*lmscale("finetune"), "--pairs", bench, "--workdir", tmp_path / "out",
                      "--init-workdir", pretrained[1], "--windows", "3"], cwd=ROOT,
                     capture_output=True, text=True, timeout=120,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
  assert "finetune.windows=3: only --task classify" in r.stderr
  assert not (tmp_path / "out").exists()
