"""Staging a dataset to node-local disk: verified copies, idempotent reruns, recovery from
corruption and crashes, --only-needed, and the bad-input errors; training refuses what failed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections import namedtuple

import pytest

from lmscale_jax.input import dataset_checks as data_checks
from lmscale_jax.input import staging
from lmscale_jax.store import dataset, file_io
from tests.helpers import lmscale, make_config, make_synthetic_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def src(tmp_path_factory):
  d = tmp_path_factory.mktemp("shared") / "ds"
  make_synthetic_dataset(str(d), seq_len=32, vocab_size=64, n_train=192, n_val=24, shards=6)
  return str(d)


def stage(src, dest, **kw):
  return staging.stage(src, dest, progress=False, log=lambda m: None, **kw)


def shard_files(d):
  return sorted(f for f in os.listdir(d) if ".array_record-" in f)


def test_copy_verify_and_idempotent_rerun(src, tmp_path):
  dest = str(tmp_path / "local")
  out = stage(src, dest, workers=3)
  # 12 shards + tokenizer.json, dataset_info.json, features.json (+ metadata.json, last)
  assert out["copied"] == len(os.listdir(src)) - 1 == 15
  assert sorted(os.listdir(dest)) == sorted(os.listdir(src) + [staging.STAGE_FILE,
                                                                staging.LOCK_FILE])
  assert dataset.DatasetMeta.load(dest).verify() == []
  for f in os.listdir(src):
    assert open(f"{dest}/{f}", "rb").read() == open(f"{src}/{f}", "rb").read(), f
  assert staging.read_state(dest)["status"] == "complete"
  data_checks.check_dataset_dir(dest)  # training accepts it
  data_files = [f for f in os.listdir(dest) if f != staging.LOCK_FILE]  # (each run takes it)
  mtimes = {f: os.stat(os.path.join(dest, f)).st_mtime_ns for f in data_files}
  again = stage(src, dest, workers=3)
  assert again["copied"] == 0 and again["bytes_copied"] == 0
  assert {f: os.stat(os.path.join(dest, f)).st_mtime_ns for f in data_files} == mtimes


def flip_byte(path, offset=100, keep_mtime=False):
  st = os.stat(path)
  with open(path, "r+b") as f:
    f.seek(offset)
    b = f.read(1)
    f.seek(offset)
    f.write(bytes([b[0] ^ 0xFF]))
  # An mtime is only as fine as the kernel's clock tick: make "later" explicit, or keep it
  # (silent corruption, e.g. a disk error, does not touch it).
  t = st.st_mtime_ns if keep_mtime else st.st_mtime_ns + 10**9
  os.utime(path, ns=(st.st_atime_ns, t))


def test_corrupted_destination_file_is_recopied(src, tmp_path):
  dest = str(tmp_path / "local")
  stage(src, dest)
  names = shard_files(dest)
  victim = os.path.join(dest, names[3])
  flip_byte(victim)  # rewritten since staging verified it: re-hashed, mismatch, recopied
  out = stage(src, dest)
  assert out["copied"] == 1 and out["bytes_copied"] == os.path.getsize(victim)
  assert dataset.DatasetMeta.load(dest).verify() == []
  # Corruption that leaves size, mtime and inode alone is found by --verify-all only.
  silent = os.path.join(dest, names[5])
  flip_byte(silent, keep_mtime=True)
  assert stage(src, dest)["copied"] == 0
  out = stage(src, dest, verify_all=True)
  assert out["copied"] == 1
  assert dataset.DatasetMeta.load(dest).verify() == []


def test_partial_copy_after_a_crash_is_recovered(src, tmp_path):
  """A crash leaves a temp file, a truncated file (e.g. from cp) and staging.json 'copying',
  and no metadata.json: training refuses it; a rerun completes it."""
  dest = str(tmp_path / "local")
  stage(src, dest)
  names = shard_files(dest)
  with open(os.path.join(dest, names[0]), "r+b") as f:
    f.truncate(1000)
  shutil.copy(os.path.join(src, names[1]), os.path.join(dest, f".{names[1]}{staging.TMP_SUFFIX}"))
  os.unlink(os.path.join(dest, names[2]))
  os.unlink(os.path.join(dest, dataset.METADATA))
  file_io.atomic_write_json(os.path.join(dest, staging.STAGE_FILE),
                       {"status": "copying", "source": src, "host": "h"})
  with pytest.raises(staging.StagingError, match="did not finish .*rerun lmscale stage"):
    data_checks.check_dataset_dir(dest)
  out = stage(src, dest)
  assert out["copied"] == 2  # the truncated shard and the missing one
  assert not [f for f in os.listdir(dest) if f.endswith(staging.TMP_SUFFIX)]
  assert dataset.DatasetMeta.load(dest).verify() == []
  data_checks.check_dataset_dir(dest)


def test_only_needed(src, tmp_path):
  meta = dataset.DatasetMeta.load(src)
  train = [s["file"] for s in meta.splits["train"]["shards"]]
  # This loader (data.py) interleaves every shard over all processes: everything is needed.
  dest = str(tmp_path / "inter")
  stage(src, dest, only_needed=True, num_processes=4, process_ids=[1, 3])
  assert shard_files(dest) == shard_files(src)
  data_checks.check_dataset_dir(dest)
  # By shard (data.shard_by_process: process i reads shards i::P of every split): this node's
  # share only (test_only_needed_matches_the_by_shard_loader derives it from the loader).
  val = [s["file"] for s in meta.splits["validation"]["shards"]]
  dest = str(tmp_path / "by_shard")
  stage(src, dest, only_needed=True, num_processes=4, process_ids=[1, 3], plan="by_shard")
  assert shard_files(dest) == sorted([train[1], train[3], train[5], val[1], val[3], val[5]])
  assert staging.read_state(dest)["only_needed"] == {
      "plan": "by_shard", "num_processes": 4, "process_ids": [1, 3]}
  # … which the interleaved loader (the default) cannot train from: refused, naming why.
  with pytest.raises(staging.StagingError, match=r"6 shards the loader reads are missing .*"
                     r"--only-needed, plan 'by_shard', processes \[1, 3\] of 4.*"
                     r"data.shard_by_process=False"):
    data_checks.check_dataset_dir(dest)
  # a rerun without --only-needed completes it
  assert stage(src, dest)["copied"] == 6  # the other 3 train and 3 validation shards
  data_checks.check_dataset_dir(dest)
  with pytest.raises(staging.StagingError, match=r"--process-ids \[4\]: expected ids in \[0, 4\)"):
    stage(src, str(tmp_path / "x"), only_needed=True, num_processes=4, process_ids=[4])
  with pytest.raises(staging.StagingError, match="split 'train' has 6 shards for 7 processes: "
                                                 "a by-shard split"):
    stage(src, str(tmp_path / "x"), only_needed=True, num_processes=7, process_ids=[0],
          plan="by_shard")


def by_shard_config(path):
  """The shared test config reading ``path`` by shard (data.shard_by_process)."""
  return make_config(path, data=dict(shard_by_process=True),
                     train=dict(batch_size=8, eval_batches=2))


def test_only_needed_matches_the_by_shard_loader(src, tmp_path):
  """lmscale stage --only-needed --plan by_shard copies exactly the shard files that by-shard
  loaders (data.shard_by_process) of the listed processes read; training accepts the copy
  for those processes, refuses it for the others, and the loaders run from it."""
  from lmscale_jax.input import grain_pipeline as data_lib

  num_processes, ids = 4, [0, 2]
  meta = dataset.DatasetMeta.load(src)
  loaders = [data_lib.make_batch_loader(by_shard_config(src), meta, split,
                                        train=split == "train", process_index=process_id,
                                        process_count=num_processes)
             for process_id in ids for split in ("train", "validation")]
  read = sorted(os.path.basename(p) for loader in loaders for p in loader.records.paths)
  assert len(read) == len(set(read)) < len(shard_files(src))
  dest = tmp_path / "node"
  r = subprocess.run([*lmscale("stage"), src, str(dest), "--only-needed", "--plan", "by_shard",
                      "--num-processes", str(num_processes),
                      "--process-ids", ",".join(map(str, ids)), "--no-progress"],
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  assert shard_files(dest) == read
  staged_meta = dataset.DatasetMeta.load(str(dest))
  for process_id in range(num_processes):
    def check():
      data_checks.check_dataset_dir(str(dest), plan="by_shard", num_processes=num_processes,
                                process_id=process_id)

    if process_id in ids:
      check()
      for split in ("train", "validation"):
        batch = next(iter(data_lib.make_dataset(
            by_shard_config(dest), staged_meta, split, train=split == "train",
            process_index=process_id, process_count=num_processes)))
        assert batch["input_ids"].shape == (2, 32)
    else:
      with pytest.raises(staging.StagingError,
                         match=rf"process {process_id} of 4 reads shards {process_id}::4 "
                               "of every split"):
        check()


def test_too_little_space(src, tmp_path, monkeypatch):
  Usage = namedtuple("Usage", "total used free")
  monkeypatch.setattr(staging.shutil, "disk_usage", lambda p: Usage(10 << 30, 0, 1 << 20))
  dest = str(tmp_path / "local")
  with pytest.raises(staging.StagingError,
                     match=r"not enough space in .*local: staging needs .* but only 1.0 MB is "
                           r"free.*--only-needed"):
    stage(src, dest)
  assert shard_files(dest) == []  # nothing copied, nothing half-done


def test_bad_sources_and_destinations(src, tmp_path):
  bare = tmp_path / "bare"
  shutil.copytree(src, bare)
  os.unlink(bare / dataset.METADATA)
  with pytest.raises(staging.StagingError, match=r"has no metadata.json: not a complete"):
    stage(str(bare), str(tmp_path / "d1"))
  # a corrupt shard at the source: detected by its checksum, recorded, refused by training
  corrupt = tmp_path / "corrupt"
  shutil.copytree(src, corrupt)
  name = shard_files(corrupt)[2]
  with open(corrupt / name, "r+b") as f:
    f.seek(50)
    f.write(b"\x00\x01\x02")
  dest = str(tmp_path / "d2")
  with pytest.raises(staging.StagingError, match=rf"checksum mismatch at the source: .*{name}"):
    stage(str(corrupt), dest)
  state = staging.read_state(dest)
  assert state["status"] == "failed" and "checksum mismatch" in state["error"]
  assert not os.path.exists(os.path.join(dest, name))  # never renamed into place
  assert not os.path.exists(os.path.join(dest, dataset.METADATA))
  with pytest.raises(staging.StagingError, match="staging from .* failed: .*checksum mismatch"):
    data_checks.check_dataset_dir(dest)
  # a destination that cannot be written (its parent is a file)
  blocker = tmp_path / "file"
  blocker.write_text("x")
  with pytest.raises(staging.StagingError, match=r"destination .*file/ds is not writable"):
    stage(src, str(blocker / "ds"))
  with pytest.raises(staging.StagingError, match="same directory"):
    stage(src, src)


def test_a_lock_file_that_cannot_be_opened_is_one_error_naming_it(src, tmp_path):
  """The destination's lock is store/dir_lock's (as a workdir's and a prepared directory's):
  one that cannot be taken is a StagingError naming the file, and nothing is copied."""
  dest = tmp_path / "d"
  (dest / staging.LOCK_FILE).mkdir(parents=True)
  with pytest.raises(staging.StagingError, match=rf"cannot open {dest}/{staging.LOCK_FILE} "
                                                 rf"\(Is a directory\), needed for staging "
                                                 rf"into {dest}$"):
    stage(src, str(dest))
  assert shard_files(dest) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_read_only_destination(src, tmp_path):
  ro = tmp_path / "ro"
  ro.mkdir()
  ro.chmod(0o500)
  try:
    with pytest.raises(staging.StagingError, match="is not writable"):
      stage(src, str(ro))
  finally:
    ro.chmod(0o700)


def test_cli(src, tmp_path):
  dest = tmp_path / "cli"
  cmd = [*lmscale("stage"), src, str(dest), "--workers", "2"]
  r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  summary = json.loads(r.stdout)
  assert summary["copied"] > 0 and summary["mb_per_s"] > 0
  assert "staging:" in r.stderr and "B/s" in r.stderr  # the progress bar
  assert "sha256 verified" in r.stderr
  r = subprocess.run(cmd + ["--no-progress"], capture_output=True, text=True, timeout=120)
  assert r.returncode == 0 and json.loads(r.stdout)["copied"] == 0
  assert "nothing to copy" in r.stderr
  r = subprocess.run([*lmscale("stage"), str(tmp_path / "nope"), str(dest)],
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 1 and r.stderr.startswith("error: staging source")


def _re_prepare(directory, seed):
  """Replaces a dataset in place by another valid one, the way a re-preparation does."""
  shutil.rmtree(directory)
  make_synthetic_dataset(directory, seq_len=32, vocab_size=64, n_train=192, n_val=24, shards=6,
                         seed=seed)


@pytest.mark.parametrize("when", ["before the copies", "after the copies"])
def test_source_replaced_while_staging_is_named_and_never_committed(src, tmp_path, when,
                                                                    monkeypatch):
  """A source re-prepared mid-staging is "changed", not "corrupt"; no half-old, half-new copy
  ever gets a metadata.json; a rerun stages the new version."""
  source = str(tmp_path / "shared")
  shutil.copytree(src, source)
  dest = str(tmp_path / "local")

  def log(message):  # stage() logs "staging SRC -> DEST …" just before it copies
    if message.startswith("staging ") and when == "before the copies":
      _re_prepare(source, seed=1)

  if when == "after the copies":
    real_copy_all = staging._copy_all

    def copy_then_replace(*args, **kw):  # the real copies, then the source changes
      real_copy_all(*args, **kw)
      _re_prepare(source, seed=2)

    monkeypatch.setattr(staging, "_copy_all", copy_then_replace)
  with pytest.raises(staging.StagingError, match=r"changed while it was being staged.*"
                     r"rerun lmscale stage to stage the new version") as e:
    staging.stage(source, dest, progress=False, log=log, workers=2)
  assert "corrupt" not in str(e.value)
  assert not os.path.exists(os.path.join(dest, dataset.METADATA))
  assert staging.read_state(dest)["status"] == "failed"
  monkeypatch.undo()
  stage(source, dest, workers=2)  # the rerun succeeds, with the new version
  assert dataset.DatasetMeta.load(dest).verify() == []
  for f in os.listdir(source):
    assert open(f"{dest}/{f}", "rb").read() == open(f"{source}/{f}", "rb").read(), f


# ----------------------------------------------------------------------------- concurrent stagers
@pytest.fixture(scope="module")
def big_src(tmp_path_factory):
  """16 MB in 8 shards: one copy with --workers 1 takes long enough to be caught mid-way."""
  d = tmp_path_factory.mktemp("shared_big") / "bin"
  make_synthetic_dataset(str(d), seq_len=512, vocab_size=512, n_train=16000, n_val=64, shards=8)
  return str(d)


def stager(src, dest, log, *extra) -> subprocess.Popen:
  """lmscale stage in its own session, stderr into ``log`` (polled while it runs)."""
  return subprocess.Popen([*lmscale("stage"), src, str(dest), "--no-progress", "--workers", "1",
                           *extra], stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,
                          start_new_session=True)


def wait_until(condition, timeout=60.0, poll=0.002):
  deadline = time.monotonic() + timeout
  while not condition():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(poll)


def paused_mid_copy(src, dest, log) -> subprocess.Popen:
  """A stager stopped (SIGSTOP) while it copies: staging.json says "copying"."""
  first = stager(src, dest, log)
  wait_until(lambda: (staging.read_state(dest) or {}).get("status") == "copying")
  os.kill(first.pid, signal.SIGSTOP)
  return first


def finish_all(procs, timeout=120):
  out = []
  for p in procs:
    try:
      out.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        os.killpg(q.pid, signal.SIGKILL)
      raise
  return out


def test_three_concurrent_stagers_all_succeed_and_one_copies(big_src, tmp_path):
  """Three stagers into one DEST at once (an array job's tasks on one node): the first holds
  the destination's lock for its whole copy (paused mid-copy here, so the others certainly
  start during it); the others wait for it, then find everything verified and copy nothing."""
  dest, logs = tmp_path / "local", [tmp_path / f"stage{i}.log" for i in range(3)]
  first = paused_mid_copy(big_src, dest, logs[0])
  try:
    later = [stager(big_src, dest, log, "--wait", "60") for log in logs[1:]]
    # Both are blocked on the lock (or, without one, done already) before the first resumes.
    wait_until(lambda: all("waiting for" in log.read_text() or p.poll() is not None
                           for p, log in zip(later, logs[1:])), timeout=60, poll=0.05)
  finally:
    os.kill(first.pid, signal.SIGCONT)
  outs = finish_all([first, *later])
  errs = [log.read_text() for log in logs]
  assert [p.returncode for p in (first, *later)] == [0, 0, 0], errs
  copied = [json.loads(out)["copied"] for out in outs]
  total = len(os.listdir(big_src)) - 1  # every file but metadata.json, written last
  assert copied == [total, 0, 0], (copied, errs)
  for err in errs[1:]:
    assert f"waiting for pid {first.pid} on " in err and "nothing to copy" in err, err
  assert dataset.DatasetMeta.load(str(dest)).verify() == []
  data_checks.check_dataset_dir(str(dest))


def test_a_stager_waiting_past_its_timeout_names_the_holder(big_src, tmp_path):
  dest = tmp_path / "local"
  first = paused_mid_copy(big_src, dest, tmp_path / "first.log")
  try:
    late = stager(big_src, dest, tmp_path / "late.log", "--wait", "0.5")
    finish_all([late], timeout=60)
  finally:
    os.kill(first.pid, signal.SIGCONT)
  finish_all([first])
  err = (tmp_path / "late.log").read_text()
  assert late.returncode == 1 and first.returncode == 0, err
  assert err.splitlines()[-1] == (
      f"error: pid {first.pid} on {os.uname().nodename} has been staging into {dest} for "
      "longer than 0 s (--wait / data.stage_timeout): wait for it to finish, or raise the "
      "timeout"), err
