"""Bad input and careless use of training: each is one ``error:`` line naming the key, file or
holder and the fix, never a traceback, a silent change of results or a corrupted workdir.

Two runs on one workdir (its lock), resume under a changed config, unvalidated numbers,
corrupt shards at start-up, command-line mistakes, Ctrl-C, a full disk, a too-short
validation split and a workdir already past ``train.steps``. Runs are real ``python -m
lmscale_jax.main`` processes (own session, timeout, killed on failure) or real
``train.train_and_evaluate`` calls with real Orbax checkpoints; nothing is mocked.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from tests.helpers import ROOT, make_synthetic_dataset, small_train_config
from tests.test_faults import args, assert_same_run, finish, run, series, start, wait_for


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  d = tmp_path_factory.mktemp("bdata") / "ds"
  make_synthetic_dataset(str(d), seq_len=64, vocab_size=128, n_train=256, n_val=32)
  return d


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  """A shared XLA compilation cache (see tests/test_faults.py: same program, same numbers)."""
  return tmp_path_factory.mktemp("bxla")


@pytest.fixture(scope="module")
def reference(data, cache, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("bref") / "w"
  run(args(data, workdir), cache)
  return workdir


def main(cmd_args, timeout=300, **extra) -> subprocess.CompletedProcess:
  e = dict(os.environ, JAX_PLATFORMS="cpu", **extra)
  e.pop("JAX_NUM_CPU_DEVICES", None)
  return subprocess.run([sys.executable, "-m", "lmscale_jax.main", *cmd_args], cwd=ROOT, env=e,
                        capture_output=True, text=True, timeout=timeout)


def one_line(stderr: str) -> str:
  """The last line, after checking it is an error line and no traceback came with it.
  Python's resource tracker warns at exit about shared memory Grain's worker processes leave
  (a finished run with data.workers > 0 does it too): not ours, skipped."""
  assert "Traceback" not in stderr, stderr[-3000:]
  lines = [line for line in stderr.strip().splitlines()
           if "resource_tracker" not in line and "warnings.warn(" not in line]
  last = lines[-1]
  assert last.startswith("error: "), stderr[-3000:]
  return last


# ----------------------------------------------------------------------------- case 2: lock
def test_second_run_on_a_busy_workdir_names_the_holder_and_touches_nothing(
    data, cache, reference, tmp_path):
  """Run A trains; run B (another learning rate) starts on the same workdir while A is
  saving checkpoints. B exits at once with one line naming A's pid and host; A finishes with
  exactly the uninterrupted run's numbers (B neither deleted its in-flight checkpoint nor
  wrote metrics rows or a checkpoint)."""
  workdir = tmp_path / "w"
  a = start(args(data, workdir), cache)
  try:
    wait_for(a, lambda: len(series(workdir)) >= 2)
    # A is paused while B starts (as if its disk were slow), so B's whole start-up overlaps
    # A's run, however long B takes to start on a loaded machine; A's lock stays held.
    os.killpg(a.pid, signal.SIGSTOP)
    try:
      b = start(args(data, workdir, **{"train.learning_rate": 0.01}), cache)
      err = finish(b, timeout=120)
    finally:
      os.killpg(a.pid, signal.SIGCONT)
    assert b.returncode == 1, err[-3000:]
    line = one_line(err)
    assert f"--workdir {workdir} is in use by another run (pid {a.pid} on host " \
           f"{socket.gethostname()}" in line, line
  finally:
    err_a = finish(a)
  assert a.returncode == 0, err_a[-3000:]
  assert_same_run(workdir, reference)
  config = json.load(open(workdir / "config.json"))
  assert config["config"]["train"]["learning_rate"] != 0.01 and "changes" not in config


def test_runs_started_together_one_wins(data, cache, reference, tmp_path):
  """Two identical runs started at the same moment: one trains to the end, the other is one
  line (no FileExistsError traceback from TensorBoard, no mixed rows)."""
  workdir = tmp_path / "w"
  procs = [start(args(data, workdir), cache) for _ in range(2)]
  errs = [finish(p) for p in procs]
  codes = sorted(p.returncode for p in procs)
  # [0, 0] only when one start-up outlasted the whole other run (a loaded machine): then it
  # was a resume of a finished run, not a concurrent one, and must not have changed it either.
  assert codes in ([0, 1], [0, 0]), [e[-2000:] for e in errs]
  if codes == [0, 1]:
    loser = errs[[p.returncode for p in procs].index(1)]
    assert "is in use by another run" in one_line(loser)
  assert_same_run(workdir, reference)


def test_lock_holder_refuses_a_whole_multi_process_job(data, tmp_path):
  """A 2-process job on a workdir another process holds: process 0 fails to take the lock
  and process 1 learns it through distributed.agree; both stop with one line, nothing in the
  workdir is touched (no token file, no checkpoints)."""
  from lmscale_jax.train import workdir as workdir_lib

  workdir = tmp_path / "w"
  assert workdir_lib.lock_workdir(str(workdir))
  try:
    e = dict(os.environ, JAX_PLATFORMS="cpu")
    e.pop("JAX_NUM_CPU_DEVICES", None)
    r = subprocess.run(
        ["bash", f"{ROOT}/launch/local.sh", "2", "--", f"--config={ROOT}/configs/tiny.py",
         f"--workdir={workdir}", f"--config.data.path={data}", "--config.train.batch_size=8"],
        cwd=ROOT, env=e, capture_output=True, text=True, timeout=300, start_new_session=True)
  finally:
    workdir_lib.unlock_workdir(str(workdir))
  assert r.returncode != 0, r.stderr[-3000:]
  assert "Traceback" not in r.stderr, r.stderr[-3000:]
  holder = f"pid {os.getpid()} on host {socket.gethostname()}"
  lines = [line for line in r.stderr.splitlines() if "error: process" in line]
  assert any(line.startswith("[0] error: process 0:") and holder in line for line in lines), \
      r.stderr[-3000:]
  assert any(line.startswith("[1] error: process 1:") and "workdir lock failed" in line
             and holder in line for line in lines), r.stderr[-3000:]
  # Nothing but the holder's lock was in it, and the holder made it: its release removed both.
  assert not workdir.exists(), sorted(os.listdir(workdir))


def test_lock_is_released_when_a_library_run_returns(data, tmp_path):
  from lmscale_jax.pretrain import trainer as train
  from lmscale_jax.train import workdir as workdir_lib

  workdir = tmp_path / "w"
  train.train_and_evaluate(small_train_config(data, steps=1), str(workdir))
  assert workdir_lib.lock_workdir(str(workdir))  # free again (the same process could re-take)
  workdir_lib.unlock_workdir(str(workdir))


# ----------------------------------------------------------------------------- case 4: resume
@pytest.fixture(scope="module")
def step3(data, tmp_path_factory):
  """A workdir trained to step 3 (real Orbax checkpoint), copied for each test."""
  from lmscale_jax.pretrain import trainer as train

  w = tmp_path_factory.mktemp("step3") / "w"
  train.train_and_evaluate(small_train_config(data, steps=3), str(w))
  return w


@pytest.fixture
def resumable(step3, tmp_path):
  w = tmp_path / "w"
  shutil.copytree(step3, w)
  return w


@pytest.mark.parametrize("section,key,value,old", [
    ("train", "batch_size", 16, 8), ("data", "seed", 7, 0),
    ("train", "learning_rate", 1e-3, 2e-3), ("data", "mask_prob", 0.2, 0.15),
    ("train", "grad_accum_steps", 2, 1)])
def test_resume_refuses_a_changed_result_key(data, resumable, section, key, value, old):
  from lmscale_jax.train import checkpoint
  from lmscale_jax.pretrain import trainer as train

  c = small_train_config(data)
  c[section][key] = value
  before = (resumable / "config.json").read_bytes()
  with pytest.raises(checkpoint.IncompatibleCheckpoint) as e:
    train.train_and_evaluate(c, str(resumable))
  assert str(e.value) == (
      f"{resumable}: its checkpoint at step 3 was trained with {section}.{key}={old!r}, this run "
      f"has {section}.{key}={value!r}; it changes the data stream or the optimisation of the "
      "saved run: use the original value, a new --workdir, or --allow_config_change to "
      "continue with the change (recorded in config.json)")
  assert (resumable / "config.json").read_bytes() == before
  assert sorted(os.listdir(resumable / "checkpoints")) == ["3"]


def test_allow_config_change_records_the_change(data, resumable, caplog):
  from lmscale_jax.pretrain import trainer as train

  c = small_train_config(data)
  c.train.batch_size, c.data.seed = 16, 7
  with caplog.at_level(logging.WARNING):
    train.train_and_evaluate(c, str(resumable), allow_config_change=True)
  saved = json.load(open(resumable / "config.json"))
  assert saved["config"]["train"]["batch_size"] == 16 and saved["config"]["data"]["seed"] == 7
  assert saved["changes"] == [
      {"step": 4, "key": "data.seed", "from": 0, "to": 7},
      {"step": 4, "key": "train.batch_size", "from": 8, "to": 16},
      {"step": 4, "key": "train.steps", "from": 3, "to": 6}]
  assert "config change from step 4 on (recorded in config.json): train.batch_size: 8 -> 16" \
      in caplog.text
  assert sorted(os.listdir(resumable / "checkpoints")) == ["3", "6"]


def test_allow_config_change_flag_of_main(data, resumable):
  cmd = [f"--config={ROOT}/configs/tiny.py", f"--workdir={resumable}",
         f"--config.data.path={data}", "--config.model.layers=2", "--config.model.hidden=64",
         "--config.model.heads=2", "--config.model.ffn=128", "--config.train.batch_size=8",
         "--config.train.steps=4", "--config.data.seed=7", "--config.train.eval_batches=2",
         "--config.checkpoint.every=3"]
  r = main(cmd)
  assert r.returncode == 1 and "data.seed=0, this run has data.seed=7" in one_line(r.stderr)
  r = main(cmd + ["--allow_config_change"])
  assert r.returncode == 0, r.stderr[-3000:]
  changes = json.load(open(resumable / "config.json"))["changes"]
  assert {"step": 4, "key": "data.seed", "from": 0, "to": 7} in changes


def test_neutral_changes_resume_silently(data, resumable):
  from lmscale_jax.pretrain import trainer as train

  c = small_train_config(data, steps=3, log_every=2, eval_every=5)
  c.checkpoint.every, c.data.workers, c.train.eval_batches = 2, 1, 1
  train.train_and_evaluate(c, str(resumable))
  saved = json.load(open(resumable / "config.json"))
  assert saved.get("changes", []) == [] and saved["config"]["train"]["log_every"] == 2


# ----------------------------------------------------------------------------- case 4b: the
# run's dataset and record
def _copy_with_tokens_swapped(data, to) -> str:
  """The same shards and vocabulary size, a tokenizer with two tokens' ids exchanged: what a
  dataset prepared from other inputs with the same --vocab-size/--seq-len looks like."""
  shutil.copytree(data, to)
  path = to / "tokenizer.json"
  tok = json.loads(path.read_text())
  vocab = tok["model"]["vocab"]
  vocab["t10"], vocab["t11"] = vocab["t11"], vocab["t10"]
  path.write_text(json.dumps(tok))
  return str(to)


def test_a_run_resumes_only_on_a_dataset_of_its_tokenizer(data, resumable, tmp_path):
  """Another tokenizer with the same vocabulary size and sequence length is refused, with or
  without --allow_config_change, naming both digests; nothing is written."""
  from lmscale_jax.train import checkpoint
  from lmscale_jax.pretrain import trainer as train

  other = _copy_with_tokens_swapped(data, tmp_path / "other")
  before = (resumable / "config.json").read_bytes()
  for allow in (False, True):
    with pytest.raises(checkpoint.IncompatibleCheckpoint) as e:
      train.train_and_evaluate(small_train_config(other), str(resumable),
                               allow_config_change=allow)
    assert str(e.value).startswith(f"data.path {other} has another tokenizer than the run in "
                                   f"{resumable} was trained with (tokenizer.json sha256 ")
    assert f"from {data})" in str(e.value) and "would mean other tokens" in str(e.value)
  assert (resumable / "config.json").read_bytes() == before
  assert sorted(os.listdir(resumable / "checkpoints")) == ["3"]


def test_other_data_of_the_same_tokenizer_is_a_recorded_change_and_a_copy_is_none(
    data, resumable, tmp_path):
  """Another corpus with the run's tokenizer: refused without --allow_config_change, recorded
  as a "dataset" change with it. A copy of the run's dataset elsewhere (staged, or data.path
  relative to another directory): resumed as the same dataset, its path recorded absolute."""
  from lmscale_jax.train import checkpoint
  from lmscale_jax.pretrain import trainer as train

  other = tmp_path / "other"
  make_synthetic_dataset(str(other), seq_len=64, vocab_size=128, n_train=256, n_val=32, seed=1)
  with pytest.raises(checkpoint.IncompatibleCheckpoint, match=(
      f"trained on the dataset {data}, data.path {other} holds other data")):
    train.train_and_evaluate(small_train_config(other), str(resumable))
  copy = shutil.copytree(data, tmp_path / "copy")
  train.train_and_evaluate(small_train_config(copy, steps=4), str(resumable))
  saved = json.load(open(resumable / "config.json"))
  assert saved["dataset"]["path"] == str(copy) and os.path.isabs(saved["dataset"]["path"])
  assert [c["key"] for c in saved["changes"]] == ["train.steps"]
  train.train_and_evaluate(small_train_config(other, steps=5), str(resumable),
                           allow_config_change=True)
  change = json.load(open(resumable / "config.json"))["changes"][-1]
  assert change["step"] == 5 and change["key"] == "dataset"
  assert change["from"]["path"] == str(copy) and change["to"]["path"] == str(other)


@pytest.mark.parametrize("damage", ["missing", "truncated", "empty_object", "a_list"])
def test_a_lost_or_damaged_config_json_comes_back_from_the_checkpoint(data, resumable, caplog,
                                                                      damage):
  """Each checkpoint keeps the run's record: with config.json gone or damaged the resume rules
  still hold (a changed batch size refused), and the same config resumes and writes it back
  as it was."""
  from lmscale_jax.train import checkpoint
  from lmscale_jax.pretrain import trainer as train

  path = resumable / "config.json"
  original = json.loads(path.read_text())
  text = path.read_text()
  path.unlink()
  if damage != "missing":
    path.write_text({"truncated": text[:100], "empty_object": "{}", "a_list": "[]"}[damage])
  c = small_train_config(data)
  c.train.batch_size = 16
  with pytest.raises(checkpoint.IncompatibleCheckpoint, match="train.batch_size=8, this run "
                     "has train.batch_size=16"):
    train.train_and_evaluate(c, str(resumable))
  with caplog.at_level(logging.WARNING):
    train.train_and_evaluate(small_train_config(data, steps=3), str(resumable))
  assert f"the run's config is the copy kept in checkpoint {resumable}/checkpoints/3" \
      in caplog.text
  assert json.loads(path.read_text()) == original


def test_checkpoints_without_a_readable_record_are_one_line(data, resumable, tmp_path):
  """A checkpoint from before records were kept, config.json gone: the resume rules cannot
  be checked, so nothing resumes (a batch size of 16 over 8 was taken silently)."""
  r = main([f"--config={ROOT}/configs/tiny.py", f"--workdir={resumable}",
            f"--config.data.path={data}", "--config.train.batch_size=16",
            "--config.train.steps=4"])
  assert r.returncode == 1
  os.remove(resumable / "config.json")
  shutil.rmtree(resumable / "checkpoints" / "3" / "config")  # as an older version wrote it
  for name in os.listdir(resumable / "checkpoints" / "3"):  # its manifest listed no record
    if name.startswith("manifest."):
      manifest = resumable / "checkpoints" / "3" / name
      doc = json.loads(manifest.read_text())
      doc["files"] = {k: v for k, v in doc["files"].items() if not k.startswith("config/")}
      manifest.write_text(json.dumps(doc))
  r = main([f"--config={ROOT}/configs/tiny.py", f"--workdir={resumable}",
            f"--config.data.path={data}", "--config.train.batch_size=16",
            "--config.train.steps=4"])
  assert r.returncode == 1
  assert one_line(r.stderr) == (
      f"error: {resumable} holds checkpoint 3 but its config.json is missing, and the "
      "checkpoint predates the copy of the config each checkpoint keeps: what a resume may "
      "change cannot be checked. Put config.json back from a copy, or give a new --workdir")
  assert not (resumable / "config.json").exists()


@pytest.mark.parametrize("name,make,kind,expected", [
    ("metrics.jsonl", "dir", "a directory", "file"),
    ("config.json", "fifo", "a FIFO", "file"),
    ("checkpoints", "file", "a regular file", "directory"),
    ("tensorboard", "file", "a regular file", "directory"),
    ("run_state.json", "dir", "a directory", "file")])
def test_a_workdir_entry_of_the_wrong_kind_is_one_line(data, tmp_path, name, make, kind,
                                                       expected):
  workdir = tmp_path / "w"
  workdir.mkdir()
  entry = workdir / name
  {"dir": entry.mkdir, "file": entry.touch, "fifo": lambda: os.mkfifo(entry)}[make]()
  r = main(args(data, workdir, **{"train.steps": 2}), timeout=120)
  assert r.returncode == 1
  assert one_line(r.stderr) == (f"error: {entry} is {kind}, but a run keeps a {expected} "
                                "there: move it away, or give another --workdir")


def test_a_workdir_older_than_a_key_resumes_under_the_keys_legacy_value(data, resumable):
  """config.json written before model.packed_attention, init_from and train.grad_allreduce
  existed: the run it holds was "cross" with no init, so that resumes as unchanged and
  "segment" is a result change; the reduction's layout ("auto") is not recorded as a change."""
  from lmscale_jax.train import checkpoint
  from lmscale_jax.pretrain import trainer as train
  from lmscale_jax.train import run_record

  path = resumable / "config.json"
  saved = json.load(open(path))
  del saved["config"]["model"]["packed_attention"], saved["config"]["init_from"]
  del saved["config"]["train"]["grad_allreduce"]
  path.write_text(json.dumps(saved))
  # and the fine-tuning levers' keys (its config.json had none before the one train step)
  assert set(run_record.LEGACY_VALUES) == {"model.packed_attention", "init_from",
                                            "train.grad_allreduce", "train.grad_accum_steps",
                                            "train.grad_allreduce_dtype", "train.fsdp",
                                            "train.remat", "train.dropout_rng",
                                            "train.max_consecutive_nonfinite",
                                            "train.inject_nonfinite_steps",
                                            "train.warmup_fraction", "finetune.task",
                                            "finetune.labels", "finetune.eval_labels",
                                            "finetune.name_min_count",
                                            "finetune.name_calibration",
                                            "finetune.name_library_share",
                                            "finetune.windows"}
  with pytest.raises(checkpoint.IncompatibleCheckpoint, match="model.packed_attention='cross', "
                     "this run has model.packed_attention='segment'"):
    train.train_and_evaluate(small_train_config(data, steps=4), str(resumable))
  c = small_train_config(data, steps=4)
  c.model.packed_attention = "cross"
  train.train_and_evaluate(c, str(resumable))
  assert json.load(open(path))["changes"] == [
      {"step": 4, "key": "train.steps", "from": 3, "to": 4}]


