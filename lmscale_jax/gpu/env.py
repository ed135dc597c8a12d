"""What a GPU self-check reports about the machine before measuring anything: the CUDA
devices JAX sees (or exactly why there are none: no GPU visible, CPU-only jax, the CUDA
backend's own error; never a silent CPU fallback) and the versions of the driver and the CUDA
libraries JAX loaded. Used by :mod:`lmscale_jax.gpu.check`."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from importlib import metadata

import jax

CUDA_PLUGINS = ("jax-cuda12-plugin", "jax-cuda13-plugin")
NCCL_WHEELS = ("nvidia-nccl-cu12", "nvidia-nccl-cu13")
NO_GPU = "not measured: no GPU"


def one_line(e: BaseException) -> str:
  """An exception as one line: its type and the first non-empty line of its message."""
  text = str(e).strip()
  line = next((l for l in text.splitlines() if l.strip()), "") if text else ""
  return f"{type(e).__name__}: {line[:300]}"


def _package(names) -> tuple[str | None, str | None]:
  for n in names:
    try:
      return f"{n} {metadata.version(n)}", None
    except metadata.PackageNotFoundError:
      continue
  return None, f"none of {', '.join(names)} is installed in {sys.prefix}"


def nvidia_driver() -> tuple[str | None, str | None]:
  """The NVIDIA kernel driver's version, and the reason when there is none."""
  try:
    with open("/proc/driver/nvidia/version") as f:
      found = re.search(r"\b(\d{3,}\.\d+(?:\.\d+)?)\b", f.read())
    if found:
      return found.group(1), None
  except OSError:
    pass
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30)
    if out.returncode == 0 and out.stdout.strip():
      return out.stdout.split()[0], None
    return None, f"nvidia-smi failed: {(out.stderr or out.stdout).strip()[:200]}"
  except (OSError, subprocess.TimeoutExpired):
    return None, "no NVIDIA driver: no /proc/driver/nvidia/version and no nvidia-smi"


def _cuda_version(v: int) -> str:
  return f"{v // 1000}.{v % 1000 // 10}"


def _cudnn_version(v: int) -> str:  # cuDNN 9 encodes major*10000 + minor*100 + patch
  return f"{v // 10000}.{v % 10000 // 100}.{v % 100}" if v >= 90000 else (
      f"{v // 1000}.{v % 1000 // 100}.{v % 100}")


def versions(gpu: bool) -> tuple[dict, dict]:
  """(values, reasons): library and driver versions; see the module docstring."""
  values = {"python": platform.python_version(), "jax": jax.__version__,
            "jaxlib": metadata.version("jaxlib")}
  reasons = {}
  values["cuda_plugin"], reasons["cuda_plugin"] = _package(CUDA_PLUGINS)
  values["driver"], reasons["driver"] = nvidia_driver()
  values["nccl"], reasons["nccl"] = _package(NCCL_WHEELS)
  try:  # jax's own handle on the plugin's CUDA libraries (private, hence guarded)
    from jax._src.lib import cuda_versions
  except ImportError:
    cuda_versions = None
  probes = {"cuda_runtime": ("cuda_runtime_get_version", _cuda_version),
            "cuda_driver_api": ("cuda_driver_get_version", _cuda_version),
            "cudnn": ("cudnn_get_version", _cudnn_version)}
  for key, (fn, fmt) in probes.items():
    values[key] = None
    if cuda_versions is None:
      reasons[key] = "no CUDA plugin in this jax (CPU-only install)"
    elif not gpu:
      reasons[key] = NO_GPU
    else:
      try:
        values[key] = fmt(int(getattr(cuda_versions, fn)()))
      except Exception as e:  # a missing library or entry point: report, do not stop
        reasons[key] = f"{fn}: {type(e).__name__}: {str(e)[:200]}"
  return values, {k: v for k, v in reasons.items() if values.get(k) is None and v}


def _cpu_only_jax() -> str | None:
  """Why this Python's jax cannot drive a GPU at all, if it cannot (no CUDA plugin package
  and no CUDA in jaxlib itself)."""
  from jax._src.lib import cuda_versions

  if cuda_versions is not None or _package(CUDA_PLUGINS)[0] is not None:
    return None
  return (f"this Python ({sys.prefix}) has CPU-only jax: install the CUDA one with "
          "bash tools/setup.sh --cuda, then run .venv-cuda/bin/lmscale gpu-check")


def gpu_devices() -> tuple[list, str | None]:
  """JAX's CUDA devices, or [] and why there are none (never a CPU fallback)."""
  cpu_only = _cpu_only_jax()
  try:  # jax's own test (device nodes /dev/nvidia*); without one, asking CUDA only asserts
    from jax._src import hardware_utils
    visible = hardware_utils.has_visible_nvidia_gpu()
  except (ImportError, AttributeError):
    visible = True
  if not visible:
    driver, why = nvidia_driver()
    return [], "; ".join(filter(None, [
        "no NVIDIA GPU visible on this machine (no /dev/nvidia* device; "
        + (f"driver {driver})" if driver else f"{why})"), cpu_only]))
  if cpu_only:
    return [], cpu_only
  try:
    return jax.devices("cuda"), None
  except Exception as e:  # the backend's own words: driver too old, libraries not found, …
    why = one_line(e)
  if os.environ.get("JAX_PLATFORMS", "") not in ("", "cuda", "gpu"):
    why += f" (JAX_PLATFORMS={os.environ['JAX_PLATFORMS']} is set)"
  return [], why


def describe_devices(devices) -> list[dict]:
  out = []
  for d in devices:
    stats = d.memory_stats() or {}
    limit = stats.get("bytes_limit")
    out.append({"id": d.id, "kind": d.device_kind, "platform": d.platform,
                "process_index": d.process_index,
                "memory_gb": None if limit is None else round(limit / 2**30, 2)})
  return out
