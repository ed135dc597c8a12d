"""Prepare a packed uint16 ArrayRecord MLM dataset from a corpus (lmscale_jax/prep/prepare.py).

  lmscale prepare binary --input /usr/lib/x86_64-linux-gnu /usr/bin --output data/bin
  lmscale prepare text --input corpus.jsonl --text-field text --output data/text
  lmscale prepare cluster STAGE …

binary: ELF functions, disassembled and normalised; text: .txt / .jsonl documents, tokenized;
both packed into shards (lmscale prepare binary --help for the options). cluster: the same
dataset, byte for byte, as stages of Slurm job arrays (lmscale prepare cluster --help).
"""

from __future__ import annotations

import argparse
import json
import sys

from lmscale_jax import exits
from lmscale_jax.cli import args
from lmscale_jax.prep import cluster_extract, cluster_stages, prepare, worker_pool
from lmscale_jax.prep import options as prep_options
from lmscale_jax.prep.elf import eh_frame
from lmscale_jax.store import dataset

CLUSTER_HELP = """Data preparation as stages of Slurm job arrays: lmscale prepare binary's (or
text's) output byte for byte, the work spread over nodes (launch/prepare.sbatch runs the whole
chain).

  lmscale prepare cluster plan --input DIR… --output OUT [lmscale prepare binary's options]
                               [--kind text] [--slices 64] [--buckets 64]
  lmscale prepare cluster extract|dedup|pack|shards --output OUT [--task I --tasks N]
                                                    [--workers W]
  lmscale prepare cluster layout|finish|status --output OUT [--workers W]

--task/--tasks default to Slurm's SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT (else 0 of 1);
--workers to SLURM_CPUS_PER_TASK (else all cores). Each array task takes a contiguous share of
its stage's units; a rerun redoes only the units without a completion marker.
"""


def parser(kind: str) -> argparse.ArgumentParser:
  what = "ELF files or directories" if kind == "binary" else ".txt / .jsonl files"
  p = args.Parser(prog=f"lmscale prepare {kind}",
                  description=f"Prepare a packed uint16 ArrayRecord MLM dataset from {what}.")
  p.add_argument("--input", nargs="+", required=True, metavar="PATH", help=what)
  p.add_argument("--output", required=True, metavar="DIR", help="dataset directory to create")
  p.add_argument("--seq-len", type=args.number(int, *prep_options.SEQ_LEN), default=512)
  p.add_argument("--vocab-size", type=args.number(int, 7, 65535), default=None,
                 help="tokenizer vocabulary to train, at most (<= 65535; default "
                 f"{prep_options.DEFAULT_VOCAB[kind]}; at least the 6 special tokens and the "
                 "corpus's alphabet, BPE's 256 bytes: a smaller one is refused)")
  p.add_argument("--tokenizer", default="", metavar="tokenizer.json",
                 help="use this tokenizer instead of training one")
  p.add_argument("--tokenizer-model", choices=["wordpiece", "bpe"], default="wordpiece")
  p.add_argument("--tokenizer-sample-mb", type=args.number(int, 1, 1 << 20), default=64,
                 help="train the tokenizer on about N MB of the deduplicated corpus (every "
                 "k-th function/document, so the sample spans all inputs)")
  p.add_argument("--workers", type=args.number(int, 0, prep_options.MAX_WORKERS), default=0,
                 help="processes (0 = all cores; at most the CPUs this process may use)")
  p.add_argument("--max-input-bytes", type=args.number(int, 0, 1 << 62), default=0,
                 help="take input files, in order, while they fit in this many bytes; "
                 "one that would not is skipped, the first too (0 = no limit)")
  p.add_argument("--packing", choices=["greedy", "none"], default="greedy")
  p.add_argument("--compression", choices=list(dataset.COMPRESSIONS), default="zstd",
                 help="each record's compression in the shards (docs/data-preparation.md: "
                 "size against prepare and read speed)")
  p.add_argument("--shard-size-mb", type=args.number(float, *prep_options.SIZE_MB), default=64)
  p.add_argument("--chunk-mb", type=args.number(float, *prep_options.SIZE_MB), default=32,
                 help="corpus chunk size (what a resumed run keeps of the extraction)")
  p.add_argument("--val-fraction", type=args.number(float, *prep_options.VAL_FRACTION),
                 default=0.01,
                 help="share of functions/documents in the validation split")
  p.add_argument("--overwrite", action="store_true",
                 help="replace the dataset an earlier run wrote there (only its own files), "
                 "once the new one is complete: until then both are on the disk")
  p.add_argument("--no-progress", action="store_true")
  if kind == "binary":
    p.add_argument("--functions", choices=list(eh_frame.SOURCES), default="auto",
                   help=eh_frame.SOURCES_HELP)
  if kind == "text":
    p.add_argument("--text-field", default="text", help=".jsonl field holding the text")
    p.add_argument("--txt-docs", choices=["line", "blank"], default="line",
                   help=".txt documents: one per line, or separated by blank lines")
    p.add_argument("--lowercase", action="store_true")
  return p


