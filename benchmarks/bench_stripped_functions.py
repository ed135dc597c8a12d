"""Functions of stripped binaries from .eh_frame: how many of the symbol table's are found.

  python benchmarks/bench_stripped_functions.py [--real FILE…] [--no-compile] [--corpus DIR…]
                                               [--corpus-bytes N]

For each unstripped ELF file (real ones from this machine with a .symtab, and C/C++ sources
compiled here with gcc and clang at -O0..-O3), a ``strip``ped copy is read with
``elf_corpus.function_table(..., "auto")`` (for a stripped file: .dynsym's functions plus one per
.eh_frame FDE) and compared with the truth, the sized STT_FUNC symbols of the unstripped file's
.symtab in executable sections: the share found with the same start and size (``exact``), with
the same start only (``start_only``), not at all (``missed``: named examples, and how many are
``.cold`` parts or targets of a direct call), and the ranges found that start at no symbol
(``extra``). Also: the parser's speed against pyelftools' ``EH_CFI_entries()`` and the symbol
path, and (``--corpus``) what ``prepare binary`` reads from distribution libraries with
``--functions symbols`` against the default: functions and pretokens.

Writes benchmarks/results/<date>-cpu-stripped-functions.json (one row per run appended).
"""

from __future__ import annotations

import argparse
import datetime
import mmap
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _host  # noqa: E402

from lmscale_jax.prep.elf import eh_frame, elf_corpus  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
PY_SITE = os.path.join(os.path.dirname(HERE), ".venv/lib/python3.11/site-packages")
# Sources on this machine that build alone (a program, or a Python extension with -shared).
PROGRAMS = [("zlib-enough", "/usr/share/doc/zlib1g-dev/examples/enough.c", []),
            ("zlib-gun", "/usr/share/doc/zlib1g-dev/examples/gun.c", ["-lz"]),
            ("zlib-gznorm", "/usr/share/doc/zlib1g-dev/examples/gznorm.c", ["-lz"]),
            ("libpng-pngtest", "/usr/share/doc/libpng-dev/examples/pngtest.c", ["-lpng", "-lz"])]
EXTENSIONS = [("lmscale-token-ids", "lmscale_jax/prep/_token_ids.c"),
              ("lmscale-pretokens", "lmscale_jax/prep/elf/_pretokens.c"),
              ("wrapt-wrappers", f"{PY_SITE}/wrapt/_wrappers.c"),
              ("fonttools-feaLib-lexer", f"{PY_SITE}/fontTools/feaLib/lexer.c")]
# A C++ program of our own: exceptions (landing pads in .cold parts at -O2), templates, virtuals.
CXX = r"""
#include <map>
#include <stdexcept>
#include <string>
#include <vector>
#include <cstdio>
struct Shape { virtual ~Shape() {} virtual double area() const = 0; };
struct Sq : Shape { double s; explicit Sq(double s) : s(s) {} double area() const override { return s * s; } };
struct Ci : Shape { double r; explicit Ci(double r) : r(r) {} double area() const override { return 3.14159 * r * r; } };
template <class T> T parse(const std::string &s) {
  if (s.empty()) throw std::invalid_argument("empty");
  return static_cast<T>(std::stod(s));
}
static std::map<std::string, int> count(const std::vector<std::string> &w) {
  std::map<std::string, int> m; for (auto &x : w) ++m[x]; return m;
}
int main(int argc, char **argv) {
  std::vector<Shape *> v; std::vector<std::string> w;
  for (int i = 1; i < argc; ++i) {
    w.push_back(argv[i]);
    try { double d = parse<double>(argv[i]); v.push_back(i % 2 ? (Shape *)new Sq(d) : new Ci(d)); }
    catch (const std::exception &e) { std::fprintf(stderr, "%s: %s\n", argv[i], e.what()); }
  }
  double t = 0; for (auto *s : v) { t += s->area(); delete s; }
  for (auto &kv : count(w)) std::printf("%s %d\n", kv.first.c_str(), kv.second);
  std::printf("%g %d\n", t, (int)parse<int>("3"));
  return 0;
}
"""
# Unstripped real files of this machine (a .symtab): C, C++ with hand-written asm, Rust, Java's.
REAL = ["/root/.pyenv/versions/3.11.7/bin/python3.11",
        "/root/.pyenv/versions/3.11.7/lib/python3.11/lib-dynload/_decimal.cpython-311-x86_64-linux-gnu.so",
        "/root/.pyenv/versions/3.11.7/lib/python3.11/lib-dynload/_ssl.cpython-311-x86_64-linux-gnu.so",
        "/root/.pyenv/versions/3.11.7/lib/python3.11/lib-dynload/unicodedata.cpython-311-x86_64-linux-gnu.so",
        "/usr/lib/x86_64-linux-gnu/libsframe.so.0.0.0",
        "/usr/lib/x86_64-linux-gnu/libubsan.so.1.0.0",
        "/usr/lib/x86_64-linux-gnu/libasan.so.8.0.0",
        "/usr/lib/jvm/java-17-openjdk-amd64/lib/libjava.so",
        "/usr/lib/jvm/temurin-25-jdk-amd64/lib/libfreetype.so",
        "/usr/lib/jvm/java-17-openjdk-amd64/lib/server/libjvm.so",
        "/usr/lib/google-cloud-sdk/platform/bundledpythonunix/lib/python3.12/site-packages/"
        "cryptography/hazmat/bindings/_rust.abi3.so",
        "/usr/bin/node"]


