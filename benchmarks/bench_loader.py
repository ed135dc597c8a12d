"""Loader throughput: lmscale_jax's Grain pipeline vs the paper's HF collator + torch DataLoader.

Measures host-side samples/s (read + decode + MLM-mask + batch, no device transfer) at the
dataset's seq_len for several ``data.workers`` values, and runs the peer recipe
(/work/shared/bench/peer_hf_loader.py) on the same tokens, exported from the same shards, with
the same worker counts, in the same invocation.

  python benchmarks/bench_loader.py                      # synthetic seq-512 dataset, ~20k seqs
  python benchmarks/bench_loader.py --data DIR --workers 0,1,2 --seconds 10
  python benchmarks/bench_loader.py --compare-shuffle      # Feistel vs Grain's index_shuffle

``--compare-shuffle`` instead times the loader's batch function in-process (one batch of
``--batch`` rows at a time, no workers) with its shuffle (``hashing.feistel_permute``) and
with ``grain.experimental.index_shuffle`` in its place, in alternating rounds of the same run,
and the permutation alone per batch: the measurement behind keeping ``feistel_permute``.

Prints a table and appends one JSON line per measurement to
benchmarks/results/<date>-cpu-loader.jsonl (with ``--compare-shuffle``:
``<date>-cpu-shuffle.jsonl``).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import _host  # noqa: E402

import numpy as np  # noqa: E402
from lmscale_jax.cli import args as cli_args  # one line and exit 1 for a bad argument

PEER = "/work/shared/bench/peer_hf_loader.py"


def cpu_description() -> str:
  return _host.cpu_name()


def synthetic_dataset(directory: str, records: int, seq_len: int, vocab: int) -> str:
  """A real dataset directory via the production writer (store/synthetic_dataset.py); reused."""
  from lmscale_jax.store import dataset
  from lmscale_jax.store.synthetic_dataset import write_synthetic_dataset

  try:
    meta = dataset.DatasetMeta.load(directory)
    if (meta.seq_len, meta.vocab_size, meta.num_records("train")) == (seq_len, vocab, records):
      return directory
  except dataset.DatasetError:
    pass
  # ~64 MB shards like prepare.py writes, but at least 4 so reads hit several files.
  shards = max(4, records * (2 * seq_len + 30) // (64 << 20))
  write_synthetic_dataset(directory, seq_len=seq_len, vocab_size=vocab, n_train=records,
                         n_val=max(64, records // 100), shards=shards, seed=0)
  return directory


def export_tokens(path: str, out: str) -> np.ndarray:
  """The train split as an (N, seq_len) uint16 array, for the peer (same data, same order)."""
  from array_record.python import array_record_module

  from lmscale_jax.store import dataset

  meta = dataset.DatasetMeta.load(path)
  rows = []
  for p in meta.shard_paths("train"):
    r = array_record_module.ArrayRecordReader(p)
    rows += [dataset.decode_record(x, meta.seq_len) for x in r.read_all()]
    r.close()
  ids = np.stack(rows)
  np.save(out, ids)
  return ids


def config(path: str, batch: int, workers: int, read_threads: int, prefetch: int):
  """The default config (what users get) with the loader settings under test."""
  from lmscale_jax.config import defaults as config_defaults

  c = config_defaults.get_base_config()
  c.data.update(dict(path=path, workers=workers, prefetch_buffer=prefetch,
                     read_threads=read_threads))
  c.train.update(dict(batch_size=batch, eval_batches=1))
  return c


def measure_ours(cfg, meta, warmup: float, seconds: float) -> dict:
  """samples/s of the host iterator, after ``warmup`` seconds (worker start, buffers full)."""
  from lmscale_jax.input import grain_pipeline as data_lib

  it = iter(data_lib.make_dataset(cfg, meta, "train", train=True))
  t0 = time.perf_counter()
  next(it)
  first_batch_s = time.perf_counter() - t0
  while time.perf_counter() - t0 < warmup:
    next(it)
  n, cpu0, t1 = 0, time.process_time(), time.perf_counter()
  while time.perf_counter() - t1 < seconds:
    n += next(it)["input_ids"].shape[0]
  dt = time.perf_counter() - t1
  main_cpu = (time.process_time() - cpu0) / dt
  it.close()
  return {"samples_s": n / dt, "seconds": dt, "first_batch_s": first_batch_s,
          "main_process_cpu_frac": main_cpu}


def index_shuffle_loader(loader):
  """A copy of ``loader`` (a ``data.BatchLoader``) whose per-epoch permutation is
  ``grain.experimental.index_shuffle``, as Grain's own ``shuffle`` calls it: one index per
  call, seed ``(seed + epoch) mod 2**32``, 4 rounds."""
  from grain.experimental import index_shuffle

  class IndexShuffleLoader(type(loader)):
    def record_indices(self, positions):
      if self.local_stream:
        positions = positions // self.process_count
      n = len(self.records)
      epoch, in_epoch = np.divmod(positions, n)
      seeds = ((self.shuffle_seed + epoch) % (1 << 32)).tolist()
      return np.array([index_shuffle(index, n - 1, seed, 4)
                       for index, seed in zip(in_epoch.tolist(), seeds)], np.int64)

  alternative = copy.copy(loader)
  alternative.__class__ = IndexShuffleLoader
  return alternative


def compare_shuffle(cfg, meta, rounds: int, seconds: float) -> dict:
  """samples/s of the batch function with each permutation, in alternating rounds (so load
  changes on a shared machine hit both), and the permutation alone in us per batch."""
  from lmscale_jax.input import grain_pipeline as data_lib

  loaders = {"feistel_permute": data_lib.make_batch_loader(cfg, meta, "train", train=True)}
  loaders["index_shuffle"] = index_shuffle_loader(loaders["feistel_permute"])
  batch = loaders["feistel_permute"].local_batch
  for loader in loaders.values():  # opens every shard, warms the page cache
    for batch_index in range(20):
      loader(batch_index)
  rates = {name: [] for name in loaders}
  next_batch = 1000  # every round reads batches not read before
  for _ in range(rounds):
    for name, loader in loaders.items():
      built, start = 0, time.perf_counter()
      while time.perf_counter() - start < seconds:
        loader(next_batch)
        next_batch, built = next_batch + 1, built + 1
      rates[name].append(built * batch / (time.perf_counter() - start))
  permute_us = {}
  for name, loader in loaders.items():
    positions = [loader.positions(b) for b in range(1000, 1200)]
    start = time.perf_counter()
    for p in positions:
      loader.record_indices(p)
    permute_us[name] = (time.perf_counter() - start) / len(positions) * 1e6
  return {name: {"samples_s_median": float(np.median(rates[name])),
                 "samples_s_rounds": [round(r) for r in rates[name]],
                 "permute_us_per_batch": permute_us[name]} for name in loaders}


def measure_peer(python: str, ids_path: str, batch: int, workers: int, seconds: float,
                 meta) -> dict:
  cmd = [python, PEER, "--ids", ids_path, "--batch", str(batch), "--workers", str(workers),
         "--seconds", str(seconds), "--vocab", str(meta.vocab_size),
         "--pad-id", str(meta.special_ids["[PAD]"]), "--mask-id", str(meta.special_ids["[MASK]"])]
  r = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds * 10 + 300)
  if r.returncode:
    raise RuntimeError(f"peer failed ({r.returncode}): {r.stderr[-2000:]}")
  return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
  ap = cli_args.Parser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--data", help="dataset directory (default: a synthetic seq-512 dataset)")
  ap.add_argument("--synthetic-dir", default=os.path.join(tempfile.gettempdir(),
                                                          "lmscale_bench_seq512"))
  ap.add_argument("--records", type=int, default=20_000, help="synthetic train records")
  ap.add_argument("--seq-len", type=int, default=512, help="synthetic seq_len")
  ap.add_argument("--vocab", type=int, default=22016, help="synthetic vocab size")
  ap.add_argument("--batch", type=int, default=184)
  ap.add_argument("--workers", default="0,1,2", help="comma-separated data.workers values")
  ap.add_argument("--seconds", type=float, default=10.0, help="measured time per config")
  ap.add_argument("--warmup", type=float, default=3.0, help="seconds before measuring")
  ap.add_argument("--read-threads", type=int, default=2, help="data.read_threads")
  ap.add_argument("--prefetch", type=int, default=4, help="data.prefetch_buffer (batches)")
  ap.add_argument("--peer-python", default="/tmp/peervenv/bin/python")
  ap.add_argument("--no-peer", action="store_true")
  ap.add_argument("--compare-shuffle", action="store_true",
                  help="time feistel_permute vs grain's index_shuffle in the loader instead")
  ap.add_argument("--rounds", type=int, default=6, help="--compare-shuffle: rounds of each")
  ap.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "results"))
  a = ap.parse_args(argv)

  from absl import flags  # Grain workers read absl flags; nothing here parses them
  flags.FLAGS.mark_as_parsed()
  from lmscale_jax.store import dataset

  path = a.data or synthetic_dataset(a.synthetic_dir, a.records, a.seq_len, a.vocab)
  meta = dataset.DatasetMeta.load(path)
  workers = [int(w) for w in a.workers.split(",")]
  if a.compare_shuffle:
    cfg = config(path, a.batch, 0, a.read_threads, a.prefetch)
    result = compare_shuffle(cfg, meta, a.rounds, a.seconds)
    print(f"{cpu_description()}; seq_len {meta.seq_len}, batch {a.batch}, {a.rounds} rounds "
          f"of {a.seconds:g} s each, in-process batch function")
    for name, r in result.items():
      print(f"  {name:16s} {r['samples_s_median']:9.0f} samples/s (median; rounds "
            f"{r['samples_s_rounds']}), permutation {r['permute_us_per_batch']:.0f} us/batch")
    date = datetime.date.today().isoformat()
    os.makedirs(a.results, exist_ok=True)
    out = os.path.join(a.results, f"{date}-cpu-shuffle.jsonl")
    with open(out, "a") as f:
      for name, r in result.items():
        f.write(json.dumps({"date": date, "device": cpu_description(), "system": name,
                            "seq_len": meta.seq_len, "batch": a.batch, "rounds": a.rounds,
                            "seconds": a.seconds, "loadavg_1m": os.getloadavg()[0],
                            "ratio_vs_feistel": r["samples_s_median"]
                            / result["feistel_permute"]["samples_s_median"], **r},
                           sort_keys=True) + "\n")
    print(f"results appended to {out}")
    return 0

  peer_python = None if a.no_peer else a.peer_python
  if peer_python and not (os.path.exists(peer_python) and subprocess.run(
      [peer_python, "-c", "import torch, transformers"], capture_output=True).returncode == 0):
    print(f"peer skipped: {peer_python} missing or lacks torch/transformers "
          "(python3 -m venv /tmp/peervenv && /tmp/peervenv/bin/pip install torch==2.13.0 "
          "transformers numpy tokenizers)")
    peer_python = None
  if peer_python and not os.path.exists(PEER):
    print(f"peer skipped: {PEER} not found")
    peer_python = None

  tmp = tempfile.mkdtemp(prefix="bench_loader_")
  ids_path = os.path.join(tmp, "tokens.npy")
  if peer_python:
    export_tokens(path, ids_path)

  date = datetime.date.today().isoformat()
  device = cpu_description()
  common = {"date": date, "device": device, "dataset": path, "seq_len": meta.seq_len,
            "records": meta.num_records("train"), "batch": a.batch, "seconds": a.seconds}
  rows = []
  for w in workers:
    cfg = config(path, a.batch, w, a.read_threads, a.prefetch)
    ours = measure_ours(cfg, meta, a.warmup, a.seconds)
    rows.append({**common, "system": "lmscale_jax grain", "workers": w,
                 "read_threads": a.read_threads, "prefetch_buffer": a.prefetch,
                 "loadavg_1m": os.getloadavg()[0], **ours})
    print(f"  ours workers={w}: {ours['samples_s']:.0f} samples/s", flush=True)
    if peer_python:
      peer = measure_peer(peer_python, ids_path, a.batch, w, a.seconds, meta)
      rows.append({**common, "system": "peer hf collator + torch DataLoader", "workers": w,
                   "loadavg_1m": os.getloadavg()[0], "samples_s": peer["samples_s"],
                   "peer": peer})
      print(f"  peer workers={w}: {peer['samples_s']:.0f} samples/s", flush=True)

  peer_by_w = {r["workers"]: r["samples_s"] for r in rows if r["system"].startswith("peer")}
  for r in rows:
    r["samples_s_per_worker"] = r["samples_s"] / max(1, r["workers"])
    if not r["system"].startswith("peer") and r["workers"] in peer_by_w:
      r["ratio_vs_peer"] = r["samples_s"] / peer_by_w[r["workers"]]

  print(f"\n{device}; seq_len {meta.seq_len}, batch {a.batch}, {a.seconds:g} s per row "
        f"(samples/s per worker: workers=0 counts the main process as one)")
  print(f"{'system':38s} {'workers':>7s} {'samples/s':>10s} {'per worker':>10s} "
        f"{'vs peer':>8s}")
  for r in rows:
    ratio = f"{r['ratio_vs_peer']:.2f}x" if "ratio_vs_peer" in r else "-"
    print(f"{r['system']:38s} {r['workers']:7d} {r['samples_s']:10.0f} "
          f"{r['samples_s_per_worker']:10.0f} {ratio:>8s}")

  os.makedirs(a.results, exist_ok=True)
  out = os.path.join(a.results, f"{date}-cpu-loader.jsonl")
  with open(out, "a") as f:
    for r in rows:
      f.write(json.dumps(r, sort_keys=True) + "\n")
  print(f"\nappended {len(rows)} rows to {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
