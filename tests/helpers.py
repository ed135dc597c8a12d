"""Shared test fixtures: real datasets written through the production writer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np

import ml_collections

from lmscale_jax.config import defaults as config_defaults
from lmscale_jax.store import dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The lmscale subcommand module each old tools/<name>.py is kept for (where the names differ).
CLI_MODULES = {"inspect_shards": "inspect_data", "fetch_bench_sources": "similarity_sources",
               "build_similarity_bench": "similarity_build", "finetune_similarity": "finetune"}


def lmscale(tool: str) -> list[str]:
  """The command line of the lmscale subcommand ``tool`` (an old tools/ name, ``.py`` or not)
  as ``python -m lmscale_jax.cli.<module>``: what the installed ``lmscale`` runs."""
  name = tool.removesuffix(".py")
  if name.startswith("prepare_"):  # prepare_binary / _text / _cluster: one module, kind first
    return [sys.executable, "-m", "lmscale_jax.cli.prepare", name.removeprefix("prepare_")]
  return [sys.executable, "-m", f"lmscale_jax.cli.{CLI_MODULES.get(name, name)}"]


SPECIAL_IDS = {t: i for i, t in enumerate(dataset.SPECIAL_TOKENS)}


def communicate(p: subprocess.Popen, timeout: float = 180) -> tuple[str, str]:
  """``p.communicate`` that never hangs a test: past ``timeout`` the process group (started
  with ``start_new_session``) is killed and the test fails with the tails of its output."""
  try:
    return p.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(p.pid, signal.SIGKILL)
    out, err = p.communicate()
    raise AssertionError(f"timed out after {timeout} s:\n{out[-3000:]}\n{err[-3000:]}")



def stop_process_group(p: subprocess.Popen, grace_s: float = 30) -> None:
  """Ends a child started with start_new_session=True (a server and what it started): SIGTERM to
  its group, SIGKILL after ``grace_s``."""
  if p.poll() is None:
    os.killpg(p.pid, signal.SIGTERM)
    try:
      p.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
      os.killpg(p.pid, signal.SIGKILL)
      p.wait()

def make_config(data_path="", **sections) -> ml_collections.ConfigDict:
  """The default config (``config_defaults.get_base_config``) with ``data.path`` set and
  overrides per section: ``make_config(path, train=dict(batch_size=8), data=dict(workers=1))``.
  Every test config starts here, so a test sees the defaults users get."""
  c = config_defaults.get_base_config()
  c.data.path = str(data_path)
  for section, values in sections.items():
    c[section].update(values)
  return c


def small_train_config(data_path, **train) -> ml_collections.ConfigDict:
  """A 2 × 64 float32 model without dropout, 6 steps of batch 8, logging every step, eval and
  checkpoint every 3: what the training-loop tests run (seconds on a CPU)."""
  c = make_config(
      data_path,
      model=dict(layers=2, hidden=64, heads=2, ffn=128, dtype="float32", dropout=0.0),
      train=dict(batch_size=8, steps=6, learning_rate=2e-3, warmup_steps=2, log_every=1,
                 eval_every=3, eval_batches=2),
      checkpoint=dict(every=3, keep=2))
  c.train.update(train)
  return c


def make_synthetic_dataset(directory: str, *, seq_len: int = 64, vocab_size: int = 128,
                           n_train: int = 256, n_val: int = 32, shards: int = 2,
                           seed: int = 0, pad_frac: float = 0.1) -> dataset.DatasetMeta:
  """A small, real dataset directory (ArrayRecord shards + metadata) of random token sequences.

  Each sequence is ``[CLS] tokens… [SEP] [PAD]…`` with roughly ``pad_frac`` padding. The
  tokenizer is a WordLevel vocabulary t0..tN so decoding works.
  """
  from tokenizers import Tokenizer, models

  os.makedirs(directory, exist_ok=True)
  rng = np.random.default_rng(seed)
  nspecial = len(dataset.SPECIAL_TOKENS)
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
      fname = dataset.shard_filename("synthetic", split, i, shards)
      info = dataset.write_array_record(os.path.join(directory, fname),
                                   (dataset.encode_record(seqs[j]) for j in idx))
      infos.append({"file": fname, **info})
    splits[split] = infos
  vocab = {t: i for t, i in SPECIAL_IDS.items()}
  vocab.update({f"t{i}": i for i in range(nspecial, vocab_size)})
  Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).save(
      os.path.join(directory, dataset.TOKENIZER))
  return dataset.finalize(directory, name="synthetic", seq_len=seq_len, vocab_size=vocab_size,
                     special_ids=SPECIAL_IDS, splits=splits, extra={"kind": "synthetic"})
