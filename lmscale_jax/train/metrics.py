"""Training metrics: ``workdir/metrics.jsonl``, TensorBoard event files and a console line.

Only process 0 writes. Throughput is derived here from host-side timings: samples/s, non-pad
tokens/s, MFU (``flops.train_flops_per_step`` / step time / (devices × peak)) and the fraction
of wall time the loop spent blocked waiting for input.
"""

from __future__ import annotations

import json
import math
import os
import time

from absl import logging

from lmscale_jax.errors import UserError
from lmscale_jax.store import file_io


# ----------------------------------------------------------------------------- train.nonfinite
class NonFiniteLoss(UserError, FloatingPointError):
  """A non-finite loss or gradient (``train.nonfinite``): names the step and the last good
  checkpoint (nothing after it is saved)."""


def raise_on_nonfinite(train_config, first_step: int, flags, last_good: str,
                       advice: str) -> None:
  """Error mode: the first of the steps ``first_step, …`` whose ``nonfinite`` flag is set
  stops the run (``advice``: what to change). Skip mode: nothing (the step was skipped)."""
  bad = [first_step + i for i, flag in enumerate(flags) if flag]
  if bad and train_config.nonfinite == "error":
    raise NonFiniteLoss(f"non-finite loss or gradient at step {bad[0]}; last good checkpoint: "
                        f"{last_good} (nothing later was saved). {advice}")


def raise_on_consecutive_skips(train_config, last_step: int, run: int, last_good: str) -> None:
  """Skip mode: ``train.max_consecutive_nonfinite`` skipped steps in a row (``run`` ending at
  ``last_step``) stop the run."""
  if run >= train_config.max_consecutive_nonfinite:
    raise NonFiniteLoss(
        f"{run} consecutive steps with a non-finite loss or gradient (steps "
        f"{last_step - run + 1}-{last_step}, all skipped; "
        f"train.max_consecutive_nonfinite={train_config.max_consecutive_nonfinite}); last good "
        f"checkpoint: {last_good}")


def _clean(v):
  """JSON-safe scalars: numpy/jax scalars → float/int, NaN/inf → None."""
  if hasattr(v, "item"):
    v = v.item()
  if isinstance(v, float) and not math.isfinite(v):
    return None
  return v


def _truncate_after(path: str, step: int) -> None:
  """Keeps the rows of ``metrics.jsonl`` up to ``step`` (the checkpoint a run resumes from).

  After a kill, the file holds rows of steps that the resumed run computes again, and maybe a
  half-written last line; without this the file would have two rows for those steps. Rewritten
  through a temporary file and a rename, so a crash here loses nothing.
  """
  if not os.path.exists(path):
    return
  with open(path, "rb") as f:
    lines = f.read().split(b"\n")
  keep = []
  for n, line in enumerate(lines, 1):
    try:
      row = json.loads(line)
    except ValueError:  # a torn last line (killed mid-write) or an empty one
      continue
    if not (isinstance(row, dict) and isinstance(row.get("step", 0), int)):
      logging.warning("%s:%d: not a metrics row (an object with an integer step); dropped",
                      path, n)
      continue
    if row.get("step", 0) <= step:
      keep.append(line + b"\n")
  data = b"".join(keep)
  if len(keep) != len([x for x in lines if x]):
    file_io.atomic_write_bytes(path, data)


class MetricsWriter:

  def __init__(self, workdir: str, *, enabled: bool = True, total_steps: int = 0,
               resume_step: int = 0):
    self.enabled = enabled
    self.total_steps = total_steps
    self._jsonl = None
    self._tb = None
    self._t0 = time.time()
    self._first_step = None
    if enabled:
      os.makedirs(workdir, exist_ok=True)
      path = os.path.join(workdir, "metrics.jsonl")
      _truncate_after(path, resume_step)
      # Append: a resumed run continues the same file.
      self._jsonl = open(path, "a", buffering=1)
      from tensorboardX import SummaryWriter

      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, row: dict) -> None:
    if not self.enabled:
      return
    row = {"step": int(step), **{k: _clean(v) for k, v in row.items()}}
    self._jsonl.write(json.dumps(row) + "\n")
    for k, v in row.items():
      if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
        self._tb.add_scalar(k, v, step)

  def console(self, step: int, row: dict) -> None:
    """One progress line with an ETA from the throughput since this process started."""
    if not self.enabled:
      return
    if self._first_step is None:
      self._first_step, self._t0 = step, time.time()
    done = step - self._first_step
    eta = ""
    if done > 0 and self.total_steps:
      rate = done / (time.time() - self._t0)
      left = (self.total_steps - step) / rate
      eta = f" eta {int(left // 3600)}:{int(left % 3600 // 60):02d}:{int(left % 60):02d}"
    parts = [f"step {step}/{self.total_steps}"]
    for key, fmt in (("loss", "{:.4f}"), ("mlm_accuracy", "{:.3f}"), ("eval_loss", "{:.4f}"),
                     ("eval_mlm_accuracy", "{:.3f}"), ("learning_rate", "{:.2e}"),
                     ("samples_per_sec", "{:.1f}"), ("tokens_per_sec", "{:.0f}"),
                     ("mfu", "{:.1%}"), ("input_wait_frac", "{:.1%}")):
      v = _clean(row.get(key))
      if v is not None:
        parts.append(f"{key} " + fmt.format(v))
    logging.info(" | ".join(parts) + eta)

  def close(self, quiet: bool = False) -> None:
    """``quiet``: on the way out of a failed run, where closing can fail for the same reason
    (a full disk: TensorBoard's flush) and must not hide it (only logged at --v=1)."""
    if not self.enabled:
      return
    try:
      self._jsonl.close()
      self._tb.close()
    except Exception as e:
      if not quiet:
        raise
      logging.vlog(1, "closing the metrics writer failed too: %s", e)


def throughput(*, steps: int, seconds: float, wait_seconds: float, global_batch: int,
               tokens: float, flops_per_step: float, peak_flops_total: float | None) -> dict:
  """Rates over a logging interval of ``steps`` steps that took ``seconds`` of wall time; all
  None for no timed steps (a window holding only a run's first, compiling step)."""
  if steps == 0:
    return dict.fromkeys(("step_time", "samples_per_sec", "tokens_per_sec", "input_wait_frac",
                          "mfu"))
  seconds = max(seconds, 1e-9)
  out = {
      "step_time": seconds / steps,
      "samples_per_sec": steps * global_batch / seconds,
      "tokens_per_sec": tokens / seconds,
      "input_wait_frac": min(1.0, wait_seconds / seconds),
  }
  # MFU = useful model FLOPs per second / peak of all devices; None where the peak is unknown
  # (CPU), so no made-up number is ever logged.
  out["mfu"] = (flops_per_step * steps / seconds / peak_flops_total
                if peak_flops_total else None)
  return out
