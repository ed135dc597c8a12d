"""Every entry point a user runs, walked with --help and with no arguments: --help prints its
usage and does nothing else (exit 0); no arguments is either a usage error in one line (exit 2
for argparse, 1 for main) or, for the commands that take no argument, the
documented run itself (those are run by the demo, CI and the GPU session, not here). Nothing
ends in a traceback. The list is discovered from the tree, so a new entry point is walked
without being added here; shell scripts are run in a sandbox copy by
tests/test_bad_input_prepare.py (they would otherwise act on the checkout).
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from tests.test_bad_input_prepare import SCRIPTS

PYTHON_TOOLS = sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "tools", "*.py"))
    + glob.glob(os.path.join(ROOT, "benchmarks", "bench_*.py"))
    if not os.path.basename(p).startswith("_"))
SHELL_SCRIPTS = sorted(
    os.path.relpath(p, ROOT) for pattern in ("tools/*.sh", "launch/*.sh", "launch/*.sbatch")
    for p in glob.glob(os.path.join(ROOT, pattern)) if not os.path.basename(p).startswith("_"))
# Entry points whose no-argument form is a whole documented run (a benchmark, the demo, a
# search over compilations): their no-argument behaviour is that run, not an error.
RUNS_WITHOUT_ARGUMENTS = {"tools/max_batch.py", "benchmarks/bench_loader.py",
                          "benchmarks/bench_prep.py", "benchmarks/bench_stage.py",
                          "benchmarks/bench_step.py", "tools/gpu_check.py",
                          "benchmarks/bench_allreduce.py", "tools/storage_model.py",
                          "benchmarks/bench_prep_memory.py", "benchmarks/bench_compression.py",
                          "benchmarks/bench_step_profile.py",
                          "benchmarks/bench_stripped_functions.py"}


def run(args, timeout=120):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=timeout, stdin=subprocess.DEVNULL)


def entry(name: str) -> list[str]:
  return [sys.executable, "-m", "lmscale_jax.main"] if name == "main" else [
      sys.executable, os.path.join(ROOT, name)]


def test_every_shell_script_is_walked():
  assert set(SHELL_SCRIPTS) <= set(SCRIPTS), sorted(set(SHELL_SCRIPTS) - set(SCRIPTS))
  assert {"tools/prepare_binary.py", "tools/stage.py"} <= set(PYTHON_TOOLS)


@pytest.mark.parametrize("name", ["main", *PYTHON_TOOLS])
def test_help_prints_usage_only(name, tmp_path):
  before = sorted(os.listdir(ROOT))
  result = run(entry(name) + ["--help"])
  assert result.returncode == 0, result.stderr[-2000:]
  # tools/*.py are shells of lmscale subcommands: their usage line names the subcommand
  invocation = "lmscale_jax.main" if name == "main" else (
      "lmscale " if name.startswith("tools/") else os.path.basename(name))
  assert invocation in result.stdout, result.stdout[:500]  # its usage line
  assert "Traceback" not in result.stderr
  assert sorted(os.listdir(ROOT)) == before  # wrote nothing


@pytest.mark.parametrize("name", ["main", *(t for t in PYTHON_TOOLS
                                            if t not in RUNS_WITHOUT_ARGUMENTS)])
def test_no_arguments_is_one_line(name):
  result = run(entry(name))
  # one code for every user error, argparse's usage errors too (docs/design.md, Exit codes)
  assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
