"""``lmscale X --help`` answers without importing JAX or any other heavy library (issue 56,
item 8: it took 2-4 s for ten subcommands): each subcommand's module imports what only its
work needs inside the functions that do it. Checked by the modules the real command's process
imported (``PYTHONPROFILEIMPORTTIME``), not by a timed assertion: the times are measured in
benchmarks/results/2026-12-06-cpu-help-latency.json. And ``lmscale train --help`` opens with
what a user needs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lmscale_jax.cli import lmscale
from tests.helpers import ROOT

INSTALLED = os.path.join(os.path.dirname(sys.executable), "lmscale")
# What a help text never needs; each costs 0.3-1.5 s to import on a CPU machine.
HEAVY = {"jax", "jaxlib", "flax", "optax", "orbax", "tensorflow", "tokenizers", "grain",
         "transformers", "torch", "safetensors", "uvicorn", "starlette", "scipy", "matplotlib"}


def help_run(*argv: str) -> tuple[subprocess.CompletedProcess, set[str]]:
  """The installed command run with ``argv``; the top-level packages its process imported."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPROFILEIMPORTTIME="1")
  r = subprocess.run([INSTALLED, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=120, stdin=subprocess.DEVNULL)
  imported = {line.split("|")[-1].strip().split(".")[0] for line in r.stderr.splitlines()
              if line.startswith("import time:") and "|" in line}
  return r, imported


@pytest.mark.parametrize("argv", [[name, "--help"] for name in lmscale.MODULES]
                         + [["index", "finish", "--help"]], ids=" ".join)
def test_every_subcommand_help_imports_no_heavy_library(argv):
  r, imported = help_run(*argv)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "usage" in r.stdout.lower() or f"lmscale {argv[0]}" in r.stdout, r.stdout[:500]
  assert imported, "PYTHONPROFILEIMPORTTIME listed nothing: the check would see nothing"
  assert not imported & HEAVY, f"lmscale {' '.join(argv)} imported {sorted(imported & HEAVY)}"


def test_train_help_opens_with_what_a_user_types():
  r, _ = help_run("train", "--help")
  assert r.returncode == 0, r.stderr[-2000:]
  head = "\n".join(r.stdout.splitlines()[:12])
  assert head.startswith("usage: lmscale train --config "), head
  for needed in ("--workdir", "--config.", "tiny", "docs/training.md"):
    assert needed in head, (needed, head)
  for internal in ("supervisor", "startup.run", "trainer.train_and_evaluate", "launch/"):
    assert internal not in head, (internal, head)
