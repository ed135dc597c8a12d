"""Checkpoint integrity: a corrupt checkpoint is detected and never trained on, full disks stop
cleanly, and skipped non-finite steps do not make the learning rate lag.

Real Orbax checkpoints written by real ``python -m lmscale_jax.main`` runs (1 and 2 processes),
bytes flipped on disk, a real small file system (a tmpfs in a private mount namespace). Every
subprocess has a timeout and is killed (whole group) on failure.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests import test_distributed as dist
from tests.helpers import lmscale, make_synthetic_dataset, small_train_config
from tests.test_faults import args, env, finish, series, start

STEPS = 6
RUN = {"train.steps": STEPS, "checkpoint.every": 2, "checkpoint.keep": 3, "train.eval_every": 3}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  d = tmp_path_factory.mktemp("idata") / "ds"
  make_synthetic_dataset(str(d), seq_len=64, vocab_size=128, n_train=256, n_val=32)
  return d


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  return tmp_path_factory.mktemp("xla_cache")


def main_run(data, workdir, cache, **over) -> tuple[int, str]:
  p = start(args(data, workdir, **{**RUN, **over}), cache)
  err = finish(p, timeout=300)
  return p.returncode, err


@pytest.fixture(scope="module")
def reference(data, cache, tmp_path_factory):
  """An uninterrupted run, checkpoints 2, 4, 6: every other run here must reproduce it."""
  workdir = tmp_path_factory.mktemp("iref") / "w"
  rc, err = main_run(data, workdir, cache)
  assert rc == 0, err[-4000:]
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4", "6"]
  return workdir


def copy_of(reference, tmp_path):
  workdir = tmp_path / "w"
  shutil.copytree(reference, workdir)
  return workdir


def flip(path, offset=200, n=8) -> None:
  with open(path, "r+b") as f:
    f.seek(min(offset, os.path.getsize(path) - n))
    old = f.read(n)
    f.seek(-n, 1)
    f.write(bytes(b ^ 0xFF for b in old))


def largest(step_dir, process=0) -> str:
  return max(glob.glob(f"{step_dir}/state/ocdbt.process_{process}/d/*"), key=os.path.getsize)


def assert_same_losses(workdir, ref) -> None:
  for key in ("loss", "mlm_accuracy", "eval_loss"):
    assert series(workdir, key) == series(ref, key), key  # bitwise


# ----------------------------------------------------------------------------- corruption
def test_corrupt_latest_checkpoint_falls_back_to_previous(data, cache, reference, tmp_path):
  """8 bytes flipped in the latest checkpoint's largest array file (the issue's recipe): the
  rerun warns naming that file, resumes from the previous checkpoint, moves the bad one to
  6.corrupt, and ends with the uninterrupted run's losses bit for bit."""
  from lmscale_jax.train import checkpoint_manifest

  workdir = copy_of(reference, tmp_path)
  bad = largest(workdir / "checkpoints" / "6")
  flip(bad)
  rc, err = main_run(data, workdir, cache)
  assert rc == 0, err[-4000:]
  assert f"checkpoint {workdir}/checkpoints/6 does not verify" in err
  assert f"{bad}: checksum mismatch" in err
  assert f"resumed from {workdir}/checkpoints/4" in err
  assert_same_losses(workdir, reference)
  names = sorted(os.listdir(workdir / "checkpoints"))
  assert names == ["2", "4", "6", "6.corrupt"], names  # the new 6; the bad one kept aside
  assert checkpoint_manifest.verify(str(workdir / "checkpoints" / "6")) == []
  assert checkpoint_manifest.verify(str(workdir / "checkpoints" / "6.corrupt"))


