"""What a measurement ran on, as its results file's ``device`` says it (the sweeps, the tools
and the benchmarks, benchmarks/_host.py, describe a host the same way), and the checkout it
runs from."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys

# The checkout holding the package (an editable install, tools/setup.sh): the runs start there
# with its launch/*.sh, relative config paths (configs/*.py) are read from it, and
# benchmarks/results lives in it.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cpu_name() -> str:
  """``cpu: <model> (<n> cores)``, from ``lscpu`` where it exists."""
  try:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    model = next(line.split(":", 1)[1].strip() for line in out.splitlines()
                 if line.startswith("Model name"))
  except (OSError, subprocess.CalledProcessError, StopIteration):
    model = platform.processor() or "unknown cpu"
  return f"cpu: {model} ({os.cpu_count()} cores)"


def host_description(directory: str) -> str:
  """``cpu: <model> (<n> cores); disk: <device> <fstype>`` of the CPU and of ``directory``."""
  disk = "unknown disk"
  try:
    out = subprocess.run(["df", "--output=source,fstype", directory], capture_output=True,
                         text=True, check=True).stdout.split()
    disk = " ".join(out[-2:])
  except (OSError, subprocess.CalledProcessError):
    pass
  return f"{cpu_name()}; disk: {disk}"


def code_version() -> str:
  """The checkout's commit, "+changes" when files it tracks differ from it (results files
  aside: the benchmarks append to them), or "unknown" outside a git checkout: which code a
  result measured."""
  try:
    git = ["git", "-C", ROOT]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()
    changed = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no", "--", ".",
                              ":(exclude)benchmarks/results"], capture_output=True, text=True,
                             check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
  return commit + ("+changes" if changed else "")


@contextlib.contextmanager
def checkout_importable():
  """The checkout on sys.path while a config file runs here. A run loads its config with the
  checkout on sys.path (``python -m lmscale_jax.main`` from it: launch/*.sh), so a config may
  import from it (tests.helpers, configs/); loaded any other way here, such a config would
  fail here only. Removed afterwards: nothing else in this process needs it."""
  added = ROOT not in sys.path
  if added:
    sys.path.insert(0, ROOT)
  try:
    yield
  finally:
    if added:
      sys.path.remove(ROOT)
