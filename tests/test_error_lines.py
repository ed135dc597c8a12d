"""Every refusal is one ``error:`` line on a line of its own that names what it is about, and
names the command the user has (issue 55, items 10 and 13).

An integer key past int32 (``train.steps=2**31`` was an 80-line OverflowError from inside jit);
a ``run_state.json`` whose step is no integer; two ``lmscale export-hf`` into one empty
directory at once (the later one's traceback); the ``error:`` line glued to a progress bar
when stderr is a file; a full disk without the file's name; absl's INFO lines printed before
training's ``error:`` line; messages naming ``tools/prepare_*.py`` or ``python -m
lmscale_jax.main`` to a user of the installed command. Real ``lmscale`` processes on real
datasets, runs and a real small file system (a tmpfs in a private mount namespace).
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from lmscale_jax.cli import export_hf
from lmscale_jax.config import checks as config_checks
from lmscale_jax.config import finetune as finetune_config
from lmscale_jax.errors import ConfigError, UserError
from tests.helpers import ROOT, make_config, make_synthetic_dataset
from tests.test_faults import args, env

LMSCALE = [sys.executable, "-m", "lmscale_jax.cli.lmscale"]  # what the installed command runs
INT32_MAX = 2**31 - 1


def lmscale(*argv, cache, timeout=300) -> subprocess.CompletedProcess:
  return subprocess.run([*LMSCALE, *map(str, argv)], cwd=ROOT, env=env(cache),
                        capture_output=True, text=True, timeout=timeout,
                        stdin=subprocess.DEVNULL)


def one_line(r: subprocess.CompletedProcess, code: int = 1) -> str:
  """The single line of a refused run's stderr (and nothing else there)."""
  assert r.returncode == code, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])
  err = r.stderr.strip()
  assert "\n" not in err and err.startswith("error: "), err[-4000:]
  return err


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  return tmp_path_factory.mktemp("xla")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  d = tmp_path_factory.mktemp("data") / "ds"
  make_synthetic_dataset(str(d), seq_len=64, vocab_size=128, n_train=256, n_val=32)
  return d


@pytest.fixture(scope="module")
def trained(data, cache, tmp_path_factory):
  """A 4-step run through ``lmscale train`` (checkpoint at 4), and what it printed."""
  workdir = tmp_path_factory.mktemp("run") / "w"
  r = lmscale("train", *args(data, workdir, **{"train.steps": 4}), cache=cache)
  assert r.returncode == 0, r.stderr[-4000:]
  return workdir, r.stderr


# ----------------------------------------------------------------------------- int32 keys
@pytest.mark.parametrize("key,value", [
    ("train.steps", 2**31), ("train.seed", 2**32), ("checkpoint.every", 2**31),
    ("train.batch_size", 2**40), ("data.seed", 2**63)])
def test_an_integer_key_past_int32_is_one_line_naming_the_key_and_the_range(data, cache,
                                                                            tmp_path, key, value):
  r = lmscale("train", *args(data, tmp_path / "w", **{key: value}), cache=cache)
  err = one_line(r)
  assert f"{key}={value}: expected an integer in [" in err and f", {INT32_MAX}]" in err, err
  assert not (tmp_path / "w").exists()  # refused before anything was created


def test_the_int32_bound_holds_for_fine_tuning_and_fault_injection_too():
  c = finetune_config.get_config()
  c.train.steps = 2**31
  with pytest.raises(ConfigError, match=rf"train.steps=2147483648: expected an integer in "
                                        rf"\[1, {INT32_MAX}\]"):
    finetune_config.check_config(c)
  c = make_config("", train=dict(inject_nonfinite_steps=f"3,{2**31}"))
  with pytest.raises(ConfigError, match=f"step numbers end at {INT32_MAX}"):
    config_checks.check_config(c)
  config_checks.check_config(make_config("", train=dict(steps=INT32_MAX)))  # the largest: fine


# ----------------------------------------------------------------------------- run-state
@pytest.mark.parametrize("step", ['"x"', "1.5", "true", "null"])
@pytest.mark.parametrize("command", [["step"], ["requeue", "--since-step", "-1"]])
def test_a_run_state_step_that_is_no_integer_is_one_line_naming_the_file(cache, tmp_path, step,
                                                                         command):
  (tmp_path / "run_state.json").write_text(f'{{"state": "preempted", "step": {step}}}\n')
  r = lmscale("run-state", command[0], tmp_path, *command[1:], cache=cache)
  err = one_line(r)
  assert f"{tmp_path / 'run_state.json'}: \"step\" is {step}: expected an integer" in err, err


