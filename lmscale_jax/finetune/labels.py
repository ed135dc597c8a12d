"""The labelled functions of a classification fine-tune: a JSONL file, one object per line,
``{"text": "<pretokenised instruction text>", "label": "<class name>"}`` (``library``,
``function``, ``binary``: optional, kept for the predictions' report), and the batches drawn
from it.

A task is two files: the training file and a held-out one. The class list is the training
file's labels, sorted (class ``i`` is ``names[i]``; the workdir's ``labels.json``); a held-out
label the training file lacks is refused (the head has no output for it), as are fewer than two
classes, an empty file and a line that is not such an object or not valid UTF-8 text
(:mod:`lmscale_jax.store.user_text`), each in one line naming ``FILE:LINE``, before any work.

Step ``k`` (1-based) of a run with seed ``s`` takes B distinct rows, drawn by
``np.random.default_rng([s, k])`` (a function of (seed, step) alone: a resumed run, or another
process, draws the batch an uninterrupted run draws); process p of P tokenises only its rows
``p*B/P … (p+1)*B/P - 1``, each ``[CLS] text [SEP]`` cut at the model's length as the pairs'
texts. :class:`LabelBatches` is the checkpoint's "data" item
(:class:`lmscale_jax.finetune.batches.StepBatches`): the next step, and the file's sha256 (a
resume on other contents is refused).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from lmscale_jax.errors import UserError
from lmscale_jax.finetune import batches as finetune_batches
from lmscale_jax.inference import trained_model
from lmscale_jax.store import file_io, user_text


class LabelsError(UserError, ValueError):
  """A labels file that cannot train or score: missing, not the format, too few classes."""


@dataclasses.dataclass
class Examples:
  path: str
  sha256: str
  texts: list[str]
  labels: list[str]
  lines: list[int]        # each example's 1-based line in the file
  info: list[dict]        # each example's optional keys (library, function, binary)

  def __len__(self) -> int:
    return len(self.texts)


OPTIONAL = ("library", "function", "binary")


def read(path: str, flag: str = "--labels") -> Examples:
  """Every example of ``path``, checked line by line (blank lines skipped)."""
  if not os.path.isfile(path):
    raise LabelsError(f"{flag} {path}: no such file (a JSONL file of {{\"text\", \"label\"}} "
                      "objects)")
  texts, labels, lines, info = [], [], [], []
  # Strict UTF-8 (store/user_text): bytes that are not were read as U+FFFD and trained on.
  for number, line in enumerate(user_text.read_file(path).split("\n"), 1):
    if not line.strip():
      continue
    row = _parse(line, f"{path}:{number}")
    texts.append(row["text"])
    labels.append(row["label"])
    lines.append(number)
    info.append({k: row[k] for k in OPTIONAL if k in row})
  if not texts:
    raise LabelsError(f"{flag} {path}: no examples (an empty file; expected one "
                      "{\"text\", \"label\"} object per line)")
  return Examples(path=path, sha256=file_io.sha256_file(path), texts=texts, labels=labels,
                  lines=lines, info=info)


def _parse(line: str, where: str) -> dict:
  try:
    row = user_text.parse_json(line, where)  # every string valid Unicode, not too deep
  except ValueError:
    raise LabelsError(f"{where}: not a JSON object (expected {{\"text\": \"…\", \"label\": "
                      "\"…\"} per line)") from None
  if not isinstance(row, dict):
    raise LabelsError(f"{where}: a JSON {type(row).__name__}, expected an object with "
                      "\"text\" and \"label\"")
  for key in ("text", "label"):
    if not isinstance(row.get(key), str):
      got = "missing" if key not in row else f"a {type(row[key]).__name__}"
      raise LabelsError(f"{where}: \"{key}\" is {got}, expected a string")
  return row


def class_names(train: Examples) -> list[str]:
  """The training file's labels, sorted: the head's outputs, in order."""
  names = sorted(set(train.labels))
  if len(names) < 2:
    raise LabelsError(f"--labels {train.path}: every example is labelled {names[0]!r}: a "
                      "classifier needs two or more classes")
  return names


def check_known(examples: Examples, names: list[str], flag: str = "--eval-labels") -> None:
  """Every label of ``examples`` is one of ``names`` (the training file's)."""
  known = set(names)
  for label, line in zip(examples.labels, examples.lines):
    if label not in known:
      shown = ", ".join(repr(n) for n in names[:10]) + (", …" if len(names) > 10 else "")
      raise LabelsError(f"{flag}: unknown label {label!r} at {examples.path}:{line}; the "
                        f"training labels are {shown} ({len(names)})")


def check_enough(train: Examples, batch_size: int) -> None:
  if len(train) < batch_size:
    raise LabelsError(f"--labels {train.path}: {len(train)} examples, fewer than "
                      f"train.batch_size={batch_size} (each batch takes that many distinct "
                      f"examples): give a batch size <= {len(train)} or a larger file")


def class_ids(examples: Examples, names: list[str]) -> np.ndarray:
  index = {n: i for i, n in enumerate(names)}
  return np.asarray([index[lab] for lab in examples.labels], np.int32)


def encode_all(model: trained_model.TrainedModel, texts: list[str]) -> tuple[np.ndarray, int]:
  """ids [N, seq_len] (``[CLS] text [SEP]`` cut and padded) and how many texts were cut."""
  encoded = [trained_model.encode(model, t) for t in texts]
  ids = trained_model.pad_batch([e[0] for e in encoded], model.cfg.seq_len,
                                model.special_ids["[PAD]"])
  return ids, sum(e[1] for e in encoded)


def windowed(examples: Examples, model: trained_model.TrainedModel,
             most: int) -> tuple[Examples, np.ndarray]:
  """``examples`` with each text read as up to ``most`` windows
  (:func:`trained_model.text_windows`), each a row with its example's label, line and keys;
  and each row's example. ``most`` 1: the examples as they are, each cut where the model cuts."""
  if most <= 1:
    return examples, np.arange(len(examples))
  rows = [(i, w) for i, text in enumerate(examples.texts)
          for w in trained_model.text_windows(model, text, most)]
  owner = np.asarray([i for i, _ in rows], np.int64)
  return dataclasses.replace(
      examples, texts=[w for _, w in rows], labels=[examples.labels[i] for i in owner],
      lines=[examples.lines[i] for i in owner], info=[examples.info[i] for i in owner]), owner


def pooled(log_probs: np.ndarray, owner: np.ndarray, count: int) -> np.ndarray:
  """Each of ``count`` examples' class log-probabilities [count, C], the mean of its rows'
  (``owner``: each row's example, :func:`windowed`)."""
  sums = np.zeros((count, log_probs.shape[1]), np.float64)
  np.add.at(sums, owner, log_probs)
  return sums / np.bincount(owner, minlength=count)[:, None]


class LabelBatches(finetune_batches.StepBatches):
  """This process's rows of each step's batch: ``{"ids": int32 [B/P, seq_len], "label": int32
  [B/P]}`` (:class:`finetune_batches.StepBatches`)."""

  file_key = "labels_sha256"

  def __init__(self, train: Examples, names: list[str], model: trained_model.TrainedModel, *,
               seed: int, batch_size: int, process_index: int = 0, process_count: int = 1):
    check_enough(train, batch_size)
    super().__init__(model, train.sha256, seed=seed, batch_size=batch_size,
                     process_index=process_index, process_count=process_count)
    self.train, self.targets = train, class_ids(train, names)

  def batch(self, step: int) -> dict:
    rng = np.random.default_rng([self.seed, step])
    rows = rng.choice(len(self.train), self.batch_size, replace=False)[self.rows].tolist()
    ids = self.padded([self.encode(r, self.train.texts[r]) for r in rows])
    return {"ids": ids, "label": self.targets[rows]}

  def check_same_file(self, saved: dict) -> None:
    check_same_file(self.train, saved)


def check_same_file(train: Examples, saved: dict) -> None:
  finetune_batches.check_same_source("--labels", train.path, train.sha256,
                                     saved.get("labels_sha256"), LabelsError)


def check_resume(train: Examples, step_dir: str, process_index: int, process_count: int) -> None:
  """Before a resume writes anything: the checkpoint's batches came from ``train``'s contents."""
  saved = finetune_batches.saved_state(step_dir, process_index, process_count)
  if saved is not None:  # else the restore names a missing or unreadable state
    check_same_file(train, saved)