def test_every_config_key_has_a_resume_rule():
  """A key added to the defaults must be classified (else it defaults to refusing a resume,
  which is safe but may surprise): every key appears in exactly one list."""
  from lmscale_jax.config import checks as config_checks
  from lmscale_jax.config import defaults as config_defaults
  from lmscale_jax.train import run_record

  flat = config_checks.flat_keys(json.loads(config_defaults.get_base_config().to_json()))
  lists = {"state": run_record.STATE_KEYS, "result": run_record.RESULT_KEYS,
           "extend": run_record.EXTEND_KEYS, "neutral": run_record.NEUTRAL_KEYS}
  for key in flat:
    hits = [rule for rule, keys in lists.items()
            if any(key == k or key.startswith(f"{k}.") for k in keys)]
    assert len(hits) == 1, (key, hits)


# ----------------------------------------------------------------------------- case 5: numbers
BAD_VALUES = [
    ("train", "learning_rate", float("nan"),
     "train.learning_rate=nan: expected a finite number > 0"),
    ("train", "learning_rate", -1.0, "train.learning_rate=-1.0: expected a finite number > 0"),
    ("train", "learning_rate", float("inf"), "train.learning_rate=inf: expected a finite number"),
    ("train", "warmup_steps", -5, "train.warmup_steps=-5: expected an integer >= 0"),
    ("train", "end_lr_frac", 1.5, r"train.end_lr_frac=1.5: expected a finite number in \[0, 1\]"),
    ("train", "weight_decay", -0.1, "train.weight_decay=-0.1: expected a finite number >= 0"),
    ("train", "b1", 1.0, r"train.b1=1.0: expected a finite number in \[0, 1\)"),
    ("train", "b2", -0.5, r"train.b2=-0.5: expected a finite number in \[0, 1\)"),
    ("train", "eps", 0.0, "train.eps=0.0: expected a finite number > 0"),
    ("train", "clip_norm", 0.0, "train.clip_norm=0.0: expected a finite number > 0"),
    ("train", "steps", 0, "train.steps=0: expected a positive integer"),
    ("train", "seed", -1, "train.seed=-1: expected an integer >= 0"),
    ("model", "dropout", 1.0, r"model.dropout=1.0: expected a finite number in \[0, 1\)"),
    ("model", "attention_dropout", float("nan"), "model.attention_dropout=nan"),
    ("model", "layers", 0, "model.layers=0: expected a positive integer"),
    ("model", "hidden", -64, "model.hidden=-64: expected a positive integer"),
    ("model", "layer_norm_eps", 0.0, "model.layer_norm_eps=0.0: expected a finite number > 0"),
    ("data", "mask_prob", 0.0, r"data.mask_prob=0.0: expected a finite number in \(0, 1\)"),
    ("data", "mask_prob", 1.0, r"data.mask_prob=1.0: expected a finite number in \(0, 1\)"),
    ("data", "max_predictions", -1, "data.max_predictions=-1: expected an integer >= 0"),
    ("data", "workers", -2, "data.workers=-2: expected an integer >= 0"),
    ("data", "on_corrupt", "ignore", r"data.on_corrupt='ignore': expected one of"),
    ("metrics", "peak_tflops", -1.0, "metrics.peak_tflops=-1.0: expected a finite number >= 0"),
]