def run(cmd: list[str]) -> None:
  subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def py_include() -> str:
  import sysconfig
  return sysconfig.get_paths()["include"]


def compile_all(where: str, compilers=("gcc", "clang"), levels=("-O0", "-O1", "-O2", "-O3"),
                extra: tuple = ()) -> list[tuple[str, str]]:
  """(label, path) of every build: each source × compiler × level (+ ``extra`` flags)."""
  cxx = os.path.join(where, "shapes.cc")
  with open(cxx, "w") as f:
    f.write(CXX)
  root = os.path.dirname(HERE)
  out = []
  for cc in compilers:
    cplus = {"gcc": "g++", "clang": "clang++"}[cc]
    for level in levels:
      jobs = [(n, [cc, src, *libs]) for n, src, libs in PROGRAMS]
      jobs += [(n, [cc, "-fPIC", "-shared", f"-I{py_include()}", os.path.join(root, src)])
               for n, src in EXTENSIONS]
      jobs.append(("cxx-shapes", [cplus, cxx]))
      for name, cmd in jobs:
        label = f"{name}/{cc}{level}{''.join(extra)}"
        path = os.path.join(where, label.replace("/", "_"))
        run(cmd[:1] + [level, *extra, "-w", "-o", path] + cmd[1:])
        out.append((label, path))
  return out


def symtab_truth(path: str) -> dict[int, tuple[int, str]]:
  """start → (size, name): the sized STT_FUNC symbols of .symtab in executable sections."""
  from elftools.elf.elffile import ELFFile

  out: dict[int, tuple[int, str]] = {}
  with open(path, "rb") as fh:
    elf = ELFFile(fh)
    table = elf.get_section_by_name(".symtab")
    for sym in table.iter_symbols() if table is not None else ():
      shndx = sym["st_shndx"]
      if sym["st_info"]["type"] != "STT_FUNC" or not sym["st_size"] or not isinstance(shndx, int):
        continue
      if elf.get_section(shndx)["sh_flags"] & 0x4:
        out.setdefault(int(sym["st_value"]), (int(sym["st_size"]), sym.name))
  return out


def table(path: str, source: str) -> tuple[np.ndarray, np.ndarray]:
  from elftools.elf.elffile import ELFFile

  with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
    shdrs = elf_corpus.section_headers(ELFFile(fh), data)
    addrs, sizes, _ = elf_corpus.function_table(shdrs, data, source)
    return addrs, sizes


def call_targets(path: str) -> set[int]:
  """Targets of every E8 rel32 byte pattern in executable sections that land in one (a superset
  of the direct calls: a linear sweep over bytes, not instructions)."""
  from elftools.elf.elffile import ELFFile

  with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
    shdrs = elf_corpus.section_headers(ELFFile(fh), data)
    exe = shdrs[elf_corpus.executable_sections(shdrs)]
    out: set[int] = set()
    for sec in exe:
      buf = np.frombuffer(bytes(data[int(sec["offset"]):int(sec["offset"] + sec["size"])])
                          + b"\0" * 4, np.uint8).astype(np.int64)
      at = np.flatnonzero(buf[:-4] == 0xE8)
      rel32 = buf[at + 1] | buf[at + 2] << 8 | buf[at + 3] << 16 | buf[at + 4] << 24
      targets = int(sec["addr"]) + at + 5 + np.where(rel32 >= 1 << 31, rel32 - (1 << 32), rel32)
      for lo, size in zip(exe["addr"].tolist(), exe["size"].tolist()):
        out.update(targets[(targets >= lo) & (targets < lo + size)].tolist())
    return out


def compare(label: str, path: str, where: str) -> dict:
  truth = symtab_truth(path)
  stripped = os.path.join(where, os.path.basename(path) + ".stripped")
  run(["strip", "-o", stripped, path])
  addrs, sizes = table(stripped, "auto")
  found = dict(zip(addrs.tolist(), sizes.tolist()))
  os.unlink(stripped)
  exact = [a for a, (s, _) in truth.items() if found.get(a) == s]
  start_only = [a for a, (s, _) in truth.items() if a in found and found[a] != s]
  missed = [a for a in truth if a not in found]
  calls = call_targets(path) if missed else set()
  n = max(len(truth), 1)
  return {"file": label, "symtab_functions": len(truth), "found": len(found),
          "exact": len(exact), "exact_share": round(len(exact) / n, 5),
          "start_only": len(start_only), "missed": len(missed),
          "missed_cold": sum(".cold" in truth[a][1] for a in missed),
          "missed_call_targets": sum(a in calls for a in missed),
          "extra": sum(a not in truth for a in found),
          "missed_examples": sorted(truth[a][1] for a in missed)[:8],
          "start_only_examples": sorted(truth[a][1] for a in start_only)[:5]}