def test_missing_manifest_is_not_loaded(reference, tmp_path):
  """A checkpoint saved with manifests that has lost one is not resumed from (the choice every
  run makes before loading), and inspect_checkpoint --verify names the missing file."""
  from lmscale_jax.train import checkpoint

  workdir = copy_of(reference, tmp_path)
  manifest = workdir / "checkpoints" / "6" / "manifest.process_0-of-1.json"
  manifest.unlink()
  choice = checkpoint.choose_resume_step(str(workdir))
  assert choice.step == 4
  assert [s for s, _ in choice.failed] == [6]
  assert f"{manifest}: manifest missing" in choice.failed[0][1][0]
  tool = subprocess.run([*lmscale("inspect_checkpoint"), str(workdir), "--verify"],
                        cwd=dist.ROOT, capture_output=True, text=True,
                        timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert tool.returncode == 1
  assert f"{manifest}: manifest missing" in tool.stderr
  assert "verify step 4: ok" in tool.stdout and "verify step 6: 1 problem(s)" in tool.stdout


@pytest.mark.parametrize("edit", ["empty", "one_left_out"])
def test_a_manifest_that_does_not_list_every_file_does_not_verify(reference, tmp_path, edit):
  """A manifest is a list of everything its process wrote: one emptied (or missing a file)
  with the data then damaged is not resumed from (it verified, and the restore died in zstd),
  and inspect_checkpoint --verify names it."""
  import json

  from lmscale_jax.train import checkpoint

  workdir = copy_of(reference, tmp_path)
  step_dir = workdir / "checkpoints" / "6"
  manifest = step_dir / "manifest.process_0-of-1.json"
  bad = largest(step_dir)
  rel = os.path.relpath(bad, step_dir)
  doc = json.loads(manifest.read_text())
  doc["files"] = {} if edit == "empty" else {k: v for k, v in doc["files"].items() if k != rel}
  manifest.write_text(json.dumps(doc))
  flip(bad)
  choice = checkpoint.choose_resume_step(str(workdir))
  assert choice.step == 4 and [s for s, _ in choice.failed] == [6]
  why = (f"{manifest}: lists no files" if edit == "empty" else
         f"{bad}: not in manifest.process_0-of-1.json")
  assert why in choice.failed[0][1][0], choice.failed
  tool = subprocess.run([*lmscale("inspect_checkpoint"), str(workdir), "--verify"],
                        cwd=dist.ROOT, capture_output=True, text=True,
                        timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert tool.returncode == 1 and why in tool.stderr, tool.stderr


def test_no_checkpoint_verifies_is_one_error(data, cache, reference, tmp_path):
  """Every checkpoint damaged: one error line naming each checkpoint and its bad file, rc 1,
  nothing trained (metrics.jsonl and the checkpoints untouched)."""
  workdir = copy_of(reference, tmp_path)
  bad = {step: largest(workdir / "checkpoints" / str(step)) for step in (2, 4, 6)}
  for path in bad.values():
    flip(path)
  before = (workdir / "metrics.jsonl").read_bytes()
  rc, err = main_run(data, workdir, cache)
  assert rc == 1
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  assert len(errors) == 1, err[-3000:]
  assert f"no checkpoint in {workdir}/checkpoints verifies, nothing was trained" in errors[0]
  for step, path in bad.items():
    assert f"{workdir}/checkpoints/{step}: {path}: checksum mismatch" in errors[0]
  assert (workdir / "metrics.jsonl").read_bytes() == before
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4", "6"]


def test_two_processes_fall_back_together_when_only_process_1_is_corrupt(data, cache, tmp_path):
  """Two processes; only process 1's array file of the latest checkpoint is damaged, so only
  process 1's own verification fails: both processes resume from the same older step, and
  the result equals the undamaged run bit for bit."""
  workdir = tmp_path / "w"
  opts = {"train.steps": 4, "checkpoint.every": 2, "train.eval_every": 4}
  cached = {k: v for k, v in env(cache).items() if k.startswith("JAX_PERSISTENT_CACHE")
            or k == "JAX_COMPILATION_CACHE_DIR"}  # the rerun skips compilation
  result = dist.local_sh(2, dist.train_args(data, workdir, **opts), timeout=300, **cached)
  assert result.returncode == 0, result.stderr[-5000:]
  straight = {k: series(workdir, k) for k in ("loss", "eval_loss")}
  bad = largest(workdir / "checkpoints" / "4", process=1)
  flip(bad)
  result = dist.local_sh(2, dist.train_args(data, workdir, **opts), timeout=300, **cached)
  assert result.returncode == 0, result.stderr[-5000:]
  assert f"{bad}: checksum mismatch" in result.stderr
  for p in (0, 1):
    assert any(line.startswith(f"[{p}] ") and f"resumed from {workdir}/checkpoints/2" in line
               for line in result.stderr.splitlines()), result.stderr[-3000:]
  assert {k: series(workdir, k) for k in ("loss", "eval_loss")} == straight
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4", "4.corrupt"]


# ----------------------------------------------------------------------------- full disk
def _namespace() -> list[str]:
  """unshare: a private mount namespace (as root), else one inside a user namespace."""
  if os.geteuid() == 0:
    return ["unshare", "--mount"]
  return ["unshare", "--user", "--map-root-user", "--mount"]


def _in_namespace(script: str, cache, timeout: float) -> tuple[int, str]:
  """``bash -c script`` in a private mount namespace (its tmpfs mounts vanish with it):
  (exit status, stderr); killed with its group past ``timeout``."""
  p = subprocess.Popen([*_namespace(), "bash", "-c", script], cwd=dist.ROOT, env=env(cache),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       start_new_session=True)
  err = finish(p, timeout=timeout)
  return p.returncode, err


def _small_fs_available(tmp_path) -> str | None:
  probe = tmp_path / "probe"
  probe.mkdir()
  try:
    r = subprocess.run([*_namespace(), "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {probe}"],
                       capture_output=True, text=True, timeout=30)
  except OSError as e:
    return str(e)
  return None if r.returncode == 0 else r.stderr.strip()


def test_full_disk_stops_cleanly_and_resumes_bitwise(data, cache, reference, tmp_path):
  """workdir/checkpoints on a tmpfs with room for two checkpoints but not three: the third
  save stops the run before Orbax writes anything, with one line (directory, bytes needed,
  bytes free) and checkpoint 4 complete; checkpoint.on_full=skip warns and finishes; a rerun
  with room resumes from 4 and reproduces the uninterrupted run bit for bit."""
  from lmscale_jax.train import checkpoint, checkpoint_manifest

  why = _small_fs_available(tmp_path)
  if why:
    pytest.skip(f"cannot mount a small tmpfs here: {why}")
  size = checkpoint.dir_bytes(str(reference / "checkpoints" / "6"))
  needed = int(size * checkpoint._SPACE_MARGIN) + checkpoint._SPACE_SLACK_BYTES
  fs_bytes = int(1.5 * size) + needed  # fits 2 checkpoints plus the check's margin, not 3
  workdir, kept, skipped = tmp_path / "w", tmp_path / "kept", tmp_path / "skipped"
  (workdir / "checkpoints").mkdir(parents=True)
  first = " ".join(f"'{a}'" for a in args(data, workdir, **RUN))
  script = (f"mount -t tmpfs -o size={fs_bytes} tmpfs {workdir}/checkpoints || exit 99; "
            f"{sys.executable} -m lmscale_jax.main {first}; rc=$?; "
            f"cp -a {workdir}/checkpoints {kept}; cp {workdir}/metrics.jsonl {kept}/; "
            f"{sys.executable} -m lmscale_jax.main {first} --config.checkpoint.on_full=skip "
            f"|| exit 98; cp -a {workdir}/checkpoints {skipped}; exit $rc")
  rc, err = _in_namespace(script, cache, timeout=400)
  assert rc == 1, err[-5000:]
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  assert len(errors) == 1, err[-5000:]
  assert f"no room for checkpoint 6: {workdir}/checkpoints has " in errors[0]
  assert re.search(r"has [\d,]+ bytes free, the checkpoint needs about [\d,]+ \(the size of "
                   r"the latest checkpoint", errors[0]), errors[0]
  assert f"checkpoint {workdir}/checkpoints/4 is kept" in errors[0]
  assert "Traceback" not in err
  assert sorted(n for n in os.listdir(kept) if n != "metrics.jsonl") == ["2", "4"]  # no tmp
  assert checkpoint_manifest.verify(str(kept / "4")) == []
  # on_full=skip: resumed from 4, warned at 6, finished without saving it
  assert "not saved (checkpoint.on_full=skip), training goes on" in err
  assert sorted(os.listdir(skipped)) == ["2", "4"]
  # with room: the kept checkpoints, and a leftover interrupted save the next start removes
  shutil.rmtree(workdir / "checkpoints")
  shutil.copytree(kept, workdir / "checkpoints")
  shutil.move(workdir / "checkpoints" / "metrics.jsonl", workdir / "metrics.jsonl")
  (workdir / "checkpoints" / "6.orbax-checkpoint-tmp" / "state").mkdir(parents=True)
  rc, err = main_run(data, workdir, cache)
  assert rc == 0, err[-4000:]
  assert f"resumed from {workdir}/checkpoints/4" in err
  assert_same_losses(workdir, reference)
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4", "6"]


def _inodes(step_dir) -> int:
  """Files and directories of a checkpoint, the step directory included."""
  return 1 + sum(len(dirs) + len(files) for _, dirs, files in os.walk(step_dir))


@pytest.mark.parametrize("async_save", [True, False])
def test_disk_full_mid_save_is_one_line_and_a_rerun_resumes_bitwise(data, cache, reference,
                                                                    tmp_path, async_save):
  """The disk fills *during* a save, after the free-space check passed (another writer, a
  quota, inodes: here a tmpfs with inodes for one checkpoint and all but one of a second;
  a save needs more than its final count while it writes, lock and temporary files): tensorstore's
  RESOURCE_EXHAUSTED inside Orbax is the one disk-full line naming the file and the last
  complete checkpoint, exit 1, no traceback; with room again the rerun resumes from it and
  reproduces the uninterrupted run bit for bit."""
  why = _small_fs_available(tmp_path)
  if why:
    pytest.skip(f"cannot mount a small tmpfs here: {why}")
  per_checkpoint = _inodes(reference / "checkpoints" / "2")
  workdir, kept = tmp_path / "w", tmp_path / "kept"
  (workdir / "checkpoints").mkdir(parents=True)
  run = " ".join(f"'{a}'" for a in args(data, workdir, **RUN,
                                         **{"checkpoint.async_save": async_save}))
  script = (f"mount -t tmpfs -o size=64m,nr_inodes={2 * per_checkpoint} tmpfs "
            f"{workdir}/checkpoints || exit 99; "
            f"{sys.executable} -m lmscale_jax.main {run}; rc=$?; "
            f"cp -a {workdir}/checkpoints {kept}; "
            f"mount -o remount,nr_inodes=100000 {workdir}/checkpoints || exit 98; "
            f"{sys.executable} -m lmscale_jax.main {run} || exit 97; exit $rc")
  rc, err = _in_namespace(script, cache, timeout=400)
  assert rc == 1, err[-5000:]
  # The save that fails is 4 or 6: a checkpoint's file count varies a little from run to run
  # (OCDBT's data files), so the second may just fit. The line names the file where the error
  # carries one (a write through os.write, without a path, does not: seen once in CI).
  said = re.search(r"^error: No space left on device( writing (\S+))? \(workdir .*", err, re.M)
  assert said, err[-5000:]
  named = re.search(rf"the last complete checkpoint, {workdir}/checkpoints/(\d+), is kept",
                    said.group(0))
  assert named and named.group(1) in ("2", "4"), said.group(0)
  last = int(named.group(1))
  assert said.group(2) is None or said.group(2).startswith(
      f"{workdir}/checkpoints/{last + 2}"), said.group(0)
  resumed = f"resumed from {workdir}/checkpoints/{last}"
  assert resumed in err, err[-5000:]
  first_run = err[:err.index(resumed)]
  errors = [line for line in first_run.splitlines() if line.startswith("error:")]
  assert len(errors) == 1, first_run[-5000:]
  assert "Traceback" not in first_run and "Event loop is closed" not in first_run, first_run
  assert str(last) in os.listdir(kept) and str(last + 2) not in os.listdir(kept)
  assert_same_losses(workdir, reference)


def test_full_workdir_before_the_first_checkpoint_is_one_line(data, cache, tmp_path):
  """The whole workdir on a tmpfs that another file has filled but for a few KiB: the run
  stops with one line (a write that failed, or the free-space check of the first save), and
  nothing after it (TensorBoard's buffered events were flushed at exit into the full disk: a
  traceback followed the line, seen with 12 and 16 KiB left)."""
  why = _small_fs_available(tmp_path)
  if why:
    pytest.skip(f"cannot mount a small tmpfs here: {why}")
  workdir = tmp_path / "w"
  workdir.mkdir()
  run = " ".join(f"'{a}'" for a in args(data, workdir, **RUN))
  script = (f"mount -t tmpfs -o size=1m tmpfs {workdir} || exit 99; for kib in 12 16 20; do "
            f"rm -rf {workdir}/*; dd if=/dev/zero of={workdir}/filler bs=1k "
            f"count=$((1024 - kib)) 2>/dev/null; "
            f"{sys.executable} -m lmscale_jax.main {run}; echo \"rc=$?\" >&2; done")
  _, err = _in_namespace(script, cache, timeout=300)
  runs = err.split("rc=")[:-1]
  assert len(runs) == 3 and err.count("rc=1") == 3, err[-5000:]
  for one in runs:
    assert one.rstrip().splitlines()[-1].startswith("error: "), one[-3000:]
    assert "Traceback" not in one, one[-5000:]


# ----------------------------------------------------------------------------- non-finite
def test_skipped_steps_do_not_make_the_learning_rate_lag(data):
  """train.nonfinite=skip with steps 2 and 3 poisoned: the optimizer's schedule count equals
  the step counter after every step, and the rate actually applied at the last step (from
  the parameter change and Adam's moments) is the logged one."""
  import jax
  import optax

  from lmscale_jax.input import grain_pipeline as data_lib
  from lmscale_jax.store import dataset
  from lmscale_jax.pretrain import mlm
  from lmscale_jax.pretrain import trainer as train

  config = small_train_config(data, steps=6, nonfinite="skip", inject_nonfinite_steps="2,3",
                              weight_decay=0.0, warmup_steps=2)
  meta = dataset.DatasetMeta.load(str(data))
  setup = train.build_setup(config, meta)
  st = mlm.build_steps(config, setup.model_cfg, setup.predictions)
  state = st.init(jax.random.key(0))
  batches = iter(data_lib.make_dataset(config, meta, "train", train=True))
  leaf = lambda tree: np.asarray(jax.tree.leaves(tree)[0], np.float64)
  flags = []
  for step in range(1, 7):
    before = leaf(state.params)  # the state is donated to the step
    batch = jax.tree.map(lambda x: jax.make_array_from_process_local_data(st.batch_sharding, x),
                         next(batches))
    state, metrics = st.train_step(state, batch)
    flags.append(int(metrics["nonfinite"]))
    counts = [int(s.count) for s in jax.tree.leaves(
        state.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
        if isinstance(s, optax.ScaleByScheduleState)]
    assert counts == [int(state.step)] == [step]
  assert flags == [0, 1, 1, 0, 0, 0]
  adam = next(s for s in jax.tree.leaves(
      state.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
      if isinstance(s, optax.ScaleByAdamState))
  t = int(adam.count)
  assert t == 4  # Adam's own count: the updates applied (its bias correction)
  mu_hat = leaf(adam.mu) / (1 - config.train.b1 ** t)
  nu_hat = leaf(adam.nu) / (1 - config.train.b2 ** t)
  direction = mu_hat / (np.sqrt(nu_hat) + config.train.eps)
  delta = leaf(state.params) - before
  big = np.abs(direction) > 1e-3
  applied = np.median(-delta[big] / direction[big])
  np.testing.assert_allclose(applied, float(metrics["learning_rate"]), rtol=1e-3)
  np.testing.assert_allclose(float(metrics["learning_rate"]), float(st.schedule(5)))
