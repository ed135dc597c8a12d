"""The input pipeline: MLM masking (masking.py), the shuffle (hashing.py), the Grain loader and
its read plan (data.py), checkpointing, device prefetch (prefetch.py), errors (records.py)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from lmscale_jax.config import checks as config_checks
from lmscale_jax.errors import ConfigError
from lmscale_jax.input import hashing, masking, prefetch
from lmscale_jax.input import grain_pipeline as data_lib
from lmscale_jax.store import dataset
from tests.helpers import SPECIAL_IDS, make_config, make_synthetic_dataset

SEQ, VOCAB, N_TRAIN, N_VAL = 64, 128, 256, 32
VOCAB_BIG = 30000  # for masking statistics: random replacements rarely equal the original
MASK = SPECIAL_IDS["[MASK]"]
SPECIAL = np.array(sorted(SPECIAL_IDS.values()))


def config(path, **data):
  """The shared test config (the defaults users get) with ``data`` overrides, batches of 8
  and 3 eval batches."""
  return make_config(path, data=data, train=dict(batch_size=8, eval_batches=3))


def make_dataset(cfg, split="train", **kwargs):
  """``data.make_dataset`` with the dataset's metadata loaded here, as callers do once."""
  kwargs.setdefault("train", split == "train")
  return data_lib.make_dataset(cfg, dataset.DatasetMeta.load(cfg.data.path), split, **kwargs)


def make_batch_loader(cfg, split="train", **kwargs):
  kwargs.setdefault("train", split == "train")
  return data_lib.make_batch_loader(cfg, dataset.DatasetMeta.load(cfg.data.path), split,
                                    **kwargs)


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("data")
  make_synthetic_dataset(str(d), seq_len=SEQ, vocab_size=VOCAB, n_train=N_TRAIN, n_val=N_VAL,
                         shards=2)
  return d


@pytest.fixture
def dataset_copy(dataset_dir, tmp_path):
  """A private copy the test may damage."""
  d = tmp_path / "copy"
  shutil.copytree(dataset_dir, d)
  return d


def read_split(path, split) -> np.ndarray:
  """All records of a split in file order, read independently of data.py."""
  from array_record.python import array_record_module

  meta = dataset.DatasetMeta.load(str(path))
  out = []
  for p in meta.shard_paths(split):
    r = array_record_module.ArrayRecordReader(p)
    out += [dataset.decode_record(x, meta.seq_len) for x in r.read_all()]
    r.close()
  return np.stack(out).astype(np.int32)


def unmask(batch) -> np.ndarray:
  """The original sequences of a batch: labels put back at the predicted positions."""
  ids = batch["input_ids"].copy()
  rows, slots = np.nonzero(batch["mlm_weights"])
  ids[rows, batch["mlm_positions"][rows, slots]] = batch["mlm_labels"][rows, slots]
  return ids


def take(it, n):
  return [next(it) for _ in range(n)]


def assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(np.asarray(x[k]), np.asarray(y[k]), err_msg=k)


