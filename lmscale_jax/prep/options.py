"""The options of a data preparation (``lmscale prepare binary``, ``lmscale prepare text``) and
their ranges: what ``cli/args.py`` parses and :func:`check_options` checks, for the CLI and
for library callers alike."""

from __future__ import annotations

import dataclasses
import math
import os

from lmscale_jax.errors import PrepareError
from lmscale_jax.prep.elf import eh_frame
from lmscale_jax.store import dataset, file_io
from lmscale_jax.store import tokenizer as toklib


# --vocab-size when none is given: a ceiling, not a request (prepare.warn_small_vocabulary says
# nothing of it). A binary vocabulary is its corpus's distinct instruction words
# (store/tokenizer.py), about 1,000-1,200 on this machine's libraries (24 MB: 1,058; 64 MB, the
# tokenizer's sample: 1,208); text's is BERT's.
DEFAULT_VOCAB = {"binary": 8192, "text": 30522}


@dataclasses.dataclass
class PrepareOptions:
  kind: str                       # "binary" | "text"
  inputs: list
  output: str
  seq_len: int = 512
  vocab_size: int = DEFAULT_VOCAB["binary"]
  vocab_size_given: bool = True   # asked for (--vocab-size): a smaller vocabulary is then said
  tokenizer: str = ""             # a given tokenizer.json; empty = train one
  tokenizer_model: str = "wordpiece"
  tokenizer_sample_mb: int = 64
  lowercase: bool = False
  workers: int = 0                # 0 = every CPU this process may use
  max_input_bytes: int = 0
  packing: str = "greedy"
  compression: str = "zstd"       # per-record shard compression: zstd | snappy | none
  shard_size_mb: float = 64
  chunk_mb: float = 32            # corpus chunk size: the resume granularity of pass 1
  val_fraction: float = 0.01
  txt_docs: str = "line"
  text_field: str = "text"
  functions: str = "auto"         # binary: where function boundaries come from (eh_frame.SOURCES)
  overwrite: bool = False
  progress: bool = True

  def output_params(self) -> dict:
    """Everything that determines the output bytes (a resume must match them)."""
    skip = {"workers", "overwrite", "progress", "output", "vocab_size_given"}
    d = {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}
    if d["compression"] == "zstd":  # the bytes of every run before the option: resumes match
      del d["compression"]
    if d["functions"] == "symbols":  # likewise: every run before --functions read symbols only
      del d["functions"]
    d["inputs"] = [os.path.abspath(p) for p in self.inputs]
    if self.tokenizer:
      d["tokenizer"] = file_io.sha256_file(self.tokenizer)
    return d


# ----------------------------------------------------------------------------- checks
# Ranges of the numeric options (cli/args.py checks them where they are parsed, with the same
# bounds): a value outside them is a typo or a misunderstanding, never a useful setting.
SEQ_LEN = (8, 1 << 16)
SIZE_MB = (0.01, 1 << 20)      # shard and chunk sizes: 10 kB .. 1 TB
MAX_WORKERS = 4096
# Below 1e-6 no item lands in validation (splits are drawn in steps of one millionth); above
# one half "validation" would be the larger split, surely a mistake.
VAL_FRACTION = (1e-6, 0.5)
# A byte-level BPE starts from every byte: its vocabulary is never smaller (a WordPiece's
# alphabet depends on the corpus: prepare.check_trained_size says so after training).
BPE_MIN_VOCAB = len(dataset.SPECIAL_TOKENS) + 256


def show_range(lo: float, hi: float) -> str:
  """``lo..hi`` as a user types numbers (1048576, not 1.04858e+06)."""
  return "..".join(str(int(x)) if float(x).is_integer() else f"{x:g}" for x in (lo, hi))


def _finite(name: str, value, lo: float, hi: float) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or \
      not math.isfinite(value) or not lo <= value <= hi:
    raise PrepareError(f"{name} {value!r}: expected a finite number in {show_range(lo, hi)}")


def check_options(o: PrepareOptions) -> None:
  """Every option on its own (one PrepareError naming the flag)."""
  if o.kind not in ("binary", "text"):
    raise PrepareError(f"kind {o.kind!r}: expected 'binary' or 'text'")
  for name in ("seq_len", "workers", "max_input_bytes", "tokenizer_sample_mb", "vocab_size"):
    if isinstance(getattr(o, name), bool) or not isinstance(getattr(o, name), int):
      raise PrepareError(f"--{name.replace('_', '-')} {getattr(o, name)!r}: expected an integer")
  if not o.tokenizer:
    try:
      toklib.check_vocab_size(o.vocab_size)
    except toklib.TokenizerError as e:
      raise PrepareError(str(e)) from None
    if o.kind == "text" and o.tokenizer_model == "bpe" and o.vocab_size < BPE_MIN_VOCAB:
      raise PrepareError(f"--vocab-size {o.vocab_size}: a byte-level BPE has at least "
                         f"{BPE_MIN_VOCAB} tokens ({len(dataset.SPECIAL_TOKENS)} special tokens "
                         "and 256 bytes); give a larger --vocab-size")
  _finite("--seq-len", o.seq_len, *SEQ_LEN)
  if o.packing not in ("greedy", "none"):
    raise PrepareError(f"--packing {o.packing!r}: expected 'greedy' or 'none'")
  if o.compression not in dataset.COMPRESSIONS:
    raise PrepareError(f"--compression {o.compression!r}: expected one of "
                       f"{list(dataset.COMPRESSIONS)}")
  _finite("--val-fraction", o.val_fraction, *VAL_FRACTION)
  _finite("--shard-size-mb", o.shard_size_mb, *SIZE_MB)
  _finite("--chunk-mb", o.chunk_mb, *SIZE_MB)
  _finite("--tokenizer-sample-mb", o.tokenizer_sample_mb, 1, 1 << 20)
  _finite("--workers", o.workers, 0, MAX_WORKERS)
  _finite("--max-input-bytes", o.max_input_bytes, 0, 1 << 62)
  if o.functions not in eh_frame.SOURCES:
    raise PrepareError(f"--functions {o.functions!r}: expected one of {list(eh_frame.SOURCES)}")
  if o.txt_docs not in ("line", "blank"):
    raise PrepareError(f"--txt-docs {o.txt_docs!r}: expected 'line' or 'blank'")
  if o.tokenizer and not os.path.isfile(o.tokenizer):
    raise PrepareError(f"--tokenizer {o.tokenizer!r}: no such file")
  if o.tokenizer:  # read now, not after pass 1 (hours on a large corpus): 10-50 ms
    try:
      toklib.load(o.tokenizer)
    except toklib.TokenizerError as e:
      raise PrepareError(f"--tokenizer {e}") from None
