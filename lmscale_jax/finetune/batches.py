"""What the batches of every fine-tuning task share (pairs: finetune/pairs.py; labelled rows:
finetune/labels.py): this process's share of each step's rows, the texts tokenised once each
(``[CLS] text [SEP]`` cut at the model's length, :func:`trained_model.encode`), the step to
draw next, and the checkpoint's "data" item.

Grain's checkpoint handler (grain/_src/python/checkpoint/handler.py) takes any object with
``get_state() -> bytes`` / ``set_state(bytes)``: the state is the next step, the seed, the batch
size and the training file's sha256. Seed and batch size are recorded for the reader; a change
of them is the config's to refuse or allow (workdir.check_config_change), a change of the file's
contents is not (the resumed run would draw other batches).
"""

from __future__ import annotations

import json
import os

import numpy as np

from lmscale_jax.inference import trained_model


class StepBatches:
  """A task's sampler: :meth:`batch` (step → this process's rows, the subclass's) and
  :meth:`check_same_file` (a saved state → refused if its file differs) are the task's.
  Iterating yields the batch of ``next_step`` and advances it."""

  file_key = ""  # the state's key of the file's sha256

  def __init__(self, model: trained_model.TrainedModel, sha256: str, *, seed: int,
               batch_size: int, process_index: int, process_count: int):
    self.model, self.sha256 = model, sha256
    self.seed, self.batch_size = int(seed), int(batch_size)
    per = self.batch_size // process_count
    self.rows = slice(process_index * per, (process_index + 1) * per)  # of each step's batch
    self.pad = model.special_ids["[PAD]"]
    self.next_step = 1
    self._ids: dict = {}
    self.truncated = 0  # texts cut at the model's length, of those tokenised so far

  def encode(self, key, text: str) -> np.ndarray:
    """The ids of ``text`` (known by ``key``), tokenised the first time only."""
    if key not in self._ids:
      self._ids[key], cut = trained_model.encode(self.model, text)
      self.truncated += cut
    return self._ids[key]

  def padded(self, rows: list[np.ndarray]) -> np.ndarray:
    return trained_model.pad_batch(rows, self.model.cfg.seq_len, self.pad)

  @property
  def truncated_fraction(self) -> float:
    """Of the distinct texts this process has tokenised so far, the share cut at seq_len."""
    return self.truncated / max(1, len(self._ids))

  def batch(self, step: int):
    raise NotImplementedError

  def check_same_file(self, saved: dict) -> None:
    raise NotImplementedError

  def __iter__(self):
    return self

  def __next__(self):
    out = self.batch(self.next_step)
    self.next_step += 1
    return out

  def get_state(self) -> bytes:
    return json.dumps({"next_step": self.next_step, "seed": self.seed,
                       "batch_size": self.batch_size, self.file_key: self.sha256}).encode()

  def set_state(self, state: bytes) -> None:
    saved = json.loads(state)
    self.check_same_file(saved)
    self.next_step = int(saved["next_step"])

  def start_prefetch(self) -> None:
    pass  # batches are built on demand


def check_same_source(flag: str, path: str, sha256: str, saved_sha256, error) -> None:
  """Refuses (``error``, one line) a resume whose data file (``flag path``) is not the one the
  checkpoint's batches were drawn from (``saved_sha256``, from its saved state)."""
  if saved_sha256 != sha256:
    raise error(
        f"{flag} {path} is not the file the checkpoint was trained on (sha256 "
        f"{str(saved_sha256)[:12]}…, now {sha256[:12]}…): the resumed run would draw other "
        "batches; restore that file or use a new --workdir")


def saved_state(step_dir: str, process_index: int, process_count: int) -> dict | None:
  """A checkpoint's sampler state as this process saved it (Grain's handler writes
  ``data/process_<i>-of-<n>.json``; None: missing or unreadable, which the restore names)."""
  path = os.path.join(step_dir, "data", f"process_{process_index}-of-{process_count}.json")
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None