# --------------------------------------------------------------------------- masking
def random_sequences(rng, n, seq, vocab):
  """[CLS] body [SEP] [PAD]... with a few special ids ([UNK], [MASK]) sprinkled in the body."""
  x = rng.integers(len(SPECIAL), vocab, (n, seq))
  lengths = rng.integers(seq // 2, seq + 1, n)
  x[rng.random((n, seq)) < 0.02] = SPECIAL_IDS["[UNK]"]
  x[rng.random((n, seq)) < 0.01] = MASK
  x[:, 0] = SPECIAL_IDS["[CLS]"]
  for i, length in enumerate(lengths):
    x[i, length - 1] = SPECIAL_IDS["[SEP]"]
    x[i, length:] = SPECIAL_IDS["[PAD]"]
  return x.astype(np.uint16)


def check_masking(ids, out, p, vocab, mask_prob=0.15):
  """Invariants of one masked batch [B, S] -> counts (chosen, maskable, mask, kept, random)."""
  ids = ids.astype(np.int32)
  b, s = ids.shape
  assert out["input_ids"].dtype == np.int32 and out["input_ids"].shape == (b, s)
  for k, dt in (("mlm_positions", np.int32), ("mlm_labels", np.int32),
                ("mlm_weights", np.float32)):
    assert out[k].dtype == dt and out[k].shape == (b, p), k
  maskable = ~np.isin(ids, SPECIAL)
  n = maskable.sum(1)
  k = np.where(n > 0, np.clip(np.floor(mask_prob * n + 0.5), 1, p), 0).astype(int)
  w, pos, lab = out["mlm_weights"], out["mlm_positions"], out["mlm_labels"]
  inp = out["input_ids"]
  np.testing.assert_array_equal(w.sum(1), k)  # round(15% of maskable), >= 1, <= P
  np.testing.assert_array_equal(w, np.arange(p)[None] < k[:, None])  # real slots first
  counts = np.zeros(5, np.int64)
  for r in range(b):
    real = pos[r, :k[r]]
    assert np.all(np.diff(real) > 0), "positions ascending and distinct"
    assert np.all(pos[r, k[r]:] == 0) and np.all(lab[r, k[r]:] == 0), "padding slots are 0"
    assert maskable[r, real].all(), "a special/pad token was chosen"
    np.testing.assert_array_equal(lab[r, :k[r]], ids[r, real])  # labels = original ids
    other = np.ones(s, bool)
    other[real] = False
    np.testing.assert_array_equal(inp[r, other], ids[r, other])  # nothing else changed
    new = inp[r, real]
    is_mask = new == MASK
    kept = ~is_mask & (new == ids[r, real])
    rand = ~is_mask & ~kept
    assert not np.isin(new[rand], SPECIAL).any(), "random replacement must be non-special"
    assert (new[rand] < vocab).all()
    counts += [k[r], n[r], is_mask.sum(), kept.sum(), rand.sum()]
  return counts


def test_mask_tokens_rates_and_invariants():
  rng = np.random.default_rng(0)
  seqs = random_sequences(rng, 1500, 128, VOCAB_BIG)
  p = 20
  outs = [masking.mask_tokens(x, rng, special_ids=SPECIAL_IDS, vocab_size=VOCAB_BIG,
                               mask_prob=0.15, max_predictions=p) for x in seqs]
  batch = {k: np.stack([o[k] for o in outs]) for k in outs[0]}
  chosen, maskable, n_mask, n_kept, n_rand = check_masking(seqs, batch, p, VOCAB_BIG)
  assert abs(chosen / maskable - 0.15) < 0.01
  assert abs(n_mask / chosen - 0.8) < 0.02
  assert abs(n_kept / chosen - 0.1) < 0.02
  assert abs(n_rand / chosen - 0.1) < 0.02
  seqs_in = seqs.copy()
  masking.mask_tokens(seqs[0], rng, special_ids=SPECIAL_IDS, vocab_size=VOCAB_BIG)
  np.testing.assert_array_equal(seqs, seqs_in)  # the input is not modified


def test_mask_tokens_limits():
  rng = np.random.default_rng(1)
  kw = dict(special_ids=SPECIAL_IDS, vocab_size=VOCAB_BIG)
  body = np.arange(10, 110, dtype=np.uint16)  # 100 maskable tokens
  out = masking.mask_tokens(body, rng, max_predictions=5, **kw)  # 15 wanted, capped at P=5
  assert out["mlm_weights"].sum() == 5 and out["mlm_positions"].shape == (5,)
  specials = np.array([2, 3, 0, 0, 0], np.uint16)  # nothing maskable
  out = masking.mask_tokens(specials, rng, max_predictions=3, **kw)
  assert out["mlm_weights"].sum() == 0
  np.testing.assert_array_equal(out["input_ids"], specials)
  np.testing.assert_array_equal(out["mlm_positions"], 0)
  one = np.array([2, 50, 3, 0], np.uint16)  # 0.15 * 1 rounds to 0: still predict one token
  out = masking.mask_tokens(one, rng, max_predictions=2, **kw)
  np.testing.assert_array_equal(out["mlm_weights"], [1, 0])
  np.testing.assert_array_equal(out["mlm_positions"], [1, 0])
  np.testing.assert_array_equal(out["mlm_labels"], [50, 0])
  # Default P = ceil(0.15 * S).
  assert masking.mask_tokens(body, rng, **kw)["mlm_positions"].shape == (15,)


def test_batch_masking_rates_and_keying():
  """The loader's batched, position-keyed masking has the same invariants and rates, and a
  row's mask depends only on (seed, its global position), not on the rest of its batch."""
  rng = np.random.default_rng(2)
  ids = random_sequences(rng, 1500, 128, VOCAB_BIG).astype(np.int32)
  masker = masking.Masker(SPECIAL_IDS, VOCAB_BIG, 0.15, 20, 128)
  positions = np.arange(1500, dtype=np.int64) * 7 + 11
  out = masker.keyed(ids, positions, seed=5)
  chosen, maskable, n_mask, n_kept, n_rand = check_masking(ids, out, 20, VOCAB_BIG)
  assert abs(chosen / maskable - 0.15) < 0.01
  assert abs(n_mask / chosen - 0.8) < 0.02
  assert abs(n_kept / chosen - 0.1) < 0.02
  assert abs(n_rand / chosen - 0.1) < 0.02
  perm = rng.permutation(1500)[:100]
  sub = masker.keyed(ids[perm], positions[perm], seed=5)
  for k in out:
    np.testing.assert_array_equal(sub[k], out[k][perm], err_msg=k)
  other = masker.keyed(ids, positions, seed=6)
  assert not np.array_equal(other["mlm_positions"], out["mlm_positions"])


def test_num_predictions_is_max_predictions_or_the_masking_rate_of_the_sequence():
  assert masking.num_predictions(0.15, 0, 64) == 10  # ceil(9.6)
  assert masking.num_predictions(0.15, 7, 64) == 7
  assert masking.Masker(SPECIAL_IDS, VOCAB, 0.15, 0, 512).num_predictions == 77
  with pytest.raises(ConfigError, match=r"data.mask_prob=1.5: expected a value in \(0, 1\)"):
    masking.num_predictions(1.5, 0, 64)
  with pytest.raises(ConfigError, match=r"data.max_predictions=-2: expected a positive count"):
    masking.num_predictions(0.15, -2, 64)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097, 20011])
