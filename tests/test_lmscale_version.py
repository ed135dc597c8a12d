"""``lmscale --version``: the installed package's version, from its metadata, at once (no JAX
import: the installed command's start alone)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from importlib import metadata

from tests.helpers import ROOT

INSTALLED = os.path.join(os.path.dirname(sys.executable), "lmscale")


def test_version_is_the_package_metadata_fast_and_without_jax():
  probe = ("import sys; from lmscale_jax.cli import lmscale; code = lmscale.main(['--version']);"
           " sys.exit(code or 10 * any(m == 'jax' or m.startswith('jax.') for m in sys.modules))")
  r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                     timeout=60)
  assert r.returncode == 0, (r.returncode, r.stderr[-2000:])  # 10: jax was imported
  assert r.stdout == f"lmscale {metadata.version('lmscale_jax')}\n", r.stdout
  start = time.perf_counter()
  r = subprocess.run([INSTALLED, "--version"], cwd=ROOT, capture_output=True, text=True,
                     timeout=60)
  took = time.perf_counter() - start
  assert r.returncode == 0 and r.stdout.startswith("lmscale ") and not r.stderr, r
  assert took < 2.0, f"lmscale --version took {took:.2f} s"  # 0.55 s wall, 0.08 s CPU on the loaded 2-core machine
