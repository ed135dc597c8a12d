"""Fetch the C libraries of the similarity benchmark from the package index (PyPI sdists).

  python tools/fetch_bench_sources.py --output bench_sources [--package lz4==4.3.3 …]

Each package is `pip download --no-binary :all: --no-deps NAME==VERSION` (the source
distribution, nothing else) and unpacked under --output; the bundled C library's directory is
printed, one per line, for tools/build_similarity_bench.py --sources. Pinned by default:
lz4 4.3.3 (bundles LZ4 1.9.x: lz4libs/) and Brotli 1.1.0 (bundles the Brotli C library: c/).
A package already unpacked there is not fetched again.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tarfile
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _cli  # noqa: E402
from lmscale_jax.errors import UserError  # noqa: E402

# name==version → the bundled C library inside the unpacked sdist (the Python bindings next to
# it need Python.h and are no part of the library).
LIBRARIES = {"lz4==4.3.3": "lz4-4.3.3/lz4libs", "brotli==1.1.0": "Brotli-1.1.0/c"}


def parser():
  p = _cli.Parser(description=__doc__.splitlines()[0])
  p.add_argument("--output", required=True, metavar="DIR", help="where to unpack (git-ignored: "
                 "bench_sources)")
  p.add_argument("--package", action="append", default=[], metavar="NAME==VERSION",
                 help=f"repeatable; default {' '.join(LIBRARIES)}")
  return p


def fetch(spec: str, out: str) -> str:
  """Downloads and unpacks one sdist; returns its C library directory."""
  if "==" not in spec:
    raise UserError(f"--package {spec!r}: expected NAME==VERSION (a pinned release)")
  where = LIBRARIES.get(spec.lower())
  if where and os.path.isdir(os.path.join(out, where)):
    return os.path.join(out, where)
  with tempfile.TemporaryDirectory(dir=out, prefix=".download-") as tmp:
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:",
                        "--no-deps", "--quiet", "-d", tmp, spec],
                       capture_output=True, text=True, timeout=600)
    archives = glob.glob(os.path.join(tmp, "*.tar.gz"))
    if r.returncode != 0 or not archives:
      last = (r.stderr.strip().splitlines() or ["no source distribution"])[-1]
      raise UserError(f"pip download {spec} failed: {last}")
    with tarfile.open(archives[0]) as tar:
      top = tar.getnames()[0].split("/")[0]
      tar.extractall(tmp, filter="data")  # no absolute paths, links out or devices
    if not os.path.isdir(os.path.join(out, top)):
      os.replace(os.path.join(tmp, top), os.path.join(out, top))
  return os.path.join(out, where or top)


def main(argv=None) -> int:
  a = parser().parse_args(argv)

  def go() -> int:
    os.makedirs(a.output, exist_ok=True)
    for spec in a.package or list(LIBRARIES):
      print(fetch(spec, a.output))
    return 0

  return _cli.guarded(go, f"rerun to finish the download into {a.output}")


if __name__ == "__main__":
  sys.exit(main())
