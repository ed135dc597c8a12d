"""What ``lmscale train`` and ``lmscale prepare`` tell a user of a small first run (issue 56,
item 9), each through the installed command: a vocabulary smaller than --vocab-size asked is
one warning line saying why; the evaluation warning of a validation split smaller than its
batches gives the right numbers and a fix that exists; a missing --config.data.path names the
option and leaves no workdir behind (nor does a dataset that does not exist); a training run
ends with a summary line; a rerun of a finished run says it is finished."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, make_synthetic_dataset

INSTALLED = os.path.join(os.path.dirname(sys.executable), "lmscale")
LIBS = [os.path.join("/usr/lib/x86_64-linux-gnu", n)
        for n in ("libz.so.1", "libbz2.so.1.0", "liblzma.so.5")]
# A 2-step run of the tiny config, narrowed to the 64-token synthetic dataset.
SMALL = ["--config", "tiny", "--config.train.steps=2", "--config.train.eval_every=2",
         "--config.train.eval_batches=2", "--config.checkpoint.every=2",
         "--config.model.hidden=64", "--config.model.ffn=128", "--config.train.warmup_steps=1"]


def lmscale(*argv, timeout=300) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("JAX_NUM_CPU_DEVICES", None)
  return subprocess.run([INSTALLED, *map(str, argv)], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  """20 validation records: fewer than one batch of the tiny config's 32 rows."""
  d = tmp_path_factory.mktemp("msgdata") / "ds"
  make_synthetic_dataset(str(d), seq_len=64, vocab_size=128, n_train=256, n_val=20)
  return d


@pytest.fixture(scope="module")
def finished(data, tmp_path_factory):
  """A run trained to its end, and the same command run again."""
  workdir = tmp_path_factory.mktemp("msgrun") / "w"
  argv = ["train", *SMALL, "--workdir", workdir, f"--config.data.path={data}"]
  return workdir, lmscale(*argv), lmscale(*argv)


def test_a_vocabulary_smaller_than_asked_is_one_warning_saying_why(tmp_path):
  """Asked for 4096, binary code gives what words it has: one line saying so and why. The
  default (8192, a ceiling) is not a request: the demo's first command printed this warning."""
  found = [p for p in LIBS if os.path.exists(p)]
  assert len(found) == 3, f"expected system libraries {LIBS}"
  common = ["prepare", "binary", "--input", *found, "--val-fraction", 0.1, "--no-progress"]
  r = lmscale(*common, "--output", tmp_path / "d", "--vocab-size", 4096)
  assert r.returncode == 0, r.stderr[-2000:]
  size = __import__("json").load(open(tmp_path / "d" / "metadata.json"))["vocab_size"]
  assert size < 4096
  warnings = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
  assert warnings == [
      f"warning: --vocab-size 4096: the corpus gave only {size} tokens (every instruction word "
      "the corpus has twice or more, and every character, is one already: a larger "
      f"--vocab-size adds nothing); the dataset's vocab_size is {size}"]
  default = lmscale(*common, "--output", tmp_path / "default")
  assert default.returncode == 0, default.stderr[-2000:]
  assert "warning:" not in default.stderr, default.stderr
  assert (tmp_path / "d" / "tokenizer.json").read_bytes() == \
      (tmp_path / "default" / "tokenizer.json").read_bytes()  # the same words, either way


def test_a_finished_run_ends_with_a_summary_line(finished):
  workdir, first, _ = finished
  assert first.returncode == 0, first.stderr[-3000:]
  last = first.stdout.strip().splitlines()[-1]
  assert last.startswith("done: step 2 of 2, loss "), first.stdout[-2000:]
  assert ", eval loss " in last and f"; checkpoint {workdir}/checkpoints/2 " in last, last


def test_the_eval_warning_of_a_split_smaller_than_a_batch_is_right_and_its_fix_exists(finished):
  _, first, _ = finished
  warned = [line for line in first.stderr.splitlines() if "train.eval_batches=" in line]
  assert len(warned) == 1, first.stderr[-3000:]
  # 2 batches of 32 rows over 20 records: each read 3.2 times; no eval_batches avoids it.
  assert "train.eval_batches=2 batches of 32 rows but the validation split (20 records" in \
      warned[0] and "fills 0: each evaluation reads each record about 3.2 times." in warned[0]
  assert "larger --val-fraction" in warned[0] and "eval_batches<=0" not in warned[0]


def test_a_rerun_of_a_finished_run_says_it_is_finished(finished):
  workdir, _, again = finished
  assert again.returncode == 0, again.stderr[-3000:]
  assert again.stdout.strip().splitlines()[-1] == (
      f"{workdir} is finished: step 2 of train.steps=2, nothing to do (checkpoint "
      f"{workdir}/checkpoints/2; a larger --config.train.steps continues it)")
  assert "resumed from" not in again.stderr


def test_a_missing_data_path_names_the_option_and_leaves_nothing(tmp_path):
  r = lmscale("train", "--config", "tiny", "--workdir", tmp_path / "w")
  assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
  assert r.stderr.strip().splitlines()[-1] == (
      "error: config.data.path is not set: give --config.data.path=DATASET, the directory "
      "lmscale prepare wrote (or set data.path in the config file)")
  assert not (tmp_path / "w").exists()


def test_a_dataset_that_does_not_exist_leaves_no_workdir_behind(tmp_path):
  r = lmscale("train", "--config", "tiny", "--workdir", tmp_path / "w",
              f"--config.data.path={tmp_path / 'nope'}")
  assert r.returncode == 1, r.stderr[-3000:]
  assert r.stderr.strip().splitlines()[-1].startswith(
      f"error: dataset directory '{tmp_path / 'nope'}' does not exist")
  assert not (tmp_path / "w").exists()
