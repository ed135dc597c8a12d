"""What a benchmark ran on, for its results file (shared by the CPU benchmarks)."""

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