@pytest.mark.parametrize("section,key,value,match", BAD_VALUES)
def test_every_numeric_key_is_validated(data, section, key, value, match):
  from lmscale_jax.config import checks as config_checks
  from lmscale_jax.errors import ConfigError

  c = small_train_config(data)
  c[section][key] = value
  with pytest.raises(ConfigError, match=match):
    config_checks.check_config(c)


def test_every_numeric_default_key_has_a_rule():
  """A numeric key added to the defaults without a range would reach the step unchecked."""
  from lmscale_jax.config import checks as config_checks
  from lmscale_jax.config import defaults as config_defaults

  checked = {k for k, _ in config_checks._INTS} | {k for k, *_ in config_checks._FLOATS}
  config = config_defaults.get_base_config()
  for section in ("train", "model", "data", "checkpoint", "metrics"):
    for key, value in config[section].items():
      if isinstance(value, (int, float)) and not isinstance(value, bool):
        assert f"{section}.{key}" in checked, f"{section}.{key} has no range check"


@pytest.mark.parametrize("value", ["nan", "-1"])
def test_bad_learning_rate_on_the_command_line_is_one_line(data, tmp_path, value):
  r = main([f"--config={ROOT}/configs/tiny.py", f"--workdir={tmp_path / 'w'}",
            f"--config.data.path={data}", f"--config.train.learning_rate={value}"])
  assert r.returncode == 1
  assert one_line(r.stderr).startswith(f"error: train.learning_rate={float(value)}: expected")
  assert not (tmp_path / "w").exists()  # refused before anything was created


