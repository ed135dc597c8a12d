"""Staging throughput: ``lmscale_jax.input.staging.stage`` vs ``cp -r`` of the same dataset, same
run.

  python benchmarks/bench_stage.py                       # ~1 GB synthetic dataset, 3 rounds
  python benchmarks/bench_stage.py --src DATASET --dest-root /local/ssd --workers 1,8

Each round, in alternating order: ``cp -r SRC D1 && sync``; the same followed by
``sha256sum`` of the copies (what the same guarantee costs with coreutils); ``stage(SRC, D2)``
(parallel copies + sha256 of every byte + fsync of every file + rename); and two reruns of
``stage`` on the complete D2, which copy nothing: the default (files unchanged since they were
verified are not re-hashed) and ``--verify-all`` (every file re-hashed). Before every
copy the source's cached pages are dropped (``posix_fadvise(DONTNEED)``, no root needed), so
both read it from disk; the timings include getting the data onto the disk (``sync`` for cp,
``fsync`` for stage). Prints a table and one JSON line per measurement (``--out`` appends them
to a file).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import _host  # noqa: E402
from lmscale_jax.cli import args as cli_args  # one line and exit 1 for a bad argument


def synthetic_dataset(directory: str, size_mb: int) -> str:
  """~size_mb MB of seq-4096 records in ~64 MB shards (store/synthetic_dataset.py); reused."""
  from lmscale_jax.store import dataset
  from lmscale_jax.store.synthetic_dataset import write_synthetic_dataset

  seq_len = 4096
  records = size_mb * 1_000_000 // (2 * seq_len + 30)
  try:
    if dataset.DatasetMeta.load(directory).num_records("train") == records:
      return directory
  except dataset.DatasetError:
    pass
  shutil.rmtree(directory, ignore_errors=True)
  write_synthetic_dataset(directory, seq_len=seq_len, vocab_size=8192, n_train=records,
                         n_val=max(64, records // 100), shards=max(2, size_mb // 64), seed=0)
  return directory


def drop_cache(directory: str) -> None:
  """Evicts the directory's clean pages from the page cache (so the next read hits disk)."""
  for name in os.listdir(directory):
    path = os.path.join(directory, name)
    if os.path.isfile(path):
      fd = os.open(path, os.O_RDONLY)
      try:  # only clean pages are dropped: the files were fsynced (stage) or synced (cp)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      finally:
        os.close(fd)


def dir_bytes(directory: str) -> int:
  return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))


def time_cp(src: str, dest: str) -> float:
  shutil.rmtree(dest, ignore_errors=True)
  drop_cache(src)
  t0 = time.perf_counter()
  subprocess.run(["cp", "-r", src, dest], check=True)
  subprocess.run(["sync"], check=True)
  return time.perf_counter() - t0


def time_cp_sha(src: str, dest: str) -> float:
  """cp -r, sync, then sha256sum of the copies: what a verified copy costs with coreutils."""
  t = time_cp(src, dest)
  drop_cache(dest)
  t0 = time.perf_counter()
  files = sorted(os.path.join(dest, f) for f in os.listdir(dest))
  subprocess.run(["sha256sum", *files], check=True, stdout=subprocess.DEVNULL)
  return t + time.perf_counter() - t0


def time_stage(src: str, dest: str, workers: int) -> float:
  from lmscale_jax.input import staging

  shutil.rmtree(dest, ignore_errors=True)
  drop_cache(src)
  t0 = time.perf_counter()
  staging.stage(src, dest, workers=workers, progress=False, log=lambda m: None)
  return time.perf_counter() - t0


def time_verify(src: str, dest: str, workers: int, verify_all: bool) -> float:
  from lmscale_jax.input import staging

  drop_cache(dest)
  t0 = time.perf_counter()
  out = staging.stage(src, dest, workers=workers, progress=False, log=lambda m: None,
                      verify_all=verify_all)
  assert out["copied"] == 0, out
  return time.perf_counter() - t0


def main(argv=None) -> int:
  p = cli_args.Parser(description=__doc__.splitlines()[0])
  p.add_argument("--src", default="", help="dataset to stage (default: a synthetic one)")
  p.add_argument("--size-mb", type=int, default=1024, help="size of the synthetic dataset")
  p.add_argument("--dest-root", default="/tmp/lmscale-bench-stage",
                 help="where the copies go (and the synthetic dataset)")
  p.add_argument("--workers", default="1,8", help="comma-separated stage() worker counts")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--out", default="", help="append JSON lines here")
  a = p.parse_args(argv)
  os.makedirs(a.dest_root, exist_ok=True)
  src = a.src or synthetic_dataset(os.path.join(a.dest_root, "src"), a.size_mb)
  nbytes = dir_bytes(src)
  workers = [int(w) for w in a.workers.split(",")]
  cp_dest, st_dest = os.path.join(a.dest_root, "cp"), os.path.join(a.dest_root, "staged")
  results = {"cp -r + sync": [], "cp -r + sync + sha256sum": []}
  for w in workers:
    results[f"stage workers={w}"] = []
    results[f"rerun workers={w}"] = []
    results[f"rerun --verify-all w={w}"] = []
  for r in range(a.rounds):
    jobs = [("cp -r + sync", lambda: time_cp(src, cp_dest)),
            ("cp -r + sync + sha256sum", lambda: time_cp_sha(src, cp_dest))]
    for w in workers:
      jobs.append((f"stage workers={w}", lambda w=w: time_stage(src, st_dest, w)))
      jobs.append((f"rerun workers={w}", lambda w=w: time_verify(src, st_dest, w, False)))
      jobs.append((f"rerun --verify-all w={w}",
                   lambda w=w: time_verify(src, st_dest, w, True)))
    if r % 2:  # alternate which goes first
      jobs = jobs[1:] + jobs[:1]
    for name, fn in jobs:
      results[name].append(fn())
  shutil.rmtree(cp_dest, ignore_errors=True)
  shutil.rmtree(st_dest, ignore_errors=True)

  cp_median = statistics.median(results["cp -r + sync"])
  stamp = datetime.datetime.now().isoformat(timespec="seconds")
  cpu = os.cpu_count()
  device = _host.host_description(a.dest_root)
  print(f"dataset {src}: {nbytes / 1e6:,.0f} MB in {len(os.listdir(src))} files; "
        f"{a.rounds} rounds; {device}; median seconds")
  print(f"{'method':<28}{'s':>8}{'MB/s':>9}{'vs cp -r':>10}")
  lines = []
  for name, times in results.items():
    med = statistics.median(times)
    rate = nbytes / med / 1e6
    print(f"{name:<28}{med:>8.2f}{rate:>9.0f}{cp_median / med:>9.2f}x")
    lines.append({"date": stamp[:10], "device": device, "time": stamp, "bench": "stage",
                  "dataset": src, "method": name, "bytes": nbytes,
                  "files": len(os.listdir(src)), "seconds": times, "median_s": med,
                  "mb_per_s": rate, "speed_vs_cp": cp_median / med, "cores": cpu,
                  "loadavg_1m": os.getloadavg()[0]})  # other load on the machine, at the end
  for line in lines:
    print(json.dumps(line))
  if a.out:
    with open(a.out, "a") as f:
      f.writelines(json.dumps(x) + "\n" for x in lines)
  return 0


if __name__ == "__main__":
  sys.exit(main())