def test_feistel_permute_is_a_permutation(n):
  k = np.arange(n)
  p0 = hashing.feistel_permute(k, n, seed=3, epoch=np.zeros(n, np.int64))
  assert sorted(p0.tolist()) == list(range(n))
  if n >= 64:
    p1 = hashing.feistel_permute(k, n, seed=3, epoch=np.ones(n, np.int64))
    q0 = hashing.feistel_permute(k, n, seed=4, epoch=np.zeros(n, np.int64))
    assert sorted(p1.tolist()) == list(range(n))
    assert (p0 != p1).mean() > 0.9 and (p0 != q0).mean() > 0.9  # epochs and seeds reshuffle
    assert (p0 != k).mean() > 0.9  # not the identity


# --------------------------------------------------------------------------- loader
def test_batches_follow_the_contract_and_are_deterministic(dataset_dir):
  cfg = config(dataset_dir)
  a = take(iter(make_dataset(cfg, "train", train=True)), 5)
  b = take(iter(make_dataset(cfg, "train", train=True)), 5)
  assert_batches_equal(a, b)
  p = int(np.ceil(0.15 * SEQ))
  for batch in a:
    check_masking(unmask(batch), batch, p, VOCAB)
    assert batch["input_ids"].shape == (8, SEQ)
  c = take(iter(make_dataset(config(dataset_dir, seed=1), "train", train=True)), 5)
  assert not np.array_equal(unmask(a[0]), unmask(c[0]))  # another seed, another order


def test_train_order_is_a_fresh_permutation_every_epoch(dataset_dir):
  records = read_split(dataset_dir, "train")
  it = iter(make_dataset(config(dataset_dir), "train", train=True))
  per_epoch = N_TRAIN // 8
  rows = np.concatenate([unmask(b) for b in take(it, 2 * per_epoch)])
  epochs = rows[:N_TRAIN], rows[N_TRAIN:]
  for epoch in epochs:  # each epoch visits every record exactly once
    assert len(np.unique(epoch, axis=0)) == N_TRAIN
    assert sorted(map(bytes, epoch)) == sorted(map(bytes, records))
  assert not np.array_equal(epochs[0], epochs[1])  # reshuffled
  assert not np.array_equal(epochs[0], records)  # shuffled at all