def test_run_state_step_still_prints_the_step_or_minus_one(cache, tmp_path):
  assert lmscale("run-state", "step", tmp_path, cache=cache).stdout.strip() == "-1"
  (tmp_path / "run_state.json").write_text('{"state": "preempted", "step": 7}\n')
  assert lmscale("run-state", "step", tmp_path, cache=cache).stdout.strip() == "7"


# ----------------------------------------------------------------------------- export-hf
def _wait_for_holder(path, proc, timeout=180) -> dict:
  deadline = time.time() + timeout
  while time.time() < deadline:
    try:
      record = json.loads(open(path).read())
      if record.get("pid") == proc.pid:
        return record
    except (OSError, ValueError):
      pass
    assert proc.poll() is None, f"the first export ended ({proc.returncode}) without a lock"
    time.sleep(0.02)
  raise AssertionError(f"{path}: never held by the first export (pid {proc.pid})")


def test_a_second_export_into_the_same_directory_is_one_line_naming_the_first(
    trained, cache, tmp_path):
  out = tmp_path / "hf"
  out.mkdir()  # an existing empty directory: both may write it
  cmd = [*LMSCALE, "export-hf", "--workdir", str(trained[0]), "--output", str(out)]
  first = subprocess.Popen(cmd, cwd=ROOT, env=env(cache), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
  try:
    _wait_for_holder(tmp_path / ".hf.export-hf.lock", first)
    os.kill(first.pid, signal.SIGSTOP)  # holds its lock, and its work, until we say
    second = lmscale("export-hf", "--workdir", trained[0], "--output", out, cache=cache)
    err = one_line(second)
    assert f"another lmscale export-hf is writing it (pid {first.pid} on host" in err, err
    assert "nothing was written" in err and os.listdir(out) == []
    os.kill(first.pid, signal.SIGCONT)
    _, first_err = first.communicate(timeout=300)
  finally:
    if first.poll() is None:
      os.killpg(first.pid, signal.SIGCONT)
      os.killpg(first.pid, signal.SIGKILL)
      first.wait()
  assert first.returncode == 0, first_err[-4000:]
  assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
  assert sorted(os.listdir(tmp_path)) == ["hf"]  # no lock file, no temp directory left


def test_an_output_filled_before_the_rename_is_kept_and_the_export_is_told(tmp_path):
  """The last step of an export (``publish``): something that wrote OUT meanwhile wins, and
  the export's complete directory is not put in its place."""
  tmp, out = tmp_path / ".hf.x.tmp", tmp_path / "hf"
  tmp.mkdir()
  (tmp / "config.json").write_text("{}")
  out.mkdir()
  export_hf.publish(str(tmp), str(out), str(out))  # empty: taken in one rename
  assert os.listdir(out) == ["config.json"] and not tmp.exists()
  tmp.mkdir()
  with pytest.raises(UserError, match="something else wrote it while this export ran"):
    export_hf.publish(str(tmp), str(out), str(out))
  assert os.listdir(out) == ["config.json"] and tmp.exists()


# ----------------------------------------------------------------------------- full disk
def _namespace() -> list[str]:
  if os.geteuid() == 0:
    return ["unshare", "--mount"]
  return ["unshare", "--user", "--map-root-user", "--mount"]


def test_a_full_disk_names_the_file_being_written(trained, cache, tmp_path):
  """The export's weights (~200 KB) into a 64 KiB tmpfs: the line names the file (it said
  "no space left on the device (output)"), and nothing is left in the output's place."""
  mnt = tmp_path / "small"
  mnt.mkdir()
  probe = subprocess.run([*_namespace(), "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {mnt}"],
                         capture_output=True, text=True)
  if probe.returncode:
    pytest.skip(f"cannot mount a small tmpfs here: {probe.stderr.strip()}")
  export = " ".join([*LMSCALE, "export-hf", "--workdir", str(trained[0]), "--output",
                     f"{mnt}/hf"])
  script = (f"mount -t tmpfs -o size=64k tmpfs {mnt} || exit 99; {export}; rc=$?; "
            f"ls -A {mnt} >&2; exit $rc")
  r = subprocess.run([*_namespace(), "bash", "-c", script], cwd=ROOT, env=env(cache),
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 1, r.stderr[-4000:]
  line, *left = r.stderr.strip().splitlines()
  assert line.startswith(f"error: no space left on device writing {mnt}/"), line
  assert "model.safetensors" in line and f"nothing was written to {mnt}/hf" in line, line
  assert left == [], left  # the tmpfs is empty again: no temp directory, no lock file


# ----------------------------------------------------------------------------- progress bars
def test_an_error_mid_pass_starts_its_own_line_after_the_progress_bar(cache, tmp_path):
  """stderr a file (a log, a pipe): the bar's line ends without a newline until the bar
  closes, and the error line was glued to it, then the bar redrew itself after it."""
  src = tmp_path / "long.txt"
  with open(src, "wb") as f:
    f.write(b"short first line\n")
    block = b"word " * (1 << 18)
    for _ in range(14):  # 17.5 MiB without a newline: past the 16 MiB bound of a line
      f.write(block)
  r = lmscale("prepare", "text", "--input", src, "--output", tmp_path / "out", "--vocab-size",
              300, "--workers", 1, cache=cache)
  assert r.returncode == 1, r.stderr[-3000:]
  lines = r.stderr.split("\n")
  errors = [i for i, line in enumerate(lines) if "error:" in line]
  assert len(errors) == 1 and lines[errors[0]].startswith(f"error: {src}:2: line longer"), \
      r.stderr[-3000:]
  assert "extract:" in r.stderr  # there was a bar: what this is about
  assert lines[errors[0] + 1:] == [""], lines[errors[0] + 1:]  # nothing drawn after it


# ----------------------------------------------------------------------------- absl's INFO
def test_an_accepted_run_still_logs_its_start(trained):
  _, err = trained
  for line in ("topology: 1 process", "] workdir ", "] model: ", "step 4/4"):
    assert line in err, err[-4000:]


def test_a_run_refused_after_start_up_prints_only_its_error_line(data, cache, tmp_path):
  r = lmscale("train", *args(tmp_path / "nowhere", tmp_path / "w"), cache=cache)
  assert "does not exist" in one_line(r)  # the dataset check: after the runtime started
  r = lmscale("train", *args(data, tmp_path / "w", **{"train.grad_accum_steps": 3}),
              cache=cache)
  assert "not divisible by train.grad_accum_steps=3" in one_line(r)  # preflight


def test_a_resume_refused_over_a_changed_config_prints_only_its_error_line(trained, cache,
                                                                           tmp_path):
  workdir = tmp_path / "w"
  shutil.copytree(trained[0], workdir)
  changed = {"train.learning_rate": 1e-3, "train.steps": 6}
  r = lmscale("train", *args(_data_of(workdir), workdir, **changed), cache=cache)
  assert "train.learning_rate" in one_line(r)  # refused by the loop, after the model was built


def _data_of(workdir) -> str:
  return json.load(open(workdir / "config.json"))["config"]["data"]["path"]


# ----------------------------------------------------------------------------- commands named
def _messages(path: str) -> list[tuple[int, str]]:
  """The string constants of a module that are no docstring: what it may print."""
  tree = ast.parse(open(path).read())
  docs = {id(n.body[0].value) for n in ast.walk(tree)
          if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
          and n.body and isinstance(n.body[0], ast.Expr)
          and isinstance(n.body[0].value, ast.Constant)}
  return [(n.lineno, n.value) for n in ast.walk(tree)
          if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_no_message_names_a_script_the_lmscale_command_replaced():
  """A user of the installed command types ``lmscale prepare binary`` and ``lmscale train``:
  no message names tools/prepare_*.py, or python -m lmscale_jax.main but where that is how
  the run was started (main._prog)."""
  found = []
  for top, _, files in os.walk(os.path.join(ROOT, "lmscale_jax")):
    for name in files:
      path = os.path.join(top, name)
      for line, text in _messages(path) if name.endswith(".py") else []:
        if "tools/prepare_" in text or ("python -m lmscale_jax.main" in text
                                        and not path.endswith(os.path.join("lmscale_jax",
                                                                           "main.py"))):
          found.append(f"{os.path.relpath(path, ROOT)}:{line}: {text!r}")
  assert found == []


def test_train_help_and_usage_name_lmscale_train(cache, tmp_path):
  r = lmscale("train", "--help", cache=cache)
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.startswith("usage: lmscale train --config "), r.stdout[:2000]
  assert "python -m lmscale_jax.main" not in r.stdout
  assert "usage: lmscale train --config=" in one_line(lmscale("train", cache=cache))
  err = one_line(lmscale("export-hf", "--workdir", tmp_path, "--output", tmp_path / "hf",
                         cache=cache))
  assert "a run of lmscale train wrote" in err, err
