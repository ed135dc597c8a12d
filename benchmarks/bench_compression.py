"""Shard compression (``--compression zstd|snappy|none``): bytes on disk against the speed of
writing (preparation) and of reading (the loader's reader), same inputs, same tokenizer, one run.

  python benchmarks/bench_compression.py [--input PATH…] [--max-input-bytes N] [--seq-len 512]
                                         [--workers 2] [--repeat 2] [--reads 20000]

For each codec: ``prepare_binary`` (the whole pipeline, ``--workers`` processes; the tokenizer
trained once by the zstd run and given to all), its shard bytes and its pass-3 ``write`` stage
(records into shards: where the codec runs at preparation), then random reads of ``--reads``
training records in batches of 256 through ``store.records.ShardRecords`` (read + decode, what a
loader worker does per batch) from the page cache, so the read rate is the codec's CPU cost,
not a disk's. Each timing is the fastest of ``--repeat``. Prints a table with ratios to zstd
(the default); appends JSON lines to ``benchmarks/results/<date>-cpu-compression.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _host  # noqa: E402
from lmscale_jax.prep import prepare  # noqa: E402
from lmscale_jax.prep.elf import elf_corpus  # noqa: E402
from lmscale_jax.store import dataset, records  # noqa: E402
from lmscale_jax.cli import args as cli_args  # one line and exit 1 for a bad argument

CODECS = tuple(dataset.COMPRESSIONS)  # zstd first: the reference row
BATCH = 256


def prepare_with(files, out, codec, a, tokenizer=""):
  t0 = time.perf_counter()
  stats = prepare.prepare(prepare.PrepareOptions(
      kind="binary", inputs=files, output=out, seq_len=a.seq_len, workers=a.workers,
      compression=codec, tokenizer=tokenizer, progress=False, overwrite=True))
  return time.perf_counter() - t0, stats


def read_rate(directory: str, reads: int) -> tuple[float, int]:
  """(seconds, records) for random reads of up to ``reads`` train records, batch by batch."""
  meta = dataset.DatasetMeta.load(directory)
  reader = records.ShardRecords(meta, "train")
  n = min(reads, len(reader))
  order = np.random.default_rng(0).permutation(len(reader))[:n].astype(np.int64)
  t0 = time.perf_counter()
  for first in range(0, n, BATCH):
    idx = order[first:first + BATCH]
    reader.decode(reader.read(idx, []), idx, meta.vocab_size, [])
  return time.perf_counter() - t0, n


def measure(files, codec, a, root, tokenizer) -> dict:
  out = os.path.join(root, codec)
  runs = [prepare_with(files, out, codec, a, tokenizer) for _ in range(a.repeat)]
  seconds, stats = min(runs, key=lambda r: r[0])
  read_s, n = min(read_rate(out, a.reads) for _ in range(a.repeat))
  shard_bytes = stats["output_bytes"]
  seqs = sum(stats["sequences"].values())
  return {"compression": codec, "shard_bytes": shard_bytes, "bytes_per_record": shard_bytes / seqs,
          "prepare_s": seconds, "write_stage_s": stats["stage_seconds"].get("write"),
          "read_records": n, "read_s": read_s, "read_records_per_s": n / read_s,
          "read_mb_s": n * a.seq_len * 2 / 1e6 / read_s, "sequences": seqs,
          "code_mb": stats["code_bytes"] / 1e6}


def main() -> int:
  p = cli_args.Parser(description=__doc__.splitlines()[0])
  p.add_argument("--input", nargs="+", default=["/usr/lib/x86_64-linux-gnu"])
  p.add_argument("--max-input-bytes", type=int, default=60_000_000)
  p.add_argument("--seq-len", type=int, default=512)
  p.add_argument("--workers", type=int, default=2)
  p.add_argument("--repeat", type=int, default=2, help="runs per codec; the fastest counts")
  p.add_argument("--reads", type=int, default=20_000, help="random train records read")
  p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  a = p.parse_args()
  files = [c.path for c in elf_corpus.list_inputs(a.input, a.max_input_bytes)]
  if not files:
    p.error(f"no ELF files under {' '.join(a.input)}")
  root = tempfile.mkdtemp(prefix="bench_compression_")
  try:
    # The tokenizer is trained once (by a first zstd run) and given to every measured run.
    prepare_with(files, os.path.join(root, "tokenizer_run"), "zstd", a)
    tokenizer = os.path.join(root, "tokenizer.json")
    shutil.copy(os.path.join(root, "tokenizer_run", dataset.TOKENIZER), tokenizer)
    rows = [measure(files, codec, a, root, tokenizer) for codec in CODECS]
  finally:
    shutil.rmtree(root, ignore_errors=True)
  ref, date, device = rows[0], datetime.date.today().isoformat(), _host.cpu_name()
  print(f"\n{len(files)} ELF files ({ref['code_mb']:.1f} MB of code), seq {a.seq_len}, "
        f"{a.workers} workers, {device}")
  print(f"{'compression':<12} {'shard MB':>9} {'B/record':>9} {'size':>6} {'prepare s':>10} "
        f"{'vs zstd':>8} {'write s':>8} {'reads/s':>9} {'vs zstd':>8}")
  os.makedirs(a.out, exist_ok=True)
  with open(os.path.join(a.out, f"{date}-cpu-compression.jsonl"), "a") as f:
    for r in rows:
      r.update(size_vs_zstd=r["shard_bytes"] / ref["shard_bytes"],
               prepare_vs_zstd=r["prepare_s"] / ref["prepare_s"],
               read_vs_zstd=r["read_records_per_s"] / ref["read_records_per_s"],
               seq_len=a.seq_len, workers=a.workers, repeat=a.repeat, files=len(files),
               date=date, device=device, load_average=os.getloadavg()[0])
      print(f"{r['compression']:<12} {r['shard_bytes'] / 1e6:>9.1f} "
            f"{r['bytes_per_record']:>9.0f} {r['size_vs_zstd']:>5.2f}× {r['prepare_s']:>10.1f} "
            f"{r['prepare_vs_zstd']:>7.2f}× {r['write_stage_s'] or 0:>8.2f} "
            f"{r['read_records_per_s']:>9.0f} {r['read_vs_zstd']:>7.2f}×")
      f.write(json.dumps(r) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
