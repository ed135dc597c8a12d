"""The functions of a naming fine-tune (``--task name``; lmscale naming-build writes them): a
JSONL file, one object per line, ``{"text": "<pretokenised instruction text>", "name":
"<normalised name>", "tokens": ["<lowercase sub-token>", …]}`` (``library``, ``function``,
``binary``: optional, kept for the predictions' report; ``library`` also picks the slice the
prediction rule is chosen on).

The head's outputs are the training names' sub-tokens seen at least ``finetune.name_min_count``
times (:func:`vocabulary`; XFL's vocabulary), sorted, once each library's own sub-tokens (its
namespace, :func:`own_tokens`: ``finetune.name_library_share``) are left out of its names'
targets; the prediction rule is chosen, and the test file scored, against the whole names.
A line without a text or without a non-empty list of string tokens, and a training file none of whose tokens is that frequent,
are refused in one line naming ``FILE:LINE`` (or the file), before any work.

The slice the prediction rule is chosen on (:func:`calibration_split`) is held out of training:
whole libraries, the first by a digest of their names, until ``finetune.name_calibration`` of
the rows, as the test split holds out whole libraries (a file of one library: rows, seeded).
:class:`NameBatches` draws each step's rows as the classification task does
(:class:`lmscale_jax.finetune.labels.LabelBatches`): ``{"ids" [B/P, S], "targets" [B/P, V]
uint8}`` (multi-hot over the vocabulary).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os

import numpy as np

from lmscale_jax.finetune import batches as finetune_batches
from lmscale_jax.finetune.labels import LabelsError
from lmscale_jax.inference import trained_model
from lmscale_jax.store import file_io, user_text

OPTIONAL = ("library", "function", "binary", "name")


@dataclasses.dataclass
class Named:
  path: str
  sha256: str
  texts: list[str]
  tokens: list[list[str]]
  lines: list[int]        # each function's 1-based line in the file
  info: list[dict]        # each function's optional keys (name, library, function, binary)
  # What each calls, by name (naming-build's "calls": ELF examples), None where unknown.
  calls: list[list[str] | None] = dataclasses.field(default_factory=list)

  def __len__(self) -> int:
    return len(self.texts)

  @property
  def has_calls(self) -> bool:
    return any(c is not None for c in self.calls)

  def subset(self, rows: list[int]) -> "Named":
    return Named(self.path, self.sha256, [self.texts[r] for r in rows],
                 [self.tokens[r] for r in rows], [self.lines[r] for r in rows],
                 [self.info[r] for r in rows], [self.calls[r] for r in rows])


def read(path: str, flag: str = "--labels") -> Named:
  """Every function of ``path``, checked line by line (blank lines skipped)."""
  if not os.path.isfile(path):
    raise LabelsError(f"{flag} {path}: no such file (a JSONL file of {{\"text\", \"tokens\"}} "
                      "objects: lmscale naming-build's train.jsonl/test.jsonl)")
  texts, tokens, lines, info, calls = [], [], [], [], []
  for number, line in enumerate(user_text.read_file(path).split("\n"), 1):
    if not line.strip():
      continue
    row = _parse(line, f"{path}:{number}")
    texts.append(row["text"])
    tokens.append(list(dict.fromkeys(row["tokens"])))
    lines.append(number)
    info.append({k: row[k] for k in OPTIONAL if isinstance(row.get(k), str)})
    calls.append(row.get("calls"))
  if not texts:
    raise LabelsError(f"{flag} {path}: no functions (an empty file; expected one {{\"text\", "
                      "\"tokens\"} object per line)")
  return Named(path=path, sha256=file_io.sha256_file(path), texts=texts, tokens=tokens,
               lines=lines, info=info, calls=calls)


def _parse(line: str, where: str) -> dict:
  try:
    row = user_text.parse_json(line, where)
  except ValueError:
    raise LabelsError(f"{where}: not a JSON object (expected {{\"text\": \"…\", \"tokens\": "
                      "[\"…\"]} per line)") from None
  if not isinstance(row, dict) or not isinstance(row.get("text"), str):
    raise LabelsError(f"{where}: expected an object with a string \"text\" and a list "
                      "\"tokens\" (lmscale naming-build's format)")
  made = row.get("calls")
  if made is not None and not (isinstance(made, list) and all(isinstance(c, str) for c in made)):
    raise LabelsError(f"{where}: \"calls\" is {made!r}, expected a list of the names the "
                      "function calls (lmscale naming-build's), or no \"calls\"")
  got = row.get("tokens")
  if not isinstance(got, list) or not got or not all(isinstance(t, str) and t for t in got):
    raise LabelsError(f"{where}: \"tokens\" is {got!r}, expected a non-empty list of the "
                      "name's sub-tokens (a function with no usable name is left out of the "
                      "file)")
  return row


def vocabulary(train: Named, min_count: int) -> list[str]:
  """The sub-tokens of the training names seen in at least ``min_count`` functions, sorted."""
  counts = collections.Counter(t for name in train.tokens for t in name)
  tokens = sorted(t for t, n in counts.items() if n >= min_count)
  if not tokens:
    raise LabelsError(f"--labels {train.path}: no name sub-token occurs in {min_count} or more "
                      f"of its {len(train)} functions (finetune.name_min_count={min_count}): "
                      "no usable names to learn; give a larger file or a lower "
                      "--config.finetune.name_min_count")
  return tokens


OWN_MIN_NAMES = 20  # a namespace shows over many names: a smaller library keeps its tokens


def own_tokens(libraries: list[str], names: list[list[str]],
               share: float) -> dict[str, frozenset]:
  """Each library's own sub-tokens: those in at least ``share`` of its names (its namespace:
  ``xml``, ``g``, ``sqlite``), for libraries of OWN_MIN_NAMES names or more; ``share`` 0:
  none. The one owner of the rule (the naming fine-tune's targets, benchmarks/naming_baselines.py).
  Measured on the 2026-12-06 task (docs/naming.md): the most frequent training tokens score
  F1 0.018-0.031 on held-out training libraries with them, 0.040-0.051 without them."""
  rows = collections.defaultdict(list)
  for library, name in zip(libraries, names):
    rows[library].append(set(name))
  out = {}
  for library, held in rows.items():
    counts = collections.Counter(t for name in held for t in name)
    big = share > 0 and len(held) >= OWN_MIN_NAMES
    out[library] = frozenset(t for t, n in counts.items() if big and n >= share * len(held))
  return out


def names_less_own(libraries: list[str], names: list[list[str]],
                   share: float) -> list[list[str]]:
  """Each name less its library's own sub-tokens (:func:`own_tokens`): what a name learnt
  from one project can say of another's."""
  own = own_tokens(libraries, names, share)
  return [[t for t in name if t not in own[lib]] for lib, name in zip(libraries, names)]


def without_own(named: Named, share: float) -> Named:
  """``named`` with its names less their libraries' own sub-tokens (:func:`names_less_own`)."""
  libraries = [info.get("library", "") for info in named.info]
  return dataclasses.replace(named, tokens=names_less_own(libraries, named.tokens, share))


def targets(named: Named, tokens: list[str]) -> np.ndarray:
  """Multi-hot [N, V] uint8: 1 where the function's name holds the vocabulary's token."""
  index = {t: i for i, t in enumerate(tokens)}
  out = np.zeros((len(named), len(tokens)), np.uint8)
  for row, name in enumerate(named.tokens):
    out[row, [index[t] for t in name if t in index]] = 1
  return out


def calibration_split(train: Named, fraction: float, seed: int) -> tuple[list[int], list[int]]:
  """(rows to train on, rows the prediction rule is chosen on): whole libraries, ordered by a
  digest of their names (seeded), until ``fraction`` of the rows; one library: seeded rows."""
  want = max(1, int(round(fraction * len(train))))
  libraries = collections.defaultdict(list)
  for row, info in enumerate(train.info):
    libraries[info.get("library", "")].append(row)
  if len(libraries) > 1:
    held: list[int] = []
    for lib in sorted(libraries, key=lambda x: hashlib.sha256(f"{seed}:{x}".encode()).digest()):
      if len(held) >= want or len(held) + len(libraries[lib]) >= len(train):
        break
      held += libraries[lib]
  else:
    held = np.random.default_rng([seed, 7]).choice(len(train), want, replace=False).tolist()
  kept = set(held)
  return [r for r in range(len(train)) if r not in kept], sorted(held)


class NameBatches(finetune_batches.StepBatches):
  """This process's rows of each step's batch: ``{"ids": int32 [B/P, seq_len], "targets":
  uint8 [B/P, V]}`` (:class:`finetune_batches.StepBatches`), drawn from the training rows."""

  file_key = "labels_sha256"

  def __init__(self, train: Named, tokens: list[str], model: trained_model.TrainedModel, *,
               seed: int, batch_size: int, process_index: int = 0, process_count: int = 1):
    super().__init__(model, train.sha256, seed=seed, batch_size=batch_size,
                     process_index=process_index, process_count=process_count)
    self.train, self.targets = train, targets(train, tokens)

  def batch(self, step: int) -> dict:
    rng = np.random.default_rng([self.seed, step])
    rows = rng.choice(len(self.train), self.batch_size, replace=False)[self.rows].tolist()
    ids = self.padded([self.encode(r, self.train.texts[r]) for r in rows])
    return {"ids": ids, "targets": self.targets[rows]}

  def check_same_file(self, saved: dict) -> None:
    finetune_batches.check_same_source("--labels", self.train.path, self.train.sha256,
                                       saved.get("labels_sha256"), LabelsError)
