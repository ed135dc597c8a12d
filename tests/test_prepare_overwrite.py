"""prepare --overwrite replaces the dataset only once the new one is complete (issue 55, item 3):
it used to delete the old dataset first, so a new run that failed (an empty validation split)
left an empty directory and said "nothing was written". Now a failed, killed or disk-full run
leaves the old dataset complete and usable (inspect-data --verify passes), and a run killed
during the final swap is completed by the next run: either the old dataset or the new one,
never neither. Only the dataset's own files are replaced: a README beside it stays.

Real preparations, run as the user runs them (the CLI, kill -9, a small tmpfs); the cut-short
swap stops the real swap code after each of its steps.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess

import pytest

from lmscale_jax.prep import cluster_extract, cluster_stages, dataset_swap, output_dir, prepare
from lmscale_jax.store import dataset, destination
from tests.helpers import lmscale
from tests.test_bad_input_prepare import (_bin_args, _start, _wait_for, cli, one_line, text_file,
                                          text_opts)
from tests.test_prepare import SEQ, opts, small_elves
from tests.test_stage_destination import snapshot
from tests.test_worker_pool import kill_group

README = "my notes on this dataset\n"


@pytest.fixture(scope="module")
def old(tmp_path_factory):
  """A prepared text dataset (seq 128, several shards) with the user's README beside it."""
  top = tmp_path_factory.mktemp("old")
  out = top / "ds"
  prepare.prepare(text_opts(out, [text_file(top / "c.jsonl", n=1500)], seq_len=128,
                            shard_size_mb=0.01))
  (out / "README").write_text(README)
  return out


def fresh_copy(old, where):
  shutil.copytree(old, where)
  return where


def inspect_verify(out) -> subprocess.CompletedProcess:
  return subprocess.run([*lmscale("inspect_data"), str(out), "--verify"], capture_output=True,
                        text=True, timeout=120)


def old_files(out) -> dict:
  """The dataset's files and the README, with their digests: not the manifest, which also
  names the new run's _work/, nor the work and the lock a kill leaves."""
  return {k: v for k, v in snapshot(out).items() if k != output_dir.MANIFEST
          and not k.startswith(output_dir.WORK) and k not in destination.LOCKS}


def assert_replaced(out, seq_len):
  """The new dataset alone, complete, its manifest exact, the README kept, no work left."""
  assert dataset.DatasetMeta.load(str(out)).verify() == []
  assert dataset.DatasetMeta.load(str(out)).seq_len == seq_len
  assert (out / "README").read_text() == README
  names = set(os.listdir(out))
  assert output_dir.WORK not in names
  listed = set(json.loads((out / output_dir.MANIFEST).read_text())["files"])
  assert listed == names - {"README", output_dir.MANIFEST}


def test_a_failed_overwrite_keeps_the_old_dataset_complete_and_usable(old, tmp_path):
  out = fresh_copy(old, tmp_path / "ds")
  before = snapshot(out)
  r = cli("prepare_text.py", "--input", text_file(tmp_path / "few.jsonl", n=50), "--output", out,
          "--vocab-size", 128, "--workers", 1, "--no-progress", "--overwrite",
          "--val-fraction", "0.000001")
  err = one_line(r)
  assert "split 'validation' would have 0 sequences" in err
  assert err.endswith(f"nothing was written to {out} (the work files were removed); the "
                      f"dataset already in {out} is kept as it was"), err
  assert snapshot(out) == before
  assert inspect_verify(out).returncode == 0


def test_a_killed_overwrite_keeps_the_old_dataset_and_the_same_command_then_replaces_it(
    old, tmp_path):
  out = fresh_copy(old, tmp_path / "ds")
  before = old_files(out)
  args = [*_bin_args(out, *small_elves()), "--overwrite"]
  proc = _start(args, start_new_session=True)
  try:
    _wait_for(proc, out / output_dir.WORK / "corpus-00000.json")
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
  finally:
    kill_group(proc.pid)
  assert old_files(out) == before
  assert inspect_verify(out).returncode == 0
  r = cli("prepare_binary.py", *args)
  assert r.returncode == 0, r.stderr
  assert_replaced(out, seq_len=SEQ)
  assert json.loads((out / dataset.METADATA).read_text())["kind"] == "binary"


class Killed(BaseException):
  """The swap stopped where a kill -9 would stop it."""


class _StepCounter:
  """Stands for ``os`` in dataset_swap: each rename and each removal is a step; after ``stop``
  steps the next one raises :class:`Killed` instead of running."""

  def __init__(self, stop):
    self.stop, self.steps = stop, 0

  def step(self):
    if self.steps == self.stop:
      raise Killed
    self.steps += 1

  def __getattr__(self, name):
    return getattr(os, name)

  def replace(self, a, b):
    self.step()
    os.replace(a, b)