def test_process_slices_interleave_to_the_global_stream(dataset_dir):
  """Process i of 2 gets global positions i, i+2, ...: the slices are disjoint, together cover
  the single-process stream, and (masking keyed by global position) are identical to it."""
  cfg = config(dataset_dir)
  whole = np.concatenate([b["input_ids"] for b in
                          take(iter(make_dataset(cfg, "train", train=True)), 24)])
  parts = [np.concatenate([b["input_ids"] for b in take(iter(make_dataset(
      cfg, "train", train=True, process_index=i, process_count=2)), 24)]) for i in range(2)]
  assert parts[0].shape == (96, SEQ)
  np.testing.assert_array_equal(parts[0], whole[0::2])
  np.testing.assert_array_equal(parts[1], whole[1::2])
  loader = [make_batch_loader(cfg, "train", train=True, process_index=i, process_count=2)
            for i in range(2)]
  pos = [np.concatenate([l.positions(b) for b in range(24)]) for l in loader]
  assert not set(pos[0]) & set(pos[1])
  assert set(pos[0]) | set(pos[1]) == set(range(96 * 2))


def test_eval_is_fixed_finite_and_wraps_a_small_split(dataset_dir):
  cfg = config(dataset_dir)
  cfg.train.eval_batches = 6  # 48 rows from a 32-record split
  eval_ds = make_dataset(cfg, "validation", train=False)
  first, second = list(iter(eval_ds)), list(iter(eval_ds))
  assert len(first) == 6
  assert_batches_equal(first, second)  # every evaluation sees the same batches
  cfg.data.seed = 9  # and they do not depend on the training seed
  assert_batches_equal(first, list(iter(make_dataset(cfg, "validation", train=False))))
  rows = np.concatenate([unmask(b) for b in first])
  records = read_split(dataset_dir, "validation")
  np.testing.assert_array_equal(rows, records[np.arange(48) % N_VAL])  # file order, wrapped


@pytest.mark.parametrize("workers", [0, 1])
def test_iterator_checkpoint_restores_identical_batches(dataset_dir, workers):
  ds_ = make_dataset(config(dataset_dir, workers=workers), "train", train=True)
  it = iter(ds_)
  take(it, 3)
  state = it.get_state()
  json.dumps(state)  # Grain's Orbax handler stores it as JSON
  expected = take(it, 4)
  fresh = iter(ds_)
  fresh.set_state(state)
  assert_batches_equal(take(fresh, 4), expected)
  for x in (it, fresh):
    x.close()


# --------------------------------------------------------------------------- by-shard mode
@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory):
  """6 shards per split: 4 processes get 2, 2, 1, 1 of them (uneven on purpose)."""
  d = tmp_path_factory.mktemp("sharded")
  make_synthetic_dataset(str(d), seq_len=SEQ, vocab_size=VOCAB, n_train=N_TRAIN, n_val=N_VAL,
                         shards=6)
  return d


def shard_records(path, split, files) -> list[bytes]:
  """The records (as bytes of their int32 ids) of the given shard files, in file order."""
  meta = dataset.DatasetMeta.load(str(path))
  names = [s["file"] for s in meta.splits[split]["shards"]]
  counts = [s["records"] for s in meta.splits[split]["shards"]]
  rows = read_split(path, split)
  ends = np.cumsum(counts)
  return [bytes(r) for f in files for r in rows[ends[names.index(f)] - counts[names.index(f)]:
                                                ends[names.index(f)]]]


