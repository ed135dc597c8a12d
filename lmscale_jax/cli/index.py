"""A function index of ELF binaries on disk, for lmscale search.

  lmscale index (--workdir RUN [--step N] | --hf DIR) --elf FILE [FILE …] --output INDEX_DIR

Every named function of each binary is embedded as lmscale embed embeds it and kept with its
name, address, size, instruction and token counts (lmscale_jax/search/index_files.py: the
layout). Incremental: a binary already in the index (by sha256) is skipped; a rerun after a
crash continues. An index built by another model is refused.
"""

from __future__ import annotations

import argparse
import sys

from lmscale_jax.cli import args
from lmscale_jax.inference import trained_model
from lmscale_jax.search import index


def parser() -> argparse.ArgumentParser:
  p = args.Parser(prog="lmscale index", description=__doc__.splitlines()[0])
  args.add_model_source(p)
  p.add_argument("--elf", nargs="+", required=True, type=args.input_file, metavar="FILE",
                 help="x86-64 ELF files")
  p.add_argument("--output", required=True, type=args.output_dir, metavar="INDEX_DIR")
  return p


def main(argv=None) -> int:
  a = parser().parse_args(argv)

  def go() -> int:
    model = trained_model.load(a.workdir, a.hf, a.step, a.tokenizer)
    done = index.build(model, a.elf, a.output)
    print(f"{a.output}: added {len(done['added'])} binaries ({done['functions']} functions), "
          f"{len(done['skipped'])} already indexed")
    return 0

  return args.guarded(go, f"{a.output} holds every binary indexed so far; rerun to continue")


if __name__ == "__main__":
  sys.exit(main())
