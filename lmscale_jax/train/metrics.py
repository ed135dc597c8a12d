"""Training metrics: ``workdir/metrics.jsonl``, TensorBoard event files and a console line;
every run's step log (:class:`StepLog`: windows of steps, fetched one step late, and
``train.nonfinite``).

Only process 0 writes. Throughput is derived here from host-side timings: samples/s, non-pad
tokens/s, MFU (``flops.train_flops_per_step`` / step time / (devices × peak)) and the fraction
of wall time the loop spent blocked waiting for input.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Callable

import jax
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


# ----------------------------------------------------------------------------- the step log
@dataclasses.dataclass
class Window:
  """The steps of one logging interval: their device metrics and host-side timings. Its time
  runs from the completion of the previous window's last step (or from a resume after a
  pause) to the completion of its own last step, minus pauses; ``untimed`` leading steps (the
  run's first, which compiles) are outside it."""
  last_step: int
  metrics: list     # one dict of device scalars per step
  input_wait: float
  opened: float     # perf_counter() when its clock (re)started
  carried: float = 0.0  # seconds timed before a pause
  untimed: int = 0
  seconds: float = 0.0  # set when its last step has completed

  @property
  def first_step(self) -> int:
    return self.last_step - len(self.metrics) + 1

  @property
  def timed(self) -> list:
    return self.metrics[self.untimed:]


class StepLog:
  """Every run's logger: turns windows of ``train.log_every`` steps into metrics rows
  (metrics.jsonl, TensorBoard, a console line), one window late, and enforces
  ``train.nonfinite`` on them. A task's run subclasses it for its row (:meth:`make_row`: its
  columns), its console line and where its last good checkpoint is.

  ``reset_wait()``: seconds the loop waited for input since the last call (a window's
  ``input_wait``)."""

  advice = "train.nonfinite=skip skips such steps instead"  # the error line's last words

  def __init__(self, train_config, workdir: str, start: int,
               reset_wait: Callable[[], float] = lambda: 0.0):
    self.train_config, self.start, self.workdir = train_config, start, workdir
    self.reset_wait = reset_wait
    self.is_writer = jax.process_index() == 0
    self.writer = MetricsWriter(workdir, enabled=self.is_writer,
                                total_steps=train_config.steps, resume_step=start)
    self.last: dict = {}
    self.current: list = []
    self.pending: Window | None = None  # closed, its metrics fetched after the next dispatch
    # The clock of the window being filled: when it (re)started, seconds timed before a pause.
    self.opened, self.carried, self.untimed = time.perf_counter(), 0.0, 0
    self.first_step_seconds: float | None = None
    self.paused_at = self.opened
    reset_wait()

  # What a task's run says of itself.
  def make_row(self, window: Window, host: list, good: list) -> dict:
    """The row of ``window`` (``host``: its steps' metrics; ``good``: the finite ones)."""
    raise NotImplementedError

  def console(self, step: int, row: dict) -> None:
    self.writer.console(step, row)

  def last_good(self) -> str:
    """The newest checkpoint, as the error lines name it."""
    raise NotImplementedError

  # Why completion, not dispatch: JAX dispatches asynchronously, so after any synchronisation
  # (start, evaluation, a save) the host queues a whole window in milliseconds; windows stamped
  # at dispatch logged 16-30x the true rate after each evaluation (tools/demo.sh,
  # tests/test_throughput_windows.py). A window's metrics are fetched one step late, which
  # blocks until its last step has completed: that moment is the stamp, at no extra sync.
  def after_step(self, step: int, metrics: dict) -> None:
    self.current.append(metrics)
    if step == self.start + 1:
      self._time_first_step(metrics)
    if self.pending is not None:  # its metrics are ready by now
      self._log(self.pending)
      self.pending = None
    if step % self.train_config.log_every == 0 or step == self.train_config.steps:
      self.pending = self._close(step)

  def _time_first_step(self, metrics: dict) -> None:
    """The run's first step compiles the program: timed on its own (``first_step_seconds``
    in the first row), outside the first window."""
    jax.block_until_ready(metrics)
    now = time.perf_counter()
    self.first_step_seconds = now - self.opened
    self.opened, self.carried, self.untimed = now, 0.0, 1
    self.reset_wait()

  def _close(self, step: int) -> Window:
    window = Window(step, self.current, self.reset_wait(), self.opened, self.carried,
                    self.untimed)
    self.current, self.carried, self.untimed = [], 0.0, 0
    return window

  def _stamp(self, window: Window) -> None:
    """Called once ``window``'s last step has completed; the next window's clock starts."""
    now = time.perf_counter()
    window.seconds = window.carried + (now - window.opened)
    self.opened = now

  def pause(self) -> None:
    """Before a synchronising interruption (evaluation, a checkpoint save): the steps
    dispatched so far are timed up to their completion, and the clock stops."""
    if self.pending is not None:
      self._log(self.pending)  # blocks until its last step completes
      self.pending = None
    if self.current:
      jax.block_until_ready(self.current[-1])
      self.carried += time.perf_counter() - self.opened
    self.paused_at = time.perf_counter()

  def resume(self) -> None:
    self.opened = time.perf_counter()

  def finish(self, step: int) -> None:
    """Logs what is left: the pending window and a partial one (a preempted run)."""
    if self.pending is not None:
      self._log(self.pending)
      self.pending = None
    if self.current:
      jax.block_until_ready(self.current[-1])
      self._log(self._close(step))

  def check_before_save(self, step: int) -> None:
    """Error mode: never checkpoint past a non-finite step, even one not logged yet."""
    if self.train_config.nonfinite != "error":
      return
    unlogged = [w for w in (self.pending, Window(step, self.current, 0.0, 0.0))
                if w is not None and w.metrics]
    flags = jax.device_get([[m["nonfinite"] for m in w.metrics] for w in unlogged])
    for window, window_flags in zip(unlogged, flags):
      if any(window_flags):
        raise_on_nonfinite(self.train_config, window.first_step, window_flags,
                           self.last_good(), self.advice)

  def _log(self, window: Window) -> None:
    host = jax.device_get(window.metrics)
    self._stamp(window)
    t = self.train_config
    flags = [m["nonfinite"] for m in host]
    if any(flags):
      raise_on_nonfinite(t, window.first_step, flags, self.last_good(), self.advice)
    run = int(host[-1].get("consecutive_nonfinite", 0))  # present in skip mode only
    if run >= t.max_consecutive_nonfinite:
      raise_on_consecutive_skips(t, window.last_step, run, self.last_good())
    good = [m for m in host if not m["nonfinite"]] or host
    row = self.make_row(window, host, good)
    if window.untimed and self.first_step_seconds is not None:
      row["first_step_seconds"] = self.first_step_seconds
    if t.nonfinite == "skip":
      row["nonfinite_skipped"] = int(sum(m["nonfinite"] for m in host))
    self.write(window.last_step, row)

  def write(self, step: int, row: dict) -> None:
    self.writer.write(step, row)
    self.console(step, row)
    self.last.update(row)

  def close(self, quiet: bool = False) -> None:
    self.writer.close(quiet)  # quiet: on the way out of a failed run (MetricsWriter.close)
