"""Pass 3's worker: corpus lines → token ids → packed sequences per split (``tokenize_lines``,
in a worker set up by ``init_worker``, or by ``ensure_worker`` on a pool's first task); binary code
through a memo of pretoken ids."""

from __future__ import annotations

import itertools
import time

import numpy as np

from lmscale_jax.prep import corpus_extract
from lmscale_jax.prep import packing as packing_lib  # "packing" is the mode here (greedy|none)
from lmscale_jax.prep.packing import pack_documents
from lmscale_jax.store import dataset
from lmscale_jax.store import tokenizer as toklib
from lmscale_jax.store.dataset import NEXT

TOKENIZE_BATCH = 4096

_worker: dict = {}  # the tokenize worker's tokenizer and packing settings


class PretokenIds(dict):
  """pretoken → its token ids, filled from the tokenizer on first sight of each pretoken.

  Binary code is already split into whitespace-separated pretokens and its tokenizer is
  WordPiece over those words, so a text's ids are the concatenation of its words' ids. A few
  thousand distinct pretokens make this memo ~10× faster than ``encode_batch`` (which pays for
  added-token matching and an Encoding object per text) with identical output (tested).
  ``compiled``: the ``_token_ids`` module, whose ``Encoder`` is :meth:`encode`'s loop in C (one
  table probe per instruction, no Python object); Python's own loop is the fallback.
  """

  def __init__(self, tok, compiled=None):
    super().__init__()
    self.tok = tok
    self.instructions = _InstructionIds(self)
    if compiled is not None:
      encoder = compiled.Encoder(self.word_ids, _SEPARATOR, self.instructions.separator)
      self.encode = lambda text: np.frombuffer(encoder.encode(text), np.uint16)

  def __missing__(self, word: str) -> tuple:
    ids = tuple(self.tok.encode(word, add_special_tokens=False).ids)
    self[word] = ids
    return ids

  def word_ids(self, word: str) -> bytes:
    """One word's ids (uint16 bytes): what the compiled Encoder asks for each new word."""
    return np.array(self[word], np.uint16).tobytes()

  def encode(self, text: str) -> np.ndarray:
    # One lookup per instruction (its words' ids and the separator's, as uint16 bytes) instead
    # of per word: ~5× fewer; one bytes join instead of an iterator over every id (measured:
    # half the stage's time); the separator after the last instruction is cut off.
    ids = np.frombuffer(b"".join(map(self.instructions.__getitem__, text.split(_SEPARATOR))),
                        np.uint16)
    return ids[:len(ids) - self.instructions.separator_len]


_SEPARATOR = f" {NEXT} "


class _InstructionIds(dict):
  """One instruction's text → its words' ids then the separator's (uint16 bytes); bounded (a
  corpus holds millions of distinct instructions, a chunk's repeat)."""

  def __init__(self, words: PretokenIds, size: int = 1 << 18):
    super().__init__()
    self.words, self.size = words, size
    self.separator = np.array(words[NEXT], np.uint16).tobytes()
    self.separator_len = len(self.separator) // 2

  def __missing__(self, instruction: str) -> bytes:
    if len(self) >= self.size:
      self.clear()
    words = self.words
    ids = self[instruction] = np.array([*itertools.chain.from_iterable(
        [words[w] for w in instruction.split()])], np.uint16).tobytes() + self.separator
    return ids


def ensure_worker(init: tuple) -> None:
  """This process set up for ``init`` (``init_worker``'s arguments), once: the preparation's
  one process pool serves every pass, so pass 3's workers are set up by its first task."""
  if _worker.get("init") != init or _worker["compiled"] is not packing_lib.token_ids_module():
    init_worker(*init)


def init_worker(path: str, kind: str, seq_len: int, packing: str,
                val_fraction: float) -> None:
  global _worker
  from tokenizers import Tokenizer

  tok = Tokenizer.from_file(path)
  compiled = packing_lib.token_ids_module()
  if kind == "binary":
    memo = PretokenIds(tok, compiled)
    encode = lambda texts: [memo.encode(t) for t in texts]  # noqa: E731
  else:
    encode = lambda texts: [  # noqa: E731
        np.asarray(e.ids, np.uint16) for e in tok.encode_batch(texts, add_special_tokens=False)]
  special = toklib.validate(tok, path)
  _worker = {"encode": encode, "seq_len": seq_len, "packing": packing, "compiled": compiled,
             "val_fraction": val_fraction, "special": special,
             "init": (path, kind, seq_len, packing, val_fraction)}


def special_ids() -> dict:
  """The special tokens' ids of this worker's tokenizer."""
  return _worker["special"]


def tokenize_lines(batches) -> tuple[dict, dict]:
  """Corpus lines (in batches) → per split, their packed sequences ([n, seq_len] uint16) and
  counts; the worker's settings are :func:`init_worker`'s.

  Each piece is packed on its own (its open sequences are flushed at its end) so packing runs
  in the workers, in parallel; the cost is at most a window of part-filled sequences per piece.
  """
  w, sp = _worker, _worker["special"]
  docs = {s: [] for s in dataset.SPLITS}
  out = {s: {"items": 0, "content_tokens": 0} for s in dataset.SPLITS}
  seconds = {"tokenize": 0.0, "pack": 0.0}
  for batch in batches:
    t0 = time.perf_counter()
    parsed = [corpus_extract.parse_corpus_line(line) for line in batch]
    encoded = w["encode"]([text for _, text in parsed])
    for (digest, _), ids in zip(parsed, encoded):
      docs[split_of(digest, w["val_fraction"])].append(ids)
    seconds["tokenize"] += time.perf_counter() - t0
  t0 = time.perf_counter()
  for split, o in out.items():
    o["items"] = len(docs[split])
    o["content_tokens"] = sum(map(len, docs[split]))
    o["seqs"] = pack_documents(docs[split], w["seq_len"], sp["[CLS]"], sp["[SEP]"], sp["[PAD]"],
                               w["packing"], compiled=w["compiled"])
  seconds["pack"] += time.perf_counter() - t0
  return out, seconds


def split_of(digest: bytes, val_fraction: float) -> str:
  # digest-derived, so a function/document always lands in the same split on every run.
  key = int.from_bytes(digest[:8], "big")
  return "validation" if (key % 1_000_000) < val_fraction * 1_000_000 else "train"
