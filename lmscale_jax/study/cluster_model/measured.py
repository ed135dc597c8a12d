"""What the cluster model is given from measurements: the link of a loopback all-reduce
calibration (``benchmarks/bench_allreduce.py``'s α–β fit), a workdir's measured step time and
parameter count, a step profile (``benchmarks/bench_step_profile.py``) and a sweep's step times.
Each reader names the flag and the file it was given when the file is not what it expects.
"""

from __future__ import annotations

import json
import math
import os
import statistics

from lmscale_jax.config import legacy
from lmscale_jax.study.cluster_model import overlap as ov
from lmscale_jax.study.cluster_model.links import Link, ModelError, link, read_jsonl


# ----------------------------------------------------------------------------- calibration
def shared_cores(ranks: int, cores: int | None) -> float:
  """How many times slower each rank's copies run when ``ranks`` processes share ``cores``
  cores (1 when each has a core of its own, or ``cores`` is None: a real network)."""
  return max(1.0, ranks / cores) if cores else 1.0


def calibrated_allreduce_s(grad_bytes: float, ranks: int, alpha: float, beta: float,
                           cores: int | None = None) -> float:
  """The ring model of a loopback all-reduce on one machine: the "link" is the kernel copying
  bytes between processes, CPU work, so its bandwidth is shared when ranks outnumber cores."""
  if ranks <= 1:
    return 0.0
  return (2 * (ranks - 1) * alpha
          + 2 * (ranks - 1) / ranks * grad_bytes * shared_cores(ranks, cores) / beta)


def fit_alpha_beta(points, cores: int | None = None) -> tuple[float, float]:
  """(α, β) of the ring model ``t = 2(p−1)·α + 2(p−1)/p·n·s/β`` fitted to ``(p, n, t)``
  points, ``s = shared_cores(p, cores)`` (1 unless ``cores`` is given and p exceeds it).

  Least squares in *relative* error (each point weighted by 1/t), so a 1 MB point counts as
  much as a 256 MB one; linear in (α, 1/β), solved in closed form. α is clamped at 0 (a
  negative latency is noise: refitted with α = 0).
  """
  rows = [(2 * (p - 1) / t, 2 * (p - 1) / p * n * shared_cores(p, cores) / t)
          for p, n, t in points]
  if len(rows) < 2:
    raise ModelError("an α–β fit needs at least two measured points")
  saa = sum(a * a for a, _ in rows)
  sbb = sum(b * b for _, b in rows)
  sab = sum(a * b for a, b in rows)
  sa, sb = sum(a for a, _ in rows), sum(b for _, b in rows)  # targets are all 1
  det = saa * sbb - sab * sab
  alpha, inv_beta = ((sbb * sa - sab * sb) / det, (saa * sb - sab * sa) / det) if det else (
      0.0, 0.0)
  if alpha < 0 or not det:
    alpha, inv_beta = 0.0, sb / sbb
  if inv_beta <= 0:
    raise ModelError("the all-reduce timings do not grow with size: no bandwidth to fit")
  return alpha, 1 / inv_beta


def calibration_fit(path: str, fit_of: str = "all") -> dict:
  """The last ``fit`` line of ``fit_of`` ("all" = every process count at once, or "2", "4",
  …) that ``benchmarks/bench_allreduce.py`` wrote to ``path``, from a run that kept freed
  memory in the heap (``heap: keep``: the transport's time, not page faults)."""
  fits = [row for row in read_jsonl(path, "--calibration")
          if row.get("kind") == "fit" and row.get("fit_of") == fit_of
          and row.get("heap", "keep") == "keep"]
  if not fits:
    raise ModelError(f"--calibration {path}: no fit line with fit_of={fit_of!r} of a "
                     "heap=keep run (expected the output of benchmarks/bench_allreduce.py)")
  return fits[-1]


def load_calibration(path: str, fit_of: str = "all") -> Link:
  """The link of :func:`calibration_fit` (α, β; its ``cores`` only matter on that machine)."""
  fit = calibration_fit(path, fit_of)
  return link(f"calibrated ({os.path.basename(path)}, fit of {fit_of})",
              fit["beta_bytes_per_s"], fit["alpha_s"])