def test_by_shard_processes_read_disjoint_shards_covering_every_record(sharded_dir,
                                                                       monkeypatch):
  """data.shard_by_process: process i of 4 opens only shards i::4 of each split; each epoch of
  its train stream is a permutation of exactly those shards' records (reshuffled per epoch);
  eval is its records in file order, wrapping; the processes' record sets are disjoint and
  together are the whole split; masking keys stay globally unique."""
  from array_record.python import array_record_module

  pc = 4
  meta = dataset.DatasetMeta.load(str(sharded_dir))
  names = {s: [x["file"] for x in meta.splits[s]["shards"]] for s in meta.splits}
  expected = {s: [names[s][pi::pc] for pi in range(pc)] for s in names}
  want = {s: [shard_records(sharded_dir, s, f) for f in expected[s]] for s in names}
  opened = []
  real_reader = array_record_module.ArrayRecordReader

  def spy(path, *args, **kwargs):
    opened.append(os.path.basename(path))
    return real_reader(path, *args, **kwargs)

  monkeypatch.setattr(array_record_module, "ArrayRecordReader", spy)
  cfg = config(sharded_dir, shard_by_process=True)
  cfg.train.eval_batches = 8  # 16 rows per process: wraps every process's validation share
  seen, positions = [], []
  for pi in range(pc):
    opened.clear()
    loader = make_batch_loader(cfg, "train", train=True, process_index=pi, process_count=pc)
    assert [os.path.basename(p) for p in loader.records.paths] == expected["train"][pi]
    n = len(want["train"][pi])
    assert len(loader.records) == n
    batches = -(-2 * n // loader.local_batch)  # two epochs
    positions.append(np.concatenate([loader.positions(b) for b in range(batches)]))
    rows = np.concatenate([unmask(b) for b in take(iter(make_dataset(
        cfg, "train", train=True, process_index=pi, process_count=pc)), batches)])
    epochs = [list(map(bytes, rows[:n])), list(map(bytes, rows[n:2 * n]))]
    for epoch in epochs:
      assert sorted(epoch) == sorted(want["train"][pi])
    assert epochs[0] != epochs[1] and epochs[0] != want["train"][pi]  # shuffled, reshuffled
    seen.append(set(epochs[0]))
    ev = np.concatenate([unmask(b) for b in make_dataset(
        cfg, "validation", train=False, process_index=pi, process_count=pc)])
    local_val = want["validation"][pi]
    assert list(map(bytes, ev)) == [local_val[i % len(local_val)] for i in range(16)]
    assert sorted(set(opened)) == sorted(expected["train"][pi] + expected["validation"][pi])
  assert sum(map(len, seen)) == len(set().union(*seen)) == N_TRAIN  # disjoint, complete
  assert set().union(*seen) == set(map(bytes, read_split(sharded_dir, "train")))
  flat = np.concatenate(positions)
  assert len(np.unique(flat)) == len(flat)  # masking keys never repeat across processes


def test_by_shard_one_process_is_the_interleaved_stream(sharded_dir):
  a = take(iter(make_dataset(config(sharded_dir))), 5)
  b = take(iter(make_dataset(config(sharded_dir, shard_by_process=True))), 5)
  assert_batches_equal(a, b)


def test_by_shard_iterator_checkpoint_restores_identical_batches(sharded_dir):
  cfg = config(sharded_dir, shard_by_process=True)
  it = iter(make_dataset(cfg, process_index=1, process_count=2))
  take(it, 70)  # past the end of the first local epoch (129 records, 4 per batch)
  state = it.get_state()
  json.dumps(state)
  expected = take(it, 4)
  fresh = iter(make_dataset(cfg, process_index=1, process_count=2))
  fresh.set_state(state)
  assert_batches_equal(take(fresh, 4), expected)
  other = take(iter(make_dataset(cfg, process_index=0, process_count=2)), 4)
  assert not np.array_equal(unmask(other[0]), unmask(expected[0]))


def test_process_shards_is_the_read_plan(sharded_dir):
  """The one owner of "process i reads shards i::P" (staging.needed_shards asks it too)."""
  meta = dataset.DatasetMeta.load(str(sharded_dir))
  assert data_lib.process_shards(meta, "train", 1, 4, by_shard=False) is None  # all shards
  assert data_lib.process_shards(meta, "train", 1, 4, by_shard=True) == [1, 5]
  assert data_lib.process_shards(meta, "validation", 3, 4, by_shard=True) == [3]
  assert data_lib.process_shards(meta, "train", 0, 1, by_shard=True) == list(range(6))


def test_by_shard_needs_a_shard_per_process(dataset_dir):
  cfg = config(dataset_dir, shard_by_process=True)  # 2 shards per split
  # The message is data.process_shards', shared with lmscale stage --only-needed.
  with pytest.raises(dataset.DatasetError,
                     match=r"split 'validation' has 2 shards for 4 processes: a by-shard split "
                           r"\(data.shard_by_process=True\)"):
    make_dataset(cfg, "validation", process_index=3, process_count=4)


# --------------------------------------------------------------------------- device prefetch
def _prefetcher(dataset_dir, split="train", opened=None, **data_overrides):
  """A DevicePrefetcher as training builds it: ``reopen(k)`` is the dataset from batch ``k``
  (the ``k`` of every call is appended to ``opened``)."""
  from lmscale_jax.train import sharding

  cfg = config(dataset_dir, **data_overrides)

  def reopen(start_batch):
    if opened is not None:
      opened.append(start_batch)
    return iter(make_dataset(cfg, split, start_batch=start_batch))

  return prefetch.DevicePrefetcher(sharding.batch_sharding(sharding.data_mesh()), reopen), cfg


def test_device_prefetcher_state_matches_consumed_batches(dataset_dir):
  import jax

  opened = []
  pf, cfg = _prefetcher(dataset_dir, opened=opened)
  host = take(iter(make_dataset(cfg)), 8)
  assert opened == []  # the host iterator is built on the first next(), not before
  got = take(pf, 3)
  assert opened == [0]
  assert all(isinstance(v, jax.Array) for v in got[0].values())
  assert got[0]["input_ids"].sharding == pf.sharding
  assert_batches_equal(got, host[:3])
  # The host iterator already produced batch 4 (index 3); the saved state must not skip it.
  state = pf.get_state()
  assert state == {"next_batch": 3}
  json.dumps(state)  # Grain's Orbax handler stores it as JSON
  restored_opened = []
  restored, _ = _prefetcher(dataset_dir, opened=restored_opened)
  restored.set_state(state)
  assert restored_opened == []  # a restore does not build (spawn) a host iterator itself
  assert_batches_equal(take(restored, 5), host[3:8])
  assert restored_opened == [3]  # resumed exactly at the first batch not consumed
  assert_batches_equal(take(pf, 5), host[3:8])  # the original continues unaffected
  pf.set_state({"next_batch": 1})  # a restore in the same process: reopened at batch 1
  assert_batches_equal(take(pf, 2), host[1:3])
  assert opened == [0, 1]
  from lmscale_jax.train.checkpoint import IncompatibleCheckpoint

  with pytest.raises(IncompatibleCheckpoint, match=r"expected \{'next_batch': k\}"):
    pf.set_state({"iterator": 3})  # e.g. Grain's own per-worker state
  for x in (pf, restored):
    x.close()


def test_device_prefetcher_state_does_not_depend_on_workers(dataset_dir):
  """The state is the batch count: a run resumes with another data.workers."""
  pf, cfg = _prefetcher(dataset_dir, workers=1)
  host = take(iter(make_dataset(cfg)), 5)
  take(pf, 2)
  restored, _ = _prefetcher(dataset_dir, workers=0)
  restored.set_state(pf.get_state())
  assert_batches_equal(take(restored, 3), host[2:5])
  for x in (pf, restored):
    x.close()


def test_device_prefetcher_through_grains_orbax_handler(dataset_dir, tmp_path):
  """What checkpoint.py does: grain.checkpoint.CheckpointSave/Restore of the prefetcher."""
  import grain
  from etils import epath

  pf, cfg = _prefetcher(dataset_dir)
  host = take(iter(make_dataset(cfg)), 6)
  take(pf, 2)
  handler = grain.checkpoint.CheckpointHandler()
  handler.save(epath.Path(tmp_path), args=grain.checkpoint.CheckpointSave(pf))
  restored, _ = _prefetcher(dataset_dir)
  handler.restore(epath.Path(tmp_path), args=grain.checkpoint.CheckpointRestore(restored))
  assert_batches_equal(take(restored, 4), host[2:6])


def test_device_prefetcher_wait_and_end(dataset_dir):
  pf, cfg = _prefetcher(dataset_dir, split="validation")
  batches = list(pf)
  assert len(batches) == cfg.train.eval_batches  # finite iterators end cleanly
  with pytest.raises(StopIteration):
    next(pf)
  assert pf.wait_seconds > 0
  waited = pf.reset_wait()
  assert waited > 0 and pf.wait_seconds == 0.0


# --------------------------------------------------------------------------- errors
def _drain(cfg, split="train", batches=N_TRAIN // 8):
  it = iter(make_dataset(cfg, split))
  try:
    take(it, batches)
  finally:
    it.close()


@pytest.mark.parametrize("damage,workers", [("flip_record_bytes", 0), ("truncate", 0),
                                            ("flip_record_bytes", 1)])
def test_corrupt_shard_names_the_file(dataset_copy, damage, workers):
  """Also through a Grain worker process: the error reaches the trainer with its message."""
  meta = dataset.DatasetMeta.load(str(dataset_copy))
  shard = meta.shard_paths("train")[1]
  if damage == "truncate":  # e.g. an interrupted copy: the footer is gone
    os.truncate(shard, os.path.getsize(shard) // 3)
    expected = rf"{os.path.basename(shard)}: cannot open ArrayRecord shard"
  else:  # flip bytes inside record 20's chunk: its hash check fails
    offset = 20 * len(dataset.encode_record(np.zeros(SEQ, np.uint16)))
    with open(shard, "r+b") as f:
      f.seek(offset)
      chunk = f.read(16)
      f.seek(offset)
      f.write(bytes(b ^ 0xFF for b in chunk))
    expected = rf"{os.path.basename(shard)}: record \d+ \(split record \d+\): unreadable"
  with pytest.raises(dataset.DatasetError, match=expected):
    _drain(config(dataset_copy, workers=workers))


def test_malformed_record_names_file_and_record(dataset_copy):
  meta = dataset.DatasetMeta.load(str(dataset_copy))
  shard = meta.shard_paths("train")[0]
  n = meta.splits["train"]["shards"][0]["records"]
  recs = [dataset.encode_record(np.full(SEQ, 7, np.uint16))] * n
  recs[5] = dataset.encode_record(np.full(SEQ // 2, 7, np.uint16))  # a record of the wrong length
  os.remove(shard)
  dataset.write_array_record(shard, recs)
  with pytest.raises(dataset.DatasetError,
                     match=rf"{os.path.basename(shard)}: record 5 .*malformed"):
    _drain(config(dataset_copy))


def test_token_id_beyond_vocab_is_reported(dataset_copy):
  mpath = dataset_copy / dataset.METADATA
  raw = json.loads(mpath.read_text())
  raw["vocab_size"] = 64  # the shards hold ids up to 127
  mpath.write_text(json.dumps(raw))
  with pytest.raises(dataset.DatasetError, match=r"array_record.*record \d+.*token id \d+.*"
                                                 r">= vocab_size 64"):
    _drain(config(dataset_copy))


def test_config_and_dataset_errors(dataset_dir, dataset_copy, tmp_path):
  # The loader's rows per process come from config_checks.check_batch: the one shared rule
  # for splitting train.batch_size (processes × devices × microbatches), hence its message.
  with pytest.raises(ConfigError, match=r"train.batch_size=8 is not divisible by the 3 global "
                                        r"devices \(3 processes × 1\)"):
    make_dataset(config(dataset_dir), process_index=0, process_count=3)
  assert config_checks.check_batch(8, processes=2) == 4  # what process_count=2 loads
  with pytest.raises(dataset.DatasetError, match="does not exist"):
    make_dataset(config(tmp_path / "nope"))
  mpath = dataset_copy / dataset.METADATA
  raw = json.loads(mpath.read_text())
  raw["splits"]["validation"] = {"records": 0, "shards": []}
  mpath.write_text(json.dumps(raw))
  with pytest.raises(dataset.DatasetError, match="'validation' has zero shards"):
    make_dataset(config(dataset_copy), "validation")