def speed(path: str) -> dict:
  """Seconds to read the functions of ``path``: symbols, our .eh_frame parser, pyelftools'."""
  from elftools.dwarf.callframe import FDE
  from elftools.elf.elffile import ELFFile

  row = {"file": path, "bytes": os.path.getsize(path)}
  for source in ("symbols", "eh_frame"):
    t = time.perf_counter()
    row[f"{source}_functions"] = len(table(path, source)[0])
    row[f"{source}_s"] = round(time.perf_counter() - t, 4)
  t = time.perf_counter()
  with open(path, "rb") as fh:
    n = sum(isinstance(e, FDE) for e in ELFFile(fh).get_dwarf_info().EH_CFI_entries())
  row["pyelftools_fdes"], row["pyelftools_eh_cfi_s"] = n, round(time.perf_counter() - t, 3)
  return row


def corpus_gain(paths: list[str], max_bytes: int) -> dict:
  """Functions and pretokens (whitespace-separated words of the text) that prepare binary reads
  from the same files with --functions symbols and with the default (auto)."""
  files = elf_corpus.list_inputs(paths, max_bytes)
  out = {"files": len(files), "bytes": sum(c.size for c in files)}
  for source in ("symbols", "auto"):
    t = time.perf_counter()
    funcs = words = code = 0
    digests: set = set()
    for c in files:
      res = elf_corpus.FileResult(path=c.path, file_bytes=c.size)
      for digest, text in elf_corpus.iter_functions(c.path, res, source=source):
        if digest not in digests:
          digests.add(digest)
          words += text.count(" ") + 1
      funcs += res.functions
      code += res.code_bytes
    out[source] = {"functions": funcs, "distinct_functions": len(digests),
                   "distinct_pretokens": words, "code_bytes": code,
                   "seconds": round(time.perf_counter() - t, 1)}
  return out


def summary(rows: list[dict]) -> dict:
  t = sum(r["symtab_functions"] for r in rows)
  e = sum(r["exact"] for r in rows)
  return {"files": len(rows), "symtab_functions": t, "exact": e,
          "exact_share": round(e / max(t, 1), 5),
          "min_file_exact_share": min((r["exact_share"] for r in rows), default=None),
          "extra": sum(r["extra"] for r in rows), "missed": sum(r["missed"] for r in rows)}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--real", nargs="*", default=REAL)
  p.add_argument("--no-compile", action="store_true")
  p.add_argument("--speed", nargs="*", default=["/usr/lib/x86_64-linux-gnu/libpython3.11.so.1.0"])
  p.add_argument("--corpus", nargs="*", default=[])
  p.add_argument("--corpus-bytes", type=int, default=80 << 20)
  a = p.parse_args()
  row = {"date": datetime.date.today().isoformat(), "device": "cpu",
         "host": _host.cpu_name(), "code": _host.code_version()}
  with tempfile.TemporaryDirectory() as where:
    if not a.no_compile:
      for key, extra in (("compiled", ()), ("compiled_no_unwind_tables",
                                            ("-fno-asynchronous-unwind-tables",))):
        rows = [compare(label, path, where) for label, path in
                compile_all(where, extra=extra,
                            levels=("-O0", "-O1", "-O2", "-O3") if not extra else ("-O2",))]
        row[key] = {"summary": summary(rows), "by_compiler_level": levels(rows), "files": rows}
        print(key, row[key]["summary"], flush=True)
    real = [compare(path, path, where) for path in a.real if os.path.exists(path)]
    row["real"] = {"summary": summary(real), "files": real}
    print("real", row["real"]["summary"], flush=True)
  row["speed"] = [speed(path) for path in a.speed]
  print("speed", row["speed"], flush=True)
  if a.corpus:
    row["corpus"] = corpus_gain(a.corpus, a.corpus_bytes)
    print("corpus", row["corpus"], flush=True)
  name = f"{row['date']}-cpu-stripped-functions.json"
  _host.append_result(os.path.join(RESULTS, name), row)
  print("wrote", os.path.join(RESULTS, name))


def levels(rows: list[dict]) -> dict:
  out: dict[str, list] = {}
  for r in rows:
    out.setdefault(r["file"].split("/")[1], []).append(r)
  return {k: summary(v) for k, v in sorted(out.items())}


if __name__ == "__main__":
  main()
