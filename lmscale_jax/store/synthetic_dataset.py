"""A small, real dataset directory of random token sequences, written through the production
writer (:mod:`lmscale_jax.store.dataset`): what a benchmark, a test or a first smoke run trains
on when no corpus is at hand. Same format as ``lmscale prepare``'s output; only the tokens
are random (a WordLevel vocabulary ``t0..tN``, so decoding works).
"""

from __future__ import annotations

import os

import numpy as np

from lmscale_jax.store import dataset

SPECIAL_IDS = {t: i for i, t in enumerate(dataset.SPECIAL_TOKENS)}


def random_sequence(rng: np.random.Generator, seq_len: int, vocab_size: int,
                    pad_frac: float) -> np.ndarray:
  """``[CLS] tokens… [SEP] [PAD]…`` with roughly ``pad_frac`` of the row padding."""
  length = int(rng.integers(int(seq_len * (1 - 2 * pad_frac)), seq_len + 1))
  length = max(3, min(seq_len, length))
  x = np.zeros(seq_len, np.uint16)
  x[0] = SPECIAL_IDS["[CLS]"]
  x[1:length - 1] = rng.integers(len(SPECIAL_IDS), vocab_size, length - 2)
  x[length - 1] = SPECIAL_IDS["[SEP]"]
  return x


def write_split(directory: str, split: str, seqs: list, shards: int) -> list[dict]:
  """The split's ArrayRecord shards; their file entries for the metadata."""
  infos = []
  for i, idx in enumerate(np.array_split(np.arange(len(seqs)), shards)):
    fname = dataset.shard_filename("synthetic", split, i, shards)
    info = dataset.write_array_record(os.path.join(directory, fname),
                                      (dataset.encode_record(seqs[j]) for j in idx))
    infos.append({"file": fname, **info})
  return infos


def write_synthetic_dataset(directory: str, *, seq_len: int = 64, vocab_size: int = 128,
                            n_train: int = 256, n_val: int = 32, shards: int = 2,
                            seed: int = 0, pad_frac: float = 0.1) -> dataset.DatasetMeta:
  """``n_train`` + ``n_val`` random sequences in ``shards`` shards per split, the tokenizer
  and the metadata under ``directory``; the same ``seed`` writes the same records."""
  from tokenizers import Tokenizer, models

  os.makedirs(directory, exist_ok=True)
  rng = np.random.default_rng(seed)
  splits = {}
  for split, n in (("train", n_train), ("validation", n_val)):
    seqs = [random_sequence(rng, seq_len, vocab_size, pad_frac) for _ in range(n)]
    splits[split] = write_split(directory, split, seqs, shards)
  vocab = dict(SPECIAL_IDS) | {f"t{i}": i for i in range(len(SPECIAL_IDS), vocab_size)}
  Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).save(
      os.path.join(directory, dataset.TOKENIZER))
  return dataset.finalize(directory, name="synthetic", seq_len=seq_len, vocab_size=vocab_size,
                          special_ids=SPECIAL_IDS, splits=splits, extra={"kind": "synthetic"})
