"""Peak memory of prepare_binary at fractions of the machine's ELF corpus: what grows with input.

  python benchmarks/bench_prep_memory.py [--input PATH…] [--fractions 0.25 0.5 1] [--workers N]

Runs ``tools/prepare_binary.py`` (a real subprocess, its own pool) on the first 1/4, 1/2 and all
of the ELF bytes under ``--input`` (default: docs/data-preparation.md's corpus,
/usr/lib/x86_64-linux-gnu and /usr/bin) and samples the resident memory of its process tree
every 0.1 s from /proc: the peak of the sum over the tree, of the parent (which holds the
duplicate set and the shard buffers) and of the largest worker (bounded memos, one chunk's
sequences). The duplicate set is the one structure that grows with the corpus by design: its
bytes per kept function are measured here (tracemalloc over a set of 16-byte digests) and
written beside the peaks. Appends JSON lines to
``benchmarks/results/<date>-cpu-prep-memory.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import _host  # noqa: E402

from lmscale_jax.prep.elf import elf_corpus  # noqa: E402
from lmscale_jax.store import dataset
from lmscale_jax.cli import args as cli_args  # one line and exit 1 for a bad argument


def _rss(pid: int) -> int:
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        if line.startswith("VmRSS:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return 0


def _children(pid: int) -> list[int]:
  out = []
  try:
    for tid in os.listdir(f"/proc/{pid}/task"):
      with open(f"/proc/{pid}/task/{tid}/children") as f:
        out += [int(c) for c in f.read().split()]
  except OSError:
    pass
  return out


class TreeSampler(threading.Thread):
  """Peak RSS of a process and its descendants, sampled (/proc has no peak of a sum)."""

  def __init__(self, pid: int, every: float = 0.1):
    super().__init__(daemon=True)
    self.pid, self.every = pid, every
    self.peak_total = self.peak_parent = self.peak_worker = 0
    self.done = threading.Event()

  def run(self) -> None:
    while not self.done.is_set():
      parent, stack, workers = _rss(self.pid), _children(self.pid), []
      while stack:
        p = stack.pop()
        workers.append(_rss(p))
        stack += _children(p)
      self.peak_parent = max(self.peak_parent, parent)
      self.peak_worker = max([self.peak_worker, *workers])
      self.peak_total = max(self.peak_total, parent + sum(workers))
      time.sleep(self.every)


def dedup_bytes_per_function(n: int = 200_000) -> float:
  """Measured bytes per entry of the duplicate set (corpus_extract.extract's ``seen``)."""
  import hashlib
  import tracemalloc

  tracemalloc.start()
  seen = {hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest() for i in range(n)}
  size = tracemalloc.get_traced_memory()[0]
  tracemalloc.stop()
  del seen
  return size / n


def run_once(inputs: list[str], max_bytes: int, workers: int) -> dict:
  out = tempfile.mkdtemp(prefix="bench_prep_memory_")
  cmd = [sys.executable, os.path.join(ROOT, "tools", "prepare_binary.py"), "--input", *inputs,
         "--output", out, "--overwrite", "--no-progress", "--workers", str(workers),
         "--max-input-bytes", str(max_bytes)]
  t0 = time.perf_counter()
  proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  sampler = TreeSampler(proc.pid)
  sampler.start()
  _, err = proc.communicate()
  sampler.done.set()
  sampler.join()
  seconds = time.perf_counter() - t0
  try:
    if proc.returncode:
      raise SystemExit(f"error: {' '.join(cmd)} failed: {err.strip().splitlines()[-1:]}")
    with open(os.path.join(out, dataset.STATS)) as f:
      st = json.load(f)
  finally:
    subprocess.run(["rm", "-rf", out], check=False)
  return {"seconds": seconds, "peak_rss_total_mb": sampler.peak_total / 2**20,
          "peak_rss_parent_mb": sampler.peak_parent / 2**20,
          "peak_rss_largest_worker_mb": sampler.peak_worker / 2**20,
          "input_bytes": st["input_bytes"], "code_bytes": st["code_bytes"],
          "functions_seen": st["functions_seen"], "functions_kept": st["functions_kept"],
          "tokens": st["tokens"], "stage_seconds": st["stage_seconds"]}


def main() -> int:
  p = cli_args.Parser(description=__doc__.splitlines()[0])
  p.add_argument("--input", nargs="+", default=["/usr/lib/x86_64-linux-gnu", "/usr/bin"])
  p.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 1.0])
  p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
  p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  a = p.parse_args()
  if a.workers < 1 or not all(0 < f <= 1 for f in a.fractions):
    p.error("--workers must be ≥ 1 and each --fractions in (0, 1]")
  for path in a.input:
    if not os.path.exists(path):
      p.error(f"--input {path!r} does not exist")
  total = sum(c.size for c in elf_corpus.list_inputs(a.input))
  per_function = dedup_bytes_per_function()
  device, date = _host.cpu_name(), datetime.date.today().isoformat()
  os.makedirs(a.out, exist_ok=True)
  print(f"ELF corpus under {' '.join(a.input)}: {total / 1e9:.2f} GB; {device}; "
        f"duplicate set {per_function:.0f} bytes per kept function")
  print(f"{'fraction':>8} {'input GB':>9} {'code MB':>8} {'kept fns':>9} {'s':>7} "
        f"{'peak tree MB':>12} {'parent MB':>10} {'worker MB':>10} {'dedup set MB':>12}")
  with open(os.path.join(a.out, f"{date}-cpu-prep-memory.jsonl"), "a") as f:
    for frac in a.fractions:
      r = run_once(a.input, int(total * frac), a.workers)
      r.update(fraction=frac, corpus_bytes=total, workers=a.workers, date=date, device=device,
               dedup_bytes_per_function=per_function,
               dedup_set_mb=r["functions_kept"] * per_function / 2**20,
               load_average=os.getloadavg()[0])
      print(f"{frac:>8.2f} {r['input_bytes'] / 1e9:>9.2f} {r['code_bytes'] / 1e6:>8.1f} "
            f"{r['functions_kept']:>9} {r['seconds']:>7.1f} {r['peak_rss_total_mb']:>12.0f} "
            f"{r['peak_rss_parent_mb']:>10.0f} {r['peak_rss_largest_worker_mb']:>10.0f} "
            f"{r['dedup_set_mb']:>12.1f}")
      f.write(json.dumps(r) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