def options(kind: str, a: argparse.Namespace) -> prep_options.PrepareOptions:
  return prep_options.PrepareOptions(
      kind=kind, inputs=a.input, output=a.output, seq_len=a.seq_len,
      vocab_size=prep_options.DEFAULT_VOCAB[kind] if a.vocab_size is None else a.vocab_size,
      vocab_size_given=a.vocab_size is not None,
      tokenizer=a.tokenizer, tokenizer_model=a.tokenizer_model,
      tokenizer_sample_mb=a.tokenizer_sample_mb, workers=a.workers, compression=a.compression,
      max_input_bytes=a.max_input_bytes, packing=a.packing, shard_size_mb=a.shard_size_mb,
      chunk_mb=a.chunk_mb,
      val_fraction=a.val_fraction, overwrite=a.overwrite, progress=not a.no_progress,
      **({"text_field": a.text_field, "txt_docs": a.txt_docs, "lowercase": a.lowercase}
         if kind == "text" else {"functions": a.functions}))


def run(kind: str, argv=None) -> int:
  a = parser(kind).parse_args(argv)
  opts = options(kind, a)

  def go() -> int:
    stats = prepare.prepare(opts)
    print(json.dumps(stats, indent=2))
    return 0

  return args.guarded(go, f"rerun the same command to resume the preparation in {a.output}")


# lmscale prepare cluster: the stages (lmscale_jax/prep/cluster_extract.py, cluster_stages.py)

ARRAY_STAGES = ("extract", "dedup", "pack", "shards")


def _plan(argv) -> int:
  kind = "text" if "--kind=text" in argv or "--kind text" in " ".join(argv) else "binary"
  p = parser(kind)
  p.prog = "lmscale prepare cluster plan"
  p.add_argument("--kind", choices=["binary", "text"], default="binary")
  p.add_argument("--slices", type=args.number(int, 1, 1 << 20), default=64,
                 help="units of extraction (the resume granularity of the extract stage)")
  p.add_argument("--buckets", type=args.number(int, 1, 1 << 16), default=64,
                 help="hash partitions of the duplicate check (units of the dedup stage)")
  a = p.parse_args(argv)
  o = options(kind, a)

  def go() -> int:
    plan = cluster_extract.plan(o, a.slices, a.buckets)
    print(f"plan: {len(plan['files'])} input files, {len(plan['tasks'])} extraction tasks in "
          f"{len(plan['slices'])} slices, {plan['buckets']} buckets; next: the extract stage")
    return 0

  return args.guarded(go, "rerun the same command")


def _stage(stage: str, argv) -> int:
  p = args.Parser(prog=f"lmscale prepare cluster {stage}")
  p.add_argument("--output", required=True, metavar="DIR")
  if stage in ARRAY_STAGES:
    args.add_array_task(p)
  p.add_argument("--workers", type=args.number(int, 0, prep_options.MAX_WORKERS),
                 default=args.env_int("SLURM_CPUS_PER_TASK", 0), help="processes (0 = all cores)")
  a = p.parse_args(argv)
  workers = worker_pool.usable_workers(a.workers)

  def go() -> int:
    if stage == "extract":
      cluster_extract.extract(a.output, a.task, a.tasks, workers)
    elif stage == "dedup":
      cluster_extract.dedup(a.output, a.task, a.tasks)
    elif stage == "layout":
      cluster_stages.layout(a.output, workers)
    elif stage == "pack":
      cluster_stages.pack(a.output, a.task, a.tasks, workers)
    elif stage == "shards":
      cluster_stages.shards(a.output, a.task, a.tasks, workers)
    elif stage == "finish":
      print(json.dumps(cluster_stages.finish(a.output), indent=2))
    else:
      print("\n".join(cluster_stages.status(a.output)))
    return 0

  return args.guarded(go, f"rerun the {stage} stage: it redoes only what is missing")


def cluster(argv) -> int:
  stages = [s for s in cluster_stages.STAGES] + ["status"]
  if argv and argv[0] in ("-h", "--help"):
    print(CLUSTER_HELP.strip())
    return 0
  if not argv:
    return exits.error_line(f"give a stage: one of {', '.join(stages)} (see lmscale prepare "
                            "cluster --help)", exits.EXIT_USAGE)
  if argv[0] not in stages:
    return exits.error_line(f"stage {argv[0]!r}: expected one of {', '.join(stages)} (see "
                            "lmscale prepare cluster --help)", exits.EXIT_USAGE)
  return _plan(argv[1:]) if argv[0] == "plan" else _stage(argv[0], argv[1:])


KINDS = ("binary", "text", "cluster")


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv and argv[0] in ("-h", "--help"):
    print(__doc__.strip())
    return 0
  if not argv or argv[0] not in KINDS:
    got = f"{argv[0]!r}: expected" if argv else "give a kind:"
    return exits.error_line(f"{got} one of {', '.join(KINDS)} (see lmscale prepare --help)",
                            exits.EXIT_USAGE)
  return cluster(argv[1:]) if argv[0] == "cluster" else run(argv[0], argv[1:])


if __name__ == "__main__":
  sys.exit(main())