def _swap_steps(monkeypatch, stop):
  counter = _StepCounter(stop)
  real_remove = dataset_swap._remove

  def remove(path):
    counter.step()
    real_remove(path)

  monkeypatch.setattr(dataset_swap, "os", counter)
  monkeypatch.setattr(dataset_swap, "_remove", remove)
  return counter


@pytest.fixture(scope="module")
def ready_to_swap(old, tmp_path_factory):
  """An --overwrite run (seq 64, fewer shards) stopped just after its swap's journal: the old
  dataset still complete beside the finished new one in _work/new."""
  top = tmp_path_factory.mktemp("ready")
  out = fresh_copy(old, top / "ds")
  o = text_opts(out, [text_file(top / "c.jsonl", n=1500)], seq_len=64, overwrite=True)
  with pytest.MonkeyPatch.context() as mp:
    _swap_steps(mp, stop=0)
    with pytest.raises(Killed):
      prepare.prepare(o)
  assert (out / output_dir.WORK / dataset_swap.JOURNAL).exists()
  assert dataset.DatasetMeta.load(str(out)).verify() == []  # the old one, still usable
  with pytest.MonkeyPatch.context() as mp:  # how many steps the whole swap takes
    counter = _swap_steps(mp, stop=-1)
    dataset_swap.complete_interrupted(str(fresh_copy(out, top / "count")))
  return out, o, counter.steps


def test_a_swap_cut_short_after_any_step_is_completed_by_the_same_command(
    ready_to_swap, tmp_path, monkeypatch, capfd):
  """kill -9 after each step of the swap: the directory never holds a mix presented as
  complete, and the rerun completes the swap (it does not prepare again) to the new dataset."""
  template, o, steps = ready_to_swap
  assert steps > 10
  for stop in range(steps):
    out = fresh_copy(template, tmp_path / f"cut{stop}")
    with monkeypatch.context() as mp:
      _swap_steps(mp, stop)
      with pytest.raises(Killed):
        dataset_swap.complete_interrupted(str(out))
    new_meta = next(p for p in (out / output_dir.WORK / "new" / dataset.METADATA,
                                out / dataset.METADATA) if p.exists()).read_bytes()
    if (out / dataset.METADATA).exists():  # complete: the old dataset or the new one, whole
      assert dataset.DatasetMeta.load(str(out)).verify() == [], stop
    capfd.readouterr()
    stats = prepare.prepare(dataclasses.replace(o, output=str(out)))
    assert "completed the replacement of the dataset" in capfd.readouterr().err, stop
    assert stats == json.loads((out / dataset.STATS).read_text())
    assert (out / dataset.METADATA).read_bytes() == new_meta, stop
    assert_replaced(out, seq_len=64)


def test_a_cluster_overwrite_keeps_the_old_dataset_usable_until_its_finish_stage(old, tmp_path):
  out = fresh_copy(old, tmp_path / "ds")
  o = opts(out, small_elves(2), overwrite=True, chunk_mb=0.05, shard_size_mb=0.05)
  stages = [lambda: cluster_extract.plan(o, slices=2, buckets=2),
            lambda: cluster_extract.extract(str(out), 0, 1, 1),
            lambda: cluster_extract.dedup(str(out), 0, 1),
            lambda: cluster_stages.layout(str(out), 1),
            lambda: cluster_stages.pack(str(out), 0, 1, 1),
            lambda: cluster_stages.shards(str(out), 0, 1, 1)]
  before = old_files(out)
  for run in stages:
    run()
    assert old_files(out) == before
    assert dataset.DatasetMeta.load(str(out)).verify() == []
  cluster_stages.finish(str(out))
  assert_replaced(out, seq_len=o.seq_len)


def test_an_overwrite_that_fills_the_disk_keeps_the_old_dataset_and_says_both_need_room(
    old, tmp_path):
  mnt = tmp_path / "small"
  mnt.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                    capture_output=True).returncode:
    pytest.skip("cannot mount a small tmpfs here (needs root)")
  try:
    out = fresh_copy(old, mnt / "ds")
    before = old_files(out)
    r = cli("prepare_binary.py", *_bin_args(out, *small_elves(3)), "--overwrite")
    err = one_line(r)
    assert "no space left" in err and (f"--overwrite keeps the dataset already in {out} until "
                                       "the new one is complete, so both need room") in err, err
    assert old_files(out) == before
    assert inspect_verify(out).returncode == 0
  finally:
    subprocess.run(["umount", "-l", str(mnt)], check=False)
