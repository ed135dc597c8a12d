"""Suggest names for the functions of an ELF file with a naming fine-tune.

  lmscale name (--workdir RUN [--step N] | --hf DIR) --elf FILE
      [--function NAME | --address ADDR] [--top 5] [--json OUT.json] [--batch-size 64]

RUN is a lmscale finetune --task name workdir, DIR its lmscale export-hf directory (the same
suggestions: the export carries the vocabulary as id2label and the rule in config.json). Every
function of FILE (a stripped file's too: found by .eh_frame, named sub_<hex address>), or the
one named (a symbol name or sub_<hex>) or starting at ADDR, is read as the model saw
functions in training; for each, the suggested name (the sub-tokens the run's prediction rule
keeps, joined by "_": the rule chosen on held-out training libraries, its naming_eval.json)
and the --top best sub-tokens with their scores, as a table or (--json) one object per
function, with the names it calls that the file shows stripped (imports, exports). A run
trained on names with "calls" whose rule reads them scores its own best sub-tokens and the
called names' together, by the gate its rule carries (docs/naming.md, "A rule chosen across
libraries, and a gate").
"""

from __future__ import annotations

import argparse
import os
import sys

from lmscale_jax.cli import args
from lmscale_jax.errors import UserError
from lmscale_jax.store import output_marks

TOOL = "lmscale name"  # the parser's prog, and the mark its --json carries


def address(text: str) -> int:
  try:
    return int(text, 16)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r}: expected a hexadecimal address (0x401000)")


def parser() -> argparse.ArgumentParser:
  p = args.Parser(prog=TOOL, description=__doc__.splitlines()[0])
  model = p.add_mutually_exclusive_group(required=True)
  model.add_argument("--workdir", help="a lmscale finetune --task name run")
  model.add_argument("--hf", metavar="DIR", help="its lmscale export-hf directory")
  p.add_argument("--step", type=args.number(int, 0, 1 << 62), default=None,
                 help="its checkpoint; default the latest")
  p.add_argument("--elf", required=True, type=args.input_file, metavar="FILE",
                 help="an x86-64 ELF file (stripped or not)")
  which = p.add_mutually_exclusive_group()
  which.add_argument("--function", metavar="NAME", help="only this function (symbol name or "
                     "sub_<hex address>)")
  which.add_argument("--address", type=address, metavar="ADDR",
                     help="only the function starting at this hexadecimal address")
  p.add_argument("--top", type=args.number(int, 1, 1000), default=5,
                 help="sub-token suggestions per function")
  p.add_argument("--json", default="", type=args.output_file, metavar="OUT.json",
                 help="write the suggestions as JSON")
  p.add_argument("--batch-size", "--batch_size", dest="batch_size", default=None,
                 type=args.number(int, 1, 1 << 16),
                 help="functions per forward pass (default 64: the server's too)")
  return p


def load(a):
  from lmscale_jax.inference import name_suggestions

  if a.hf and a.step is not None:
    raise UserError("--step is a training run's checkpoint: give it with --workdir, not --hf")
  return name_suggestions.load(a.workdir, a.hf, a.step)


def functions(a) -> list:
  from lmscale_jax.prep.elf import elf_functions

  found = elf_functions.functions(a.elf, only=a.function)
  if a.address is not None:
    found = [f for f in found if f.address == a.address]
    if not found:
      raise UserError(f"{a.elf}: no function starts at {a.address:#x} (lmscale name --elf "
                      f"{a.elf} lists them)")
  if not found:
    raise UserError(f"{a.elf}: no x86-64 function with code to name")
  return found


def file_shares(a, found: list, called: dict) -> dict | None:
  """The namespace of the whole file (callee_copy.file_shares), whichever functions are named."""
  from lmscale_jax.inference import callee_copy
  from lmscale_jax.prep.elf import elf_functions

  whole = a.function is None and a.address is None
  every = found if whole else elf_functions.functions(a.elf)
  return callee_copy.file_shares([called.get(f.address, []) for f in every])


def suggest(a) -> dict:
  """Every wanted function's suggestions (inference/name_suggestions: the server's too)."""
  from lmscale_jax.inference import name_suggestions

  from lmscale_jax.prep.elf import call_names

  found = functions(a)  # before the model: a bad file costs nothing
  namer = load(a)
  called = call_names.called(a.elf, source="auto")  # the names a stripped file still shows
  calls = [called.get(f.address, []) for f in found]
  named = name_suggestions.suggest(namer, [f.text for f in found], a.top,
                                   a.batch_size or name_suggestions.BATCH, calls,
                                   file_shares(a, found, called))
  return {"elf": os.path.abspath(a.elf), "model": a.workdir or a.hf, "step": namer.model.step,
          "rule": namer.rule, "functions": [
              {"function": f.name, "address": f"{f.address:#x}", **n, "calls": c}
              for f, n, c in zip(found, named, calls)]}


def table(out: dict) -> str:
  rows = [(f["address"], f["function"], f["suggested"] or "-",
           " ".join(f"{t}:{p:.2f}" for t, p in f["tokens"])) for f in out["functions"]]
  head = ("address", "function", "suggested", "best sub-tokens")
  widths = [max(len(r[i]) for r in [head, *rows]) for i in range(3)]
  return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3]
                   for r in [head, *rows])


def main(argv=None) -> int:
  a = parser().parse_args(argv)

  def go() -> int:
    out = suggest(a)
    if a.json:
      output_marks.write_json(a.json, TOOL, out)
      print(f"{len(out['functions'])} functions of {a.elf} named; wrote {a.json}")
    else:
      print(table(out))
    return 0

  return args.guarded(go, f"nothing was written to {a.json}" if a.json else "nothing named")


if __name__ == "__main__":
  sys.exit(main())
