"""Shared test fixtures: real datasets written through the production writer."""

from __future__ import annotations

import os

import numpy as np

from lmscale_jax import dataset as ds

SPECIAL_IDS = {t: i for i, t in enumerate(ds.SPECIAL_TOKENS)}


def make_synthetic_dataset(directory: str, *, seq_len: int = 64, vocab_size: int = 128,
                           n_train: int = 256, n_val: int = 32, shards: int = 2,
                           seed: int = 0, pad_frac: float = 0.1) -> ds.DatasetMeta:
  """A small, real dataset directory (ArrayRecord shards + metadata) of random token sequences.

  Each sequence is ``[CLS] tokens… [SEP] [PAD]…`` with roughly ``pad_frac`` padding. The
  tokenizer is a WordLevel vocabulary t0..tN so decoding works.
  """
  from tokenizers import Tokenizer, models

  os.makedirs(directory, exist_ok=True)
  rng = np.random.default_rng(seed)
  nspecial = len(ds.SPECIAL_TOKENS)
  splits = {}
  for split, n in (("train", n_train), ("validation", n_val)):
    seqs = []
    for _ in range(n):
      length = int(rng.integers(int(seq_len * (1 - 2 * pad_frac)), seq_len + 1))
      length = max(3, min(seq_len, length))
      x = np.zeros(seq_len, np.uint16)
      x[0] = SPECIAL_IDS["[CLS]"]
      x[1:length - 1] = rng.integers(nspecial, vocab_size, length - 2)
      x[length - 1] = SPECIAL_IDS["[SEP]"]
      seqs.append(x)
    per = np.array_split(np.arange(n), shards)
    infos = []
    for i, idx in enumerate(per):
      fname = ds.shard_filename("synthetic", split, i, shards)
      info = ds.write_array_record(os.path.join(directory, fname),
                                   (ds.encode_record(seqs[j]) for j in idx))
      infos.append({"file": fname, **info})
    splits[split] = infos
  vocab = {t: i for t, i in SPECIAL_IDS.items()}
  vocab.update({f"t{i}": i for i in range(nspecial, vocab_size)})
  Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).save(
      os.path.join(directory, ds.TOKENIZER))
  return ds.finalize(directory, name="synthetic", seq_len=seq_len, vocab_size=vocab_size,
                     special_ids=SPECIAL_IDS, splits=splits, extra={"kind": "synthetic"})
