"""What a measurement ran on, as its results file's ``device`` says it: the sweeps, the tools
and the benchmarks (benchmarks/_host.py) describe a host the same way."""

from __future__ import annotations

import os
import platform
import subprocess


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
