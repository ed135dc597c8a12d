"""Data-preparation throughput: MB of machine code per second per core, against capstone alone.

  python benchmarks/bench_prep.py [--input PATH…] [--max-input-bytes N] [--workers 1 2]

On the same ELF files, in one run: (1) capstone's ``disasm_lite`` over every function's bytes and
nothing else (the floor any disassembly-based pipeline pays), (2) our extraction (symbols +
disassembly + normalised pretokens), (3) the whole ``prepare_binary`` pipeline for each worker
count. Prints a table of MB/s/core and the ratio to capstone alone; appends JSON lines to
``benchmarks/results/<date>-cpu-prep.jsonl``.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _host  # noqa: E402

from lmscale_jax import elf_corpus, prepare  # noqa: E402


def cpu_name() -> str:
  return _host.cpu_name()


def capstone_only(files: list[str]) -> tuple[float, int]:
  """Seconds and code bytes for disasm_lite over every function of ``files`` (one core)."""
  import capstone
  import mmap

  from elftools.elf.elffile import ELFFile

  md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
  total, seconds = 0, 0.0
  for path in files:
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
      try:
        elf = ELFFile(fh)
        if elf["e_machine"] != "EM_X86_64":
          continue
        shdrs = elf_corpus.section_headers(elf, data)
        secs = list(zip(shdrs["addr"].tolist(), shdrs["offset"].tolist(), shdrs["size"].tolist()))
        funcs = elf_corpus.function_symbols(shdrs, data)
      except Exception:  # skipped the same way by the pipeline
        continue
      blobs = []
      for addr, (size, shndx) in sorted(funcs.items()):
        if shndx < len(secs):
          a, off, sz = secs[shndx]
          if a <= addr < a + sz:
            blobs.append((data[off + addr - a:off + addr - a + min(size, a + sz - addr)], addr))
    t0 = time.perf_counter()
    for code, addr in blobs:
      for insn in md.disasm_lite(code, addr):
        total += insn[1]
    seconds += time.perf_counter() - t0
  return seconds, total


def extraction_only(files: list[str]) -> tuple[float, int]:
  t0 = time.perf_counter()
  total = 0
  for path in files:
    res = elf_corpus.FileResult(path=path, file_bytes=0)
    for _ in elf_corpus.iter_functions(path, res):
      pass
    total += res.code_bytes
  return time.perf_counter() - t0, total


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--input", nargs="+", default=["/usr/lib/x86_64-linux-gnu", "/usr/bin"])
  p.add_argument("--max-input-bytes", type=int, default=150_000_000)
  p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
  p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  a = p.parse_args()
  files = [c.path for c in elf_corpus.list_inputs(a.input, a.max_input_bytes)]
  device = cpu_name()
  rows = []
  t, n = capstone_only(files)
  rows.append({"system": "capstone disasm_lite alone", "workers": 1, "code_mb": n / 1e6,
               "seconds": t, "mb_s_core": n / 1e6 / t})
  t, n = extraction_only(files)
  rows.append({"system": "lmscale extraction (symbols+disasm+pretokens)", "workers": 1,
               "code_mb": n / 1e6, "seconds": t, "mb_s_core": n / 1e6 / t})
  for w in a.workers:
    out = tempfile.mkdtemp(prefix="bench_prep_")
    try:
      t0 = time.perf_counter()
      st = prepare.prepare(prepare.Options(kind="binary", inputs=files, output=out, workers=w,
                                           progress=False, overwrite=True))
      t = time.perf_counter() - t0
    finally:
      shutil.rmtree(out, ignore_errors=True)
    rows.append({"system": "lmscale prepare_binary end-to-end", "workers": w,
                 "code_mb": st["code_bytes"] / 1e6, "seconds": t,
                 "mb_s_core": st["code_bytes"] / 1e6 / t / w})
  base = rows[0]["mb_s_core"]
  date = datetime.date.today().isoformat()
  print(f"\n{len(files)} ELF files, {device}")
  print(f"{'system':<48} {'workers':>7} {'code MB':>8} {'s':>7} {'MB/s/core':>10} {'vs capstone':>12}")
  os.makedirs(a.out, exist_ok=True)
  with open(os.path.join(a.out, f"{date}-cpu-prep.jsonl"), "a") as f:
    for r in rows:
      r.update(ratio_vs_capstone=r["mb_s_core"] / base, date=date, device=device,
               files=len(files))
      print(f"{r['system']:<48} {r['workers']:>7} {r['code_mb']:>8.1f} {r['seconds']:>7.1f} "
            f"{r['mb_s_core']:>10.3f} {r['ratio_vs_capstone']:>11.2f}×")
      f.write(json.dumps(r) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
