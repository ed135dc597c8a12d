"""A function index of ELF binaries on disk, for lmscale search.

  lmscale index (--workdir RUN [--step N] | --hf DIR) (--elf FILE [FILE …] | --elf-list LIST)
                --output INDEX_DIR [--task I --tasks N]
  lmscale index finish --output INDEX_DIR

Every named function of each binary is embedded as lmscale embed embeds it and kept with its
name, address, size, instruction and token counts (lmscale_jax/search/index_files.py: the
layout). Incremental: a binary already in the index (by sha256) is skipped; a rerun after a
crash continues, and rebuilds any shard that is missing or damaged (each is checked against the
sha256 index.json recorded), saying which. An index built by another model is refused. Every
file is checked before anything is written: one preparation skips (lmscale prepare's reasons
and names: not_elf, machine=…, abi=x32, corrupt, no_functions (a stripped binary, one with no
code), broken_link, not_regular, unreadable) is skipped, a line each, and counted per reason at
the end, so `--elf /usr/lib/x86_64-linux-gnu/*.so.*` indexes what it can; --strict refuses
such a file instead (one error line; a header that shows it: before anything is written).

A Slurm job array (launch/index.sbatch): --task/--tasks default to SLURM_ARRAY_TASK_ID /
SLURM_ARRAY_TASK_COUNT (else 0 of 1); with N > 1 each task embeds a contiguous share of the
binaries and leaves completion markers (a rerun redoes only what lacks one), and `finish`, run
once after all tasks, writes index.json: the index one node builds, byte for byte. An index over
the exact-search size (lmscale_jax/search/vector_search.py) gets its HNSW graph built at the
end, once, rather than by the first search.
"""

from __future__ import annotations

import argparse
import os
import sys

from lmscale_jax.cli import args
from lmscale_jax.errors import UserError
from lmscale_jax.store import file_io


def parser() -> argparse.ArgumentParser:
  p = args.Parser(prog="lmscale index", description=__doc__.splitlines()[0],
                  epilog="lmscale index finish --output INDEX_DIR: merge an array's tasks")
  args.add_model_source(p)
  which = p.add_mutually_exclusive_group(required=True)
  which.add_argument("--elf", nargs="+", type=named, metavar="FILE",
                     help="x86-64 ELF files (others are skipped and counted)")
  which.add_argument("--elf-list", type=args.input_file, metavar="LIST",
                     help="a text file of ELF paths, one a line (a corpus too long for a "
                     "command line)")
  p.add_argument("--output", required=True, type=args.output_dir, metavar="INDEX_DIR")
  p.add_argument("--strict", action="store_true", help="refuse a file preparation would skip "
                 "(not x86-64 ELF, no named function, …) instead of skipping and counting it")
  args.add_array_task(p, "; > 1: this task's share of the binaries, then lmscale index "
                      "finish once")
  return p


def named(text: str) -> str:
  """An argparse type: a path that is there (a link to nothing, a FIFO, a file not readable
  pass: index.build skips and counts them, as preparation does); a typo is one line."""
  if not os.path.lexists(text):
    raise argparse.ArgumentTypeError(f"{text!r}: no such file")
  return text


def listed(path: str) -> list[str]:
  """The paths of an --elf-list file (blank lines skipped), each checked as --elf checks it."""
  try:
    with open(path) as f:
      names = [line.strip() for line in f if line.strip()]
  except (OSError, ValueError) as e:  # UnicodeDecodeError: a binary given as the list
    raise UserError(f"--elf-list {path}: unreadable ({file_io.error_reason(e)}); expected a "
                    "text file, one ELF path a line") from None
  if not names:
    raise UserError(f"--elf-list {path}: no paths in it (expected one ELF path a line)")
  for name in names:
    try:
      named(name)
    except argparse.ArgumentTypeError as e:
      raise UserError(f"--elf-list {path}: {e}") from None
  return names


def skipped_note(files_skipped: dict) -> str:
  """", 8 files skipped (no_functions 7, machine=x86 1; --strict refuses them)", or ""."""
  if not files_skipped:
    return ""
  return (f", {sum(files_skipped.values())} files skipped ({reasons(files_skipped)}; --strict "
          "refuses them)")


def reasons(files_skipped: dict) -> str:
  return ", ".join(f"{reason} {n}" for reason, n in files_skipped.items())


def finish_parser() -> argparse.ArgumentParser:
  p = args.Parser(prog="lmscale index finish",
                  description="Merge the tasks of an index job array into index.json.")
  p.add_argument("--output", required=True, metavar="INDEX_DIR")
  return p


def finish(argv) -> int:
  a = finish_parser().parse_args(argv)

  def go() -> int:
    from lmscale_jax.search import index, index_array  # JAX: not for --help

    done = index_array.finish(a.output)
    print(f"{a.output}: added {done['added']} binaries ({done['functions']} functions)"
          f"{skipped_note(done['files_skipped'])}")
    index.prepare_search(a.output)
    return 0

  return args.guarded(go, "rerun lmscale index finish")


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv and argv[0] == "finish":
    return finish(argv[1:])
  a = parser().parse_args(argv)
  if a.task >= a.tasks:
    parser().error(f"--task {a.task}: expected 0 .. {a.tasks - 1} (--tasks {a.tasks})")

  def go() -> int:
    from lmscale_jax.inference import trained_model  # JAX: not for --help (~1.3 s)
    from lmscale_jax.search import index, index_array, index_files, query

    elf = a.elf or listed(a.elf_list)
    model = trained_model.load(a.workdir, a.hf, a.step, a.tokenizer)
    if a.tasks > 1:
      part = index_array.run_task(model, elf, a.output, a.task, a.tasks, strict=a.strict)
      print(f"{a.output}: task {a.task} of {a.tasks} embedded {len(part['binaries'])} binaries"
            f"{skipped_note(part['files_skipped'])}; lmscale index finish --output … once "
            "every task is done")
      return 0
    done = index.build(model, elf, a.output, strict=a.strict)
    if not os.path.exists(os.path.join(a.output, index_files.INDEX)):
      raise UserError(f"every file given was skipped ({reasons(done['files_skipped'])}): "
                      f"nothing to index, no {index_files.INDEX} written in {a.output}; give "
                      "x86-64 ELF files with function symbols")
    rebuilt = f"rebuilt {len(done['rebuilt'])} damaged shards, " if done["rebuilt"] else ""
    print(f"{a.output}: added {len(done['added'])} binaries ({done['functions']} functions), "
          f"{rebuilt}{len(done['skipped'])} already indexed"
          f"{skipped_note(done['files_skipped'])}")
    if done["added"] or done["rebuilt"]:
      index.prepare_search(a.output)
    warning = query.similarity_warning(model)  # at the end: a failed build says only why
    if warning:
      print(f"warning: {warning}", file=sys.stderr)
    return 0

  return args.guarded(go, f"{a.output} holds every binary indexed so far; rerun to continue")


if __name__ == "__main__":
  sys.exit(main())