@pytest.mark.parametrize("override, message", [
    ("model.dtype=bf16", "model.dtype='bf16': expected one of ['float32', 'bfloat16']"),
    ("train.remat=some", "train.remat='some': expected one of ['none', 'dots', 'full']"),
    ("model.attention_impl=flash", "model.attention_impl='flash': expected one of"),
    ("model.heads=5", "model.hidden=128 is not divisible by model.heads=5"),
])
def test_a_model_rule_is_one_line_before_the_runtime_starts(data, tmp_path, override, message):
  """These failed in the model, after the workdir was locked and staging had run (up to
  data.stage_timeout): now before anything starts, so the staging source is never read."""
  staged = tmp_path / "staged"
  r = main([f"--config={ROOT}/configs/tiny.py", f"--workdir={tmp_path / 'w'}",
            f"--config.data.path={staged}", f"--config.data.stage_from={data}",
            f"--config.{override}"], timeout=120)
  assert r.returncode == 1
  assert one_line(r.stderr).startswith(f"error: {message}")
  assert not (tmp_path / "w").exists() and not staged.exists()  # nothing locked, nothing staged
  assert "coordinator" not in r.stderr and "jax.distributed" not in r.stderr


# ----------------------------------------------------------------------------- case 6: shards
@pytest.fixture
def damaged(data, tmp_path):
  d = tmp_path / "damaged"
  shutil.copytree(data, d)
  from lmscale_jax.store import dataset

  return d, dataset.DatasetMeta.load(str(d)).shard_paths("train")[0]


