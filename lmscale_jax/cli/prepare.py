"""``lmscale prepare binary|text``: a corpus → a packed uint16 ArrayRecord MLM dataset
(:mod:`lmscale_jax.prep.prepare`)."""

from __future__ import annotations

import argparse
import json

from lmscale_jax.cli.args import Parser, guarded, number
from lmscale_jax.prep import options as prep_options
from lmscale_jax.prep import prepare
from lmscale_jax.store import dataset


def parser(kind: str) -> argparse.ArgumentParser:
  what = "ELF files or directories" if kind == "binary" else ".txt / .jsonl files"
  p = Parser(description=f"Prepare a packed uint16 ArrayRecord MLM dataset from {what}.")
  p.add_argument("--input", nargs="+", required=True, metavar="PATH", help=what)
  p.add_argument("--output", required=True, metavar="DIR", help="dataset directory to create")
  p.add_argument("--seq-len", type=number(int, *prep_options.SEQ_LEN), default=512)
  p.add_argument("--vocab-size", type=number(int, 7, 65535),
                 default=8192 if kind == "binary" else 30522,
                 help="tokenizer vocabulary to train (<= 65535; at least the 6 special "
                 "tokens and the corpus's alphabet, BPE's 256 bytes: a smaller one is refused)")
  p.add_argument("--tokenizer", default="", metavar="tokenizer.json",
                 help="use this tokenizer instead of training one")
  p.add_argument("--tokenizer-model", choices=["wordpiece", "bpe"], default="wordpiece")
  p.add_argument("--tokenizer-sample-mb", type=number(int, 1, 1 << 20), default=64,
                 help="train the tokenizer on about N MB of the deduplicated corpus (every "
                 "k-th function/document, so the sample spans all inputs)")
  p.add_argument("--workers", type=number(int, 0, prep_options.MAX_WORKERS), default=0,
                 help="processes (0 = all cores; at most the CPUs this process may use)")
  p.add_argument("--max-input-bytes", type=number(int, 0, 1 << 62), default=0,
                 help="take input files, in order, while they fit in this many bytes; "
                 "one that would not is skipped, the first too (0 = no limit)")
  p.add_argument("--packing", choices=["greedy", "none"], default="greedy")
  p.add_argument("--compression", choices=list(dataset.COMPRESSIONS), default="zstd",
                 help="each record's compression in the shards (docs/data-preparation.md: "
                 "size against prepare and read speed)")
  p.add_argument("--shard-size-mb", type=number(float, *prep_options.SIZE_MB), default=64)
  p.add_argument("--chunk-mb", type=number(float, *prep_options.SIZE_MB), default=32,
                 help="corpus chunk size (what a resumed run keeps of the extraction)")
  p.add_argument("--val-fraction", type=number(float, *prep_options.VAL_FRACTION),
                 default=0.01,
                 help="share of functions/documents in the validation split")
  p.add_argument("--overwrite", action="store_true",
                 help="replace the dataset an earlier run wrote there (only its own files)")
  p.add_argument("--no-progress", action="store_true")
  if kind == "text":
    p.add_argument("--text-field", default="text", help=".jsonl field holding the text")
    p.add_argument("--txt-docs", choices=["line", "blank"], default="line",
                   help=".txt documents: one per line, or separated by blank lines")
    p.add_argument("--lowercase", action="store_true")
  return p


def options(kind: str, a: argparse.Namespace) -> prep_options.Options:
  return prep_options.Options(
      kind=kind, inputs=a.input, output=a.output, seq_len=a.seq_len, vocab_size=a.vocab_size,
      tokenizer=a.tokenizer, tokenizer_model=a.tokenizer_model,
      tokenizer_sample_mb=a.tokenizer_sample_mb, workers=a.workers, compression=a.compression,
      max_input_bytes=a.max_input_bytes, packing=a.packing, shard_size_mb=a.shard_size_mb,
      chunk_mb=a.chunk_mb,
      val_fraction=a.val_fraction, overwrite=a.overwrite, progress=not a.no_progress,
      **({"text_field": a.text_field, "txt_docs": a.txt_docs, "lowercase": a.lowercase}
         if kind == "text" else {}))


def run(kind: str, argv=None) -> int:
  a = parser(kind).parse_args(argv)
  opts = options(kind, a)

  def go() -> int:
    stats = prepare.prepare(opts)
    print(json.dumps(stats, indent=2))
    return 0

  return guarded(go, f"rerun the same command to resume the preparation in {a.output}")