# ----------------------------------------------------------------------------- workdirs
def workdir_step(workdir: str, skip_windows: int = 1) -> dict:
  """A finished or running workdir's measured microbatch step time and parameter count.

  ``step_time`` is the median of ``metrics.jsonl``'s windows after the first ``skip_windows``
  (compilation and warm-up), divided by ``train.grad_accum_steps``; the parameters are counted
  from ``config.json``'s resolved model (``flops.count_params_from_config``).
  """
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  config_path = os.path.join(workdir, "config.json")
  if not os.path.isdir(workdir):
    raise ModelError(f"--workdir {workdir}: not a directory")
  times = []
  if os.path.exists(metrics_path):
    with open(metrics_path) as f:
      for line in f:
        try:
          row = json.loads(line)
        except ValueError:
          continue  # a torn last line of a run still writing
        if isinstance(row.get("step_time"), (int, float)):
          times.append(row["step_time"])
  if len(times) <= skip_windows:
    raise ModelError(f"--workdir {workdir}: {metrics_path} has {len(times)} step_time rows; "
                     f"need more than {skip_windows} (the first window is warm-up): train "
                     "longer, or give --step-time")
  try:
    with open(config_path) as f:
      cfg = json.load(f)
    full = legacy.complete(cfg["config"])
    shape, train, data = cfg["model"], full["train"], full["data"]
  except (OSError, ValueError, KeyError) as e:
    raise ModelError(f"--workdir {workdir}: {config_path} is missing or not a run's config "
                     f"({type(e).__name__}: {e})") from None
  import ml_collections

  from lmscale_jax.model import flops

  model = ml_collections.ConfigDict(shape)
  params = flops.count_params_from_config(model)
  k = int(train["grad_accum_steps"])
  predictions = int(data.get("max_predictions") or math.ceil(
      float(data.get("mask_prob", 0.15)) * model.seq_len))
  return {"step_time_s": statistics.median(times[skip_windows:]) / k, "params": params,
          "profile": ov.bert_profile(model, model.seq_len, predictions),
          "windows": len(times) - skip_windows, "grad_accum_steps": k,
          "grad_dtype": train["grad_allreduce_dtype"],
          "batch_size": int(train["batch_size"])}



# ----------------------------------------------------------------------------- measured compute
def load_step_profile(path: str) -> dict:
  """The last ``fit`` row of ``benchmarks/bench_step_profile.py``'s output: ``fixed_s``,
  ``jitter_s`` and ``batch_points`` ([[batch, seconds], …]) of one process."""
  rows = [r for r in read_jsonl(path, "--step-profile")
          if r.get("bench") == "step-profile" and r.get("kind") == "fit"]
  if not rows:
    raise ModelError(f"--step-profile {path}: no step-profile fit row (expected the output "
                     "of benchmarks/bench_step_profile.py)")
  return rows[-1]


def sweep_step_points(path: str, model: str = "") -> list[tuple[int, float]]:
  """(per-device batch, median step time) of a ``lmscale sweep`` results file's finished
  one-process, no-accumulation rows (of ``model`` when the file has several)."""
  rows = [r for r in read_jsonl(path, "--step-times-from")
          if r.get("status") == "ok" and r.get("processes") == 1 and r.get("accum") == 1
          and isinstance(r.get("step_time"), (int, float))]
  models = sorted({r.get("model", "") for r in rows})
  if len(models) > 1 and not model:
    raise ModelError(f"--step-times-from {path}: rows of several models ({', '.join(models)}): "
                     "choose one with --sweep-model")
  points = [(int(r["batch"]) // int(r.get("devices") or 1), float(r["step_time"]))
            for r in rows if not model or r.get("model") == model]
  if not points:
    raise ModelError(f"--step-times-from {path}: no finished 1-process rows with accum 1"
                     + (f" of model {model!r}" if model else ""))
  return points