def test_truncated_shard_at_start_up_names_the_shard(damaged, tmp_path):
  from lmscale_jax.store.dataset import DatasetError
  from lmscale_jax.pretrain import trainer as train

  d, shard = damaged
  os.truncate(shard, os.path.getsize(shard) // 3)
  with pytest.raises(DatasetError, match=f"^{shard}: cannot open ArrayRecord shard"):
    train.train_and_evaluate(small_train_config(d, steps=1), str(tmp_path / "w"))
  r = main([f"--config={ROOT}/configs/tiny.py", f"--workdir={tmp_path / 'w2'}",
            f"--config.data.path={d}", "--config.train.steps=1"])
  assert r.returncode == 1 and one_line(r.stderr).startswith(f"error: {shard}: ")


def test_renamed_shard_at_start_up_names_the_shard(damaged, tmp_path):
  from lmscale_jax.store import dataset, records

  d, shard = damaged
  os.rename(shard, shard + ".moved")
  meta = dataset.DatasetMeta.load(str(d))
  with pytest.raises(dataset.DatasetError, match=f"^{shard}: cannot open ArrayRecord shard"):
    records.unigram_entropy(meta)


def test_skip_mode_skips_a_truncated_shard_at_start_up(damaged, tmp_path):
  from lmscale_jax.store import dataset, records
  from lmscale_jax.pretrain import trainer as train

  d, shard = damaged
  meta = dataset.DatasetMeta.load(str(d))
  whole = records.unigram_entropy(meta)
  os.truncate(shard, os.path.getsize(shard) // 3)
  skipped = records.unigram_entropy(meta, on_corrupt="skip")
  assert math.isfinite(skipped) and skipped != whole  # the other shard's records only
  c = small_train_config(d, steps=2)
  c.data.on_corrupt = "skip"
  out = train.train_and_evaluate(c, str(tmp_path / "w"))
  assert out["step"] == 2 and out["unigram_baseline"] == pytest.approx(skipped)


# ----------------------------------------------------------------------------- case 8: the CLI
def _cli_cases(tmp):
  tiny, data_flag = f"--config={ROOT}/configs/tiny.py", f"--config.data.path={tmp / 'nope'}"
  afile = tmp / "afile"
  afile.write_text("x")
  return [
      ([], "error: --config and --workdir are required. usage: python -m lmscale_jax.main"),
      ([tiny, f"--work_dir={tmp}"], "error: unknown flag --work_dir (did you mean --workdir?)"),
      ([tiny, f"--workdir={tmp}", "--config.train.steps=abc"],
       "error: --config.train.steps=abc: expected an integer (no decimal point or exponent)"),
      ([tiny, f"--workdir={tmp}", "--config.train.steps=1.5"],
       "error: --config.train.steps=1.5: expected an integer (no decimal point or exponent)"),
      ([tiny, f"--workdir={tmp}", "--config.train.batch_size=32.0"],
       "error: --config.train.batch_size=32.0: expected an integer"),
      ([f"--config={ROOT}/configs/nope.py", f"--workdir={tmp}"],
       f"error: --config={ROOT}/configs/nope.py: no such file, and no shipped config of that "
       "name (shipped: bert120m, bert350m, tiny, undertale_medium;"),
      ([tiny, f"--workdir={tmp}", "--config.checkpoint.async=False"],
       "error: --config.checkpoint.async was renamed --config.checkpoint.async_save"),
      ([tiny, f"--workdir={afile}", data_flag],
       f"error: --workdir {afile} is a file; expected a directory"),
      ([tiny, f"--workdir={afile}/sub", data_flag],
       f"error: --workdir {afile}/sub is below {afile}, which is a file, not a directory"),
      ([tiny, f"--workdir={tmp / 'w'}", f"--config.data.path={afile}"],
       f"error: data.path '{afile}' is a file; expected a dataset directory"),
  ]


@pytest.mark.parametrize("case", range(10), ids=[
    "no_args", "misspelt_flag", "steps_abc", "steps_1.5", "batch_32.0", "missing_config",
    "old_async_key", "workdir_is_a_file", "workdir_below_a_file", "data_path_is_a_file"])
def test_command_line_mistakes_are_one_line(tmp_path, case):
  cmd, expected = _cli_cases(tmp_path)[case]
  r = main(cmd)
  assert r.returncode == 1, (cmd, r.stderr[-2000:])
  assert one_line(r.stderr).startswith(expected), (cmd, r.stderr[-2000:])


def test_async_save_can_be_set(data, tmp_path):
  r = main([f"--config={ROOT}/configs/tiny.py", f"--workdir={tmp_path}",
            f"--config.data.path={data}", "--config.checkpoint.async_save=False", "--dry_run"])
  assert r.returncode == 0, r.stderr[-2000:]
  assert "async_save: false" in r.stdout


def test_old_async_key_in_a_config_file_is_one_line(data):
  from lmscale_jax.config import checks as config_checks
  from lmscale_jax.errors import ConfigError

  c = small_train_config(data)
  c.checkpoint["async"] = False
  with pytest.raises(ConfigError, match="checkpoint.async was renamed checkpoint.async_save"):
    config_checks.check_config(c)


def test_help_is_the_usage_and_exits_0():
  r = main(["--help"])
  assert r.returncode == 0 and r.stderr == ""
  assert r.stdout.startswith("usage: python -m lmscale_jax.main --config CONFIG --workdir DIR")
  assert "--allow-config-change" in r.stdout and "docs/training.md" in r.stdout
  assert "--workdir" in r.stdout and "Traceback" not in r.stdout


@pytest.mark.parametrize("workers", [0, 1])
def test_ctrl_c_is_one_line_exit_130_and_the_resume_is_bitwise(data, cache, reference,
                                                               tmp_path, workers):
  """Also with loader worker processes, which get the terminal's SIGINT too: still one line
  (they ignore it and are stopped by the training process)."""
  workdir = tmp_path / "w"
  p = start(args(data, workdir, **{"data.workers": workers}), cache)
  wait_for(p, lambda: len(series(workdir)) >= 6)
  os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
  err = finish(p)
  assert p.returncode == 130, err[-3000:]
  assert one_line(err).startswith("error: interrupted (Ctrl-C); the last complete checkpoint")
  run(args(data, workdir), cache)
  assert_same_run(workdir, reference)


def test_full_disk_is_one_line(data, tmp_path):
  """ENOSPC from a real write (the workdir's lock file is /dev/full, which refuses every write
  with ENOSPC): one line naming the file, exit 1."""
  workdir = tmp_path / "w"
  workdir.mkdir()
  os.symlink("/dev/full", workdir / ".lock")
  r = main([f"--config={ROOT}/configs/tiny.py", f"--workdir={workdir}",
            f"--config.data.path={data}"])
  assert r.returncode == 1
  assert one_line(r.stderr).startswith(
      f"error: No space left on device writing {workdir}/.lock (workdir {workdir}): free space")


# ----------------------------------------------------------------------------- case 11
def test_eval_batches_beyond_the_split_warn_once(data, tmp_path, caplog):
  from lmscale_jax.pretrain import trainer as train

  with caplog.at_level(logging.WARNING):
    train.train_and_evaluate(small_train_config(data, steps=1, eval_batches=10),
                             str(tmp_path / "w"))
  warnings = [r.getMessage() for r in caplog.records if "train.eval_batches" in r.getMessage()]
  assert warnings == [
      f"train.eval_batches=10 batches of 8 rows but the validation split (32 records in "
      f"{data}) fills 4: each evaluation reads each record about 2.5 times. Set "
      "train.eval_batches<=4 for a non-repeating evaluation"]
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    train.train_and_evaluate(small_train_config(data, steps=1, eval_batches=4),
                             str(tmp_path / "w2"))
  assert "train.eval_batches" not in caplog.text


def test_a_step_beyond_the_devices_memory_is_refused_naming_the_batch_that_fits(data, tmp_path):
  """train.batch_size=100000000 logged "≈278,289 GiB per device" and started: the estimate
  (which leaves out XLA's temporaries, so a step above it cannot fit) is compared with the
  device's memory before anything is read; the batch it names passes the same check, and
  train.memory_check=false lets the user start anyway."""
  import re

  from lmscale_jax.errors import ConfigError
  from lmscale_jax.train import preflight
  from lmscale_jax.pretrain import trainer as train

  r = main(args(data, tmp_path / "w", **{"train.batch_size": 100_000_000}))
  line = one_line(r.stderr)
  assert r.returncode == 1 and line.startswith("error: train.batch_size=100000000: a step "
                                               "needs ≈"), line
  assert "GiB per device by the memory estimate, more than the " in line
  assert "train.remat=full" in line and "train.memory_check=false starts anyway" in line
  fits = int(re.search(r"Use train.batch_size=(\d+) or less", line).group(1))
  assert not (tmp_path / "w" / "metrics.jsonl").exists()
  c = small_train_config(data, batch_size=fits)
  c.model.update(layers=1, hidden=64, heads=2, ffn=128)
  setup = train.build_setup(c)
  preflight.check_memory(c, setup.memory_at)  # the batch it names fits
  c.train.batch_size = fits + 8
  with pytest.raises(ConfigError):
    preflight.check_memory(c, train.build_setup(c).memory_at)
  c.train.memory_check = False
  preflight.check_memory(c, train.build_setup(c).memory_at)


def test_an_init_from_directory_whose_config_is_a_fifo_is_one_line(data, tmp_path):
  """The start model's config.json a FIFO: one line before the runtime starts (reading it
  waited forever)."""
  hf = tmp_path / "hf"
  hf.mkdir()
  os.mkfifo(hf / "config.json")
  r = main(args(data, tmp_path / "w", init_from=hf), timeout=60)
  assert r.returncode == 1
  assert one_line(r.stderr) == (f"error: {hf}/config.json is a FIFO: expected the model's "
                                "config.json file")


def test_workdir_past_train_steps_is_one_line(data, resumable):
  from lmscale_jax.train import checkpoint
  from lmscale_jax.pretrain import trainer as train

  state = (resumable / "run_state.json").read_bytes()
  with pytest.raises(checkpoint.IncompatibleCheckpoint) as e:
    train.train_and_evaluate(small_train_config(data, steps=2), str(resumable))
  assert str(e.value) == (
      f"{resumable}/checkpoints/3: the workdir is already at step 3, past train.steps=2: "
      "nothing to train. To continue it, set a larger train.steps (e.g. "
      "--config.train.steps=6); for a new run, give another --workdir")
  assert (resumable / "run_state.json").read_bytes() == state  # still "finished" at 3/3


def test_more_loader_workers_than_cpus_run_as_many_as_the_cpus(data, caplog):
  """data.workers=1000 on this machine's CPUs: as many as the CPUs run, with one warning (each
  a Grain worker process; the batches do not depend on their number). Training caps its copy
  of the config before anything starts (config.json then records what ran)."""
  from lmscale_jax import child_process
  from lmscale_jax.input import grain_pipeline

  cpus = child_process.usable_cpus()
  c = small_train_config(data)
  c.data.workers = 1000
  with caplog.at_level(logging.WARNING):
    grain_pipeline.cap_workers(c)
    grain_pipeline.cap_workers(c)  # capped once: no second warning
  assert c.data.workers == cpus
  assert caplog.text.count(f"data.workers=1000: this process may use {cpus} CPU(s), so {cpus} "
                           "loader workers run") == 1
