"""The functions of an index most like a query function (exact cosine search).

  lmscale search --index INDEX_DIR (--workdir RUN [--step N] | --hf DIR)
      (--elf FILE [--function NAME | --address 0xADDR] | --text "push rbp [NEXT] …")
      [--k 10] [--json OUT]

A query is every named function of an ELF file, one of them, or pretokenised assembly text;
the answer is, per query, the k best: score (cosine), binary, function name and address, as
rows and (--json) as a JSON file. The model must be the one that built the index.
"""

from __future__ import annotations

import argparse
import sys

from lmscale_jax.cli import args
from lmscale_jax.inference import trained_model
from lmscale_jax.search import query
from lmscale_jax.store import file_io


def address(text: str) -> int:
  try:
    return int(text, 16)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r}: expected a hexadecimal address (0x401000)")


def parser() -> argparse.ArgumentParser:
  p = args.Parser(prog="lmscale search", description=__doc__.splitlines()[0])
  p.add_argument("--index", required=True, metavar="INDEX_DIR", help="what lmscale index wrote")
  args.add_model_source(p)
  p.add_argument("--elf", default=None, type=args.input_file, metavar="FILE")
  which = p.add_mutually_exclusive_group()
  which.add_argument("--function", default=None, metavar="NAME", help="(--elf) one function")
  which.add_argument("--address", default=None, type=address, metavar="0xADDR",
                     help="(--elf) the function at this address")
  p.add_argument("--text", default=None, help="pretokenised assembly ([NEXT] between "
                 "instructions)")
  p.add_argument("--k", type=args.number(int, 1, 1 << 20), default=10)
  p.add_argument("--json", default=None, type=args.output_file, metavar="OUT")
  return p


def main(argv=None) -> int:
  parser_ = parser()
  a = parser_.parse_args(argv)
  if (a.elf is None) == (a.text is None):
    parser_.error("give --elf FILE or --text TEXT (one of them)")
  if a.elf is None and (a.function is not None or a.address is not None):
    parser_.error("--function and --address pick a function of --elf FILE")

  def go() -> int:
    model = trained_model.load(a.workdir, a.hf, a.step, a.tokenizer)
    corpus = query.load(a.index, model)
    queries = (query.elf_queries(a.elf, a.function, a.address) if a.elf is not None
               else [("text", None, a.text)])
    answers = query.search(model, corpus, queries, a.k)
    print(query.table(answers, model.cfg.seq_len))
    if a.json:
      file_io.atomic_write_json(a.json, {"index": a.index, "k": a.k, "queries": answers})
    return 0

  return args.guarded(go, "nothing was written")


if __name__ == "__main__":
  sys.exit(main())
