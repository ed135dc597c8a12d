"""Shared argument parsing of the prepare_* tools (the tools themselves stay thin)."""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lmscale_jax import prepare  # noqa: E402
from lmscale_jax.errors import UserError  # noqa: E402


def parser(kind: str) -> argparse.ArgumentParser:
  what = "ELF files or directories" if kind == "binary" else ".txt / .jsonl files"
  p = argparse.ArgumentParser(
      description=f"Prepare a packed uint16 ArrayRecord MLM dataset from {what}.")
  p.add_argument("--input", nargs="+", required=True, metavar="PATH", help=what)
  p.add_argument("--output", required=True, metavar="DIR", help="dataset directory to create")
  p.add_argument("--seq-len", type=int, default=512)
  p.add_argument("--vocab-size", type=int, default=8192 if kind == "binary" else 30522,
                 help="tokenizer vocabulary to train (<= 65535)")
  p.add_argument("--tokenizer", default="", metavar="tokenizer.json",
                 help="use this tokenizer instead of training one")
  p.add_argument("--tokenizer-model", choices=["wordpiece", "bpe"], default="wordpiece")
  p.add_argument("--tokenizer-sample-mb", type=int, default=64,
                 help="train the tokenizer on the first N MB of the deduplicated corpus")
  p.add_argument("--workers", type=int, default=0, help="processes (0 = all cores)")
  p.add_argument("--max-input-bytes", type=int, default=0,
                 help="stop taking input files after this many bytes (0 = no limit)")
  p.add_argument("--packing", choices=["greedy", "none"], default="greedy")
  p.add_argument("--shard-size-mb", type=float, default=64)
  p.add_argument("--chunk-mb", type=float, default=32,
                 help="corpus chunk size (what a resumed run keeps of the extraction)")
  p.add_argument("--val-fraction", type=float, default=0.01)
  p.add_argument("--overwrite", action="store_true", help="replace a non-empty output dir")
  p.add_argument("--no-progress", action="store_true")
  if kind == "text":
    p.add_argument("--text-field", default="text", help=".jsonl field holding the text")
    p.add_argument("--txt-docs", choices=["line", "blank"], default="line",
                   help=".txt documents: one per line, or separated by blank lines")
    p.add_argument("--lowercase", action="store_true")
  return p


def run(kind: str, argv=None) -> int:
  a = parser(kind).parse_args(argv)
  opts = prepare.Options(
      kind=kind, inputs=a.input, output=a.output, seq_len=a.seq_len, vocab_size=a.vocab_size,
      tokenizer=a.tokenizer, tokenizer_model=a.tokenizer_model,
      tokenizer_sample_mb=a.tokenizer_sample_mb, workers=a.workers,
      max_input_bytes=a.max_input_bytes, packing=a.packing, shard_size_mb=a.shard_size_mb,
      chunk_mb=a.chunk_mb,
      val_fraction=a.val_fraction, overwrite=a.overwrite, progress=not a.no_progress,
      **({"text_field": a.text_field, "txt_docs": a.txt_docs, "lowercase": a.lowercase}
         if kind == "text" else {}))
  try:
    stats = prepare.prepare(opts)
  except UserError as e:  # bad input: one line; a bug keeps its traceback
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(json.dumps(stats, indent=2))
  return 0
