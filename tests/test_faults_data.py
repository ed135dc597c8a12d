"""Corrupt input at train time: real ArrayRecord shards damaged on disk (no mocks).

``data.on_corrupt="error"`` (default): a DatasetError naming the shard file and record.
``data.on_corrupt="skip"``: the record becomes an all-[PAD] row with zero MLM weights, counted
in ``batch["corrupt"]``, one warning per bad record. ``--verify_data``: sha256 of every shard
against metadata.json before training.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from lmscale_jax.errors import ConfigError
from lmscale_jax.input import dataset_checks as data_checks
from lmscale_jax.input import grain_pipeline as data_lib
from lmscale_jax.input import staging
from lmscale_jax.store import dataset, file_io
from tests.helpers import SPECIAL_IDS, make_config, make_synthetic_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ, VOCAB, N_TRAIN, N_VAL, BATCH = 64, 128, 256, 32, 8
PAD = SPECIAL_IDS["[PAD]"]
EPOCH = N_TRAIN // BATCH  # batches per epoch (one process)
SKIP_WARNING = "data.on_corrupt='skip'"


def config(path, **data):
  """The shared test config (the defaults users get) with ``data`` overrides."""
  return make_config(path, data=data, train=dict(batch_size=BATCH, eval_batches=3))


def make_dataset(cfg, split="train"):
  meta = dataset.DatasetMeta.load(cfg.data.path)
  return data_lib.make_dataset(cfg, meta, split, train=split == "train")


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
  d = tmp_path_factory.mktemp("faults") / "ds"
  make_synthetic_dataset(str(d), seq_len=SEQ, vocab_size=VOCAB, n_train=N_TRAIN, n_val=N_VAL,
                         shards=2)
  return d


@pytest.fixture
def damaged(clean, tmp_path):
  d = tmp_path / "damaged"
  shutil.copytree(clean, d)
  return d


def _reader(path):
  from array_record.python import array_record_module

  return array_record_module.ArrayRecordReader(path)


def flip_byte_in_a_record(shard: str) -> int:
  """Flips one byte in the middle of the shard's record chunks; returns the record (index in
  the shard) that no longer reads, found with a fresh reader, independently of data.py."""
  with open(shard, "rb") as f:
    raw = bytearray(f.read())
  # Records are zstd-compressed chunks from byte 64 on, then the index, then zero padding up
  # to the 64 KiB block; the middle of the non-zero part is inside some record's chunk.
  end = int(np.flatnonzero(np.frombuffer(bytes(raw[:1 << 16]), np.uint8)).max())
  offset = end * 2 // 5
  raw[offset] ^= 0x01
  with open(shard, "wb") as f:
    f.write(raw)
  r = _reader(shard)
  bad = []
  for i in range(r.num_records()):
    try:
      r.seek(i)
      r.read()
    except Exception:  # noqa: BLE001 - the chunk's hash check
      bad.append(i)
      r = _reader(shard)  # a Riegeli reader that failed stays failed
  r.close()
  assert len(bad) == 1, f"byte {offset}: expected one unreadable record, got {bad}"
  return bad[0]


def rewrite_with_bad_records(shard: str) -> list[int]:
  """Rewrites the shard with records 5 (wrong length) and 9 (token id >= vocab) bad; the
  others unchanged. Returns the bad records' indices in the shard."""
  r = _reader(shard)
  recs = list(r.read_all())
  r.close()
  recs[5] = dataset.encode_record(np.full(SEQ // 2, 7, np.uint16))
  ids = dataset.decode_record(recs[9], SEQ).copy()
  ids[3] = VOCAB + 50
  recs[9] = dataset.encode_record(ids)
  os.remove(shard)
  dataset.write_array_record(shard, recs)
  return [5, 9]


def damage(path, kind: str) -> tuple[str, list[int]]:
  """Damages a train shard -> (shard path, bad split record indices)."""
  meta = dataset.DatasetMeta.load(str(path))
  which = 0 if kind == "malformed" else 1
  shard = meta.shard_paths("train")[which]
  start = sum(s["records"] for s in meta.splits["train"]["shards"][:which])
  n = meta.splits["train"]["shards"][which]["records"]
  if kind == "flip":
    bad = [flip_byte_in_a_record(shard)]
  elif kind == "truncate":  # e.g. an interrupted copy: footer and postscript are gone
    os.truncate(shard, os.path.getsize(shard) // 3)
    bad = list(range(n))
  else:
    bad = rewrite_with_bad_records(shard)
  return shard, [start + i for i in bad]


def epoch_batches(cfg, epochs=1):
  """``epochs`` epochs of train batches from make_dataset, and each batch's record indices."""
  it = iter(make_dataset(cfg))
  batches = [next(it) for _ in range(EPOCH * epochs)]
  loader = data_lib.make_batch_loader(cfg, dataset.DatasetMeta.load(cfg.data.path), "train",
                                      train=True)
  indices = [loader.record_indices(loader.positions(b)) for b in range(len(batches))]
  return batches, indices


# --------------------------------------------------------------------------- error (default)
@pytest.mark.parametrize("kind", ["flip", "truncate", "malformed"])
def test_corruption_is_an_error_naming_file_and_record(damaged, kind):
  shard, bad = damage(damaged, kind)
  name = re.escape(os.path.basename(shard))
  if kind == "flip":  # the chunk's hash check fails when the record is read
    meta = dataset.DatasetMeta.load(str(damaged))
    local = bad[0] - meta.splits["train"]["shards"][0]["records"]
    expected = rf"{name}: record {local} \(split record {bad[0]}\): unreadable"
  elif kind == "truncate":
    expected = rf"{name}: cannot open ArrayRecord shard"
  else:  # the first bad record the shuffled stream reaches: 5 (malformed) or 9 (token id)
    expected = (rf"{name}: record (5 \(split record 5\): malformed|9 \(split record 9\): "
                rf"token id {VOCAB + 50} at position 3 >= vocab_size {VOCAB})")
  for cfg in (config(damaged), config(damaged, on_corrupt="error")):  # default, explicit
    it = iter(make_dataset(cfg))
    with pytest.raises(dataset.DatasetError, match=expected):
      for _ in range(EPOCH):
        next(it)


def test_default_batches_have_no_corrupt_key_and_mode_is_validated(clean):
  batch = next(iter(make_dataset(config(clean))))
  assert set(batch) == {"input_ids", "mlm_positions", "mlm_labels", "mlm_weights"}
  with pytest.raises(ConfigError, match=r"data.on_corrupt 'ignore': expected one of "
                                        r"\('error', 'skip'\)"):
    make_dataset(config(clean, on_corrupt="ignore"))


# --------------------------------------------------------------------------- skip
@pytest.mark.parametrize("kind", ["flip", "truncate", "malformed"])
def test_skip_mode_pads_counts_and_warns_once(clean, damaged, kind, caplog):
  shard, bad = damage(damaged, kind)
  caplog.set_level("WARNING")
  got, indices = epoch_batches(config(damaged, on_corrupt="skip"), epochs=2)
  want, want_indices = epoch_batches(config(clean, on_corrupt="skip"), epochs=2)
  for b, (g, w, idx) in enumerate(zip(got, want, indices)):
    np.testing.assert_array_equal(idx, want_indices[b])  # same order, corrupt or not
    assert g.keys() == w.keys() and g["corrupt"].dtype == np.int32
    assert g["corrupt"].shape == (BATCH,)
    rows = np.isin(idx, bad)
    np.testing.assert_array_equal(g["corrupt"], rows.astype(np.int32))
    assert not w["corrupt"].any()
    # Skipped rows: all [PAD], nothing to predict (zero weights: no loss, no gradient).
    assert (g["input_ids"][rows] == PAD).all()
    for k in ("mlm_weights", "mlm_positions", "mlm_labels"):
      assert not g[k][rows].any(), k
    for k in ("input_ids", "mlm_positions", "mlm_labels", "mlm_weights"):
      np.testing.assert_array_equal(g[k][~rows], w[k][~rows], err_msg=f"batch {b} {k}")
  assert sum(int(g["corrupt"].sum()) for g in got) == 2 * len(bad)  # every record, each epoch
  warnings = [r.getMessage() for r in caplog.records if SKIP_WARNING in r.getMessage()]
  name = os.path.basename(shard)
  if kind == "truncate":  # one warning for the shard, none per record
    assert len(warnings) == 1, warnings
    assert f"{name}: cannot open ArrayRecord shard" in warnings[0]
    assert f"skipping all its {len(bad)} records" in warnings[0]
  else:  # one per bad record, although each was read twice
    assert len(warnings) == len(bad), warnings
    for i in bad:
      assert sum(f"(split record {i})" in m and name in m for m in warnings) == 1, warnings


def test_skip_mode_eval_split(damaged):
  """The validation split honours the mode too (in file order)."""
  meta = dataset.DatasetMeta.load(str(damaged))
  shard = meta.shard_paths("validation")[0]
  k = flip_byte_in_a_record(shard)
  cfg = config(damaged, on_corrupt="skip")
  cfg.train.eval_batches = N_VAL // BATCH
  batches = list(make_dataset(cfg, "validation"))
  corrupt = np.concatenate([b["corrupt"] for b in batches])
  np.testing.assert_array_equal(np.flatnonzero(corrupt), [k])
  assert not np.concatenate([b["mlm_weights"] for b in batches])[k].any()


# --------------------------------------------------------------------------- --verify_data
def test_verify_shards(clean, damaged):
  logs = []
  meta = dataset.DatasetMeta.load(str(clean))
  out = data_checks.verify_shards(meta, log=logs.append)
  assert out["files"] == 4 and out["bytes"] == sum(
      s["bytes"] for sp in meta.splits.values() for s in sp["shards"])
  assert len(logs) == 1 and "verified 4 shards" in logs[0] and "MB/s" in logs[0]
  assert data_checks.verify_shards(meta, splits=("validation",), log=logs.append)["files"] == 2

  shard, _ = damage(damaged, "flip")  # same size, different bytes
  damaged_meta = dataset.DatasetMeta.load(str(damaged))
  entry = next(s for s in meta.splits["train"]["shards"] if s["file"] == os.path.basename(shard))
  actual = file_io.sha256_file(shard)
  with pytest.raises(staging.StagingError) as e:
    data_checks.verify_shards(damaged_meta, log=logs.append)
  msg = str(e.value)
  assert "\n" not in msg
  assert f"{shard}: sha256 {actual}, expected {entry['sha256']} (metadata.json)" in msg
  os.truncate(shard, 1000)
  with pytest.raises(staging.StagingError,
                     match=rf"{re.escape(shard)}: size 1000 bytes, expected {entry['bytes']}"):
    data_checks.verify_shards(damaged_meta, log=logs.append)


def test_verify_data_flag_stops_before_training(damaged, tmp_path):
  shard, _ = damage(damaged, "flip")
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
  r = subprocess.run(
      [sys.executable, "-m", "lmscale_jax.main", f"--config={ROOT}/configs/tiny.py",
       f"--workdir={tmp_path / 'w'}", f"--config.data.path={damaged}",
       "--config.train.steps=1", "--verify_data"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode != 0
  errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1, r.stderr[-3000:]
  assert f"error: data verification failed: {shard}: sha256 " in errors[0]
  assert "Traceback" not in r.stderr
  assert not (tmp_path / "w" / "metrics.jsonl").exists()  # no training step ran


def test_an_error_while_a_save_is_in_flight_keeps_that_save(clean, tmp_path):
  """A corrupt validation record met by the evaluation one step after an (asynchronous) save:
  one error line, no traceback, and that save finished and verifies, so the rerun on intact
  data resumes from it (the error path abandoned it: only its tmp directory was left, and 70
  "Event loop is closed" tracebacks)."""
  from lmscale_jax.train import checkpoint_manifest

  bad = tmp_path / "bad"
  shutil.copytree(clean, bad)
  shard = os.path.join(bad, dataset.shard_filename("synthetic", "validation", 0, 2))
  flip_byte_in_a_record(shard)
  workdir = tmp_path / "w"
  run = [sys.executable, "-m", "lmscale_jax.main", f"--config={ROOT}/configs/tiny.py",
         f"--workdir={workdir}", "--config.train.batch_size=8", "--config.train.steps=12",
         "--config.checkpoint.every=5", "--config.train.eval_every=6",
         "--config.train.eval_batches=2", "--config.train.log_every=1"]
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
  r = subprocess.run(run + [f"--config.data.path={bad}"], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 1, r.stderr[-3000:]
  errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and f"error: {shard}: record " in errors[0], r.stderr[-3000:]
  assert "Traceback" not in r.stderr, r.stderr[-3000:]
  assert os.listdir(workdir / "checkpoints") == ["5"]
  assert checkpoint_manifest.verify(str(workdir / "checkpoints" / "5")) == []
  r = subprocess.run(run + [f"--config.data.path={clean}"], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0 and f"resumed from {workdir}/checkpoints/5" in r.stderr, \
      r.stderr[-3000:]
