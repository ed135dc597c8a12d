"""Fetch the C libraries of the similarity corpora from the package index (PyPI sdists).

  python tools/fetch_bench_sources.py --output bench_sources [--set eval|train]
      [--package lz4==4.3.3 …]

Each package is `pip download --no-binary :all: --no-deps NAME==VERSION` (the source
distribution, nothing else) and unpacked under --output; the bundled C library's directories
are printed, one per line, for tools/build_similarity_bench.py (--set builds a whole set with
each library's own flags). The sets, pinned in lmscale_jax/similarity/sources.py: eval (the
default; the benchmark: lz4 4.3.3's LZ4 and Brotli 1.1.0's Brotli as on 2026-12-01, then
zstandard 0.25.0's zstd and quickjs 1.19.4's QuickJS) and train (fine-tuning pairs from nine
other packages' libraries: libsodium, Lua 5.4, pycryptodome, cmark-gfm, tree-sitter, …).
A package already unpacked there is not fetched again.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tarfile
import tempfile

import _cli
from lmscale_jax.errors import UserError
from lmscale_jax.similarity import sources as similarity_sources

# name==version → the bundled C library inside the unpacked sdist (the Python bindings next to
# it need Python.h and are no part of the library).
LIBRARIES = similarity_sources.by_package()


DOWNLOAD_TIMEOUT_S = 600


def parser():
  p = _cli.Parser(description=__doc__.splitlines()[0])
  p.add_argument("--output", required=True, type=_cli.output_dir, metavar="DIR",
                 help="where to unpack (git-ignored: bench_sources)")
  p.add_argument("--set", choices=list(similarity_sources.SETS), default="eval",
                 help="the pinned packages of the benchmark (eval, the default) or of the "
                 "fine-tuning pairs (train)")
  p.add_argument("--package", action="append", default=[], metavar="NAME==VERSION",
                 help="repeatable; instead of --set's packages")
  return p


def fetch(spec: str, out: str) -> list[str]:
  """Downloads and unpacks one sdist; returns its C library directories (a package of no set:
  its top directory)."""
  if "==" not in spec:
    raise UserError(f"--package {spec!r}: expected NAME==VERSION (a pinned release)")
  lib = LIBRARIES.get(spec.lower())
  if lib and os.path.isdir(os.path.join(out, lib.top)):
    return library_dirs(lib, out)
  name = spec.split("==")[0]
  with tempfile.TemporaryDirectory(dir=out, prefix=".download-") as tmp:
    # --no-binary for this package only: with :all:, pip also builds the build requirements
    # from source to read the metadata (lupa's Cython: past 600 s on a busy 2-core machine).
    try:
      r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", name,
                          "--no-deps", "--quiet", "-d", tmp, spec],
                         capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
      raise UserError(f"pip download {spec}: no sdist within {DOWNLOAD_TIMEOUT_S} s (pip "
                      "reads its metadata by building it: rerun on a less busy machine)"
                      ) from None
    archives = glob.glob(os.path.join(tmp, "*.tar.gz"))
    if r.returncode != 0 or not archives:
      last = (r.stderr.strip().splitlines() or ["no source distribution"])[-1]
      raise UserError(f"pip download {spec} failed: {last}")
    with tarfile.open(archives[0]) as tar:
      top = tar.getnames()[0].split("/")[0]
      tar.extractall(tmp, filter="data")  # no absolute paths, links out or devices
    if lib and top != lib.top:
      raise UserError(f"{spec}: the sdist unpacks to {top}/, not {lib.top}/ as "
                      "lmscale_jax/similarity/sources.py expects (fix its top)")
    if not os.path.isdir(os.path.join(out, top)):
      os.replace(os.path.join(tmp, top), os.path.join(out, top))
  return library_dirs(lib, out) if lib else [os.path.join(out, top)]


def library_dirs(lib, out: str) -> list[str]:
  return [os.path.join(out, lib.top, x) for x in lib.sources]


def main(argv=None) -> int:
  a = parser().parse_args(argv)

  def go() -> int:
    os.makedirs(a.output, exist_ok=True)
    specs = a.package or [lib.package for lib in similarity_sources.SETS[a.set]]
    for spec in specs:
      print("\n".join(fetch(spec, a.output)))
    return 0

  return _cli.guarded(go, f"rerun to finish the download into {a.output}")


if __name__ == "__main__":
  sys.exit(main())
