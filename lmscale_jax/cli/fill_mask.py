"""Top-k predictions for each [MASK] of a text, from a training run or an exported model.

  lmscale fill-mask (--workdir DIR [--step N] | --hf OUT) --text "…[MASK]…"
      [--top-k 5] [--json]
  lmscale fill-mask (--workdir DIR | --hf OUT) --elf FILE --function NAME [--json]

The text is wrapped as [CLS] … [SEP], as in training; for binary code it is pretokenised
instruction text (`push rbp [NEXT] mov rbp rsp [NEXT] [MASK] rsp 0x10`). With --elf, the
function is taken from the binary as preparation takes it, each instruction's mnemonic is
masked in turn (one [MASK] per token piece) in the stretch of the function around it that fits
the model's sequence length (the whole function where it fits), and the top-1 accuracy is
printed.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from lmscale_jax.cli import args
from lmscale_jax.prep.elf import elf_functions


def parser() -> argparse.ArgumentParser:
  p = args.Parser(prog="lmscale fill-mask", description=__doc__.splitlines()[0])
  args.add_model_source(p)
  p.add_argument("--text", default=None, type=args.text, help="text with one or more [MASK]")
  p.add_argument("--elf", default=None, type=args.input_file, metavar="FILE",
                 help="an x86-64 ELF file")
  p.add_argument("--function", default=None, metavar="NAME", help="(--elf) its symbol name")
  p.add_argument("--top-k", type=args.number(int, 1, 1000), default=5)
  p.add_argument("--json", action="store_true", help="print JSON")
  return p


def fill_function(model, path: str, name: str) -> dict:
  from lmscale_jax.inference import mask_predictions

  fn = elf_functions.functions(path, only=name)[0]
  insns = fn.instructions
  rows = []
  for insn, (want, preds) in zip(insns, mask_predictions.fill_mnemonics(model, insns)):
    if len(preds) < len(want):  # an instruction longer than seq_len alone: not evaluated
      continue
    got = [p[0]["id"] for p in preds]
    rows.append({"instruction": insn, "predicted": model.tokenizer.decode(got),
                 "probability": float(np.prod([p[0]["probability"] for p in preds])),
                 "correct": got == want})
  correct = sum(r["correct"] for r in rows)
  return {"file": path, "function": name, "instructions": len(insns), "evaluated": len(rows),
          "correct": correct, "accuracy": correct / max(len(rows), 1), "rows": rows}


def show_text(preds: list[list[dict]]) -> None:
  for i, top in enumerate(preds):
    print(f"[MASK] {i + 1}: " + "  ".join(f"{p['token']} {p['probability']:.3f}" for p in top))


def show_function(r: dict) -> None:
  for row in r["rows"]:
    mark = "ok " if row["correct"] else "   "
    print(f"{mark}{row['instruction']:<48} -> {row['predicted']} ({row['probability']:.3f})")
  print(f"{r['function']} in {r['file']}: mnemonic top-1 accuracy {r['correct']}/"
        f"{r['evaluated']} ({100 * r['accuracy']:.1f}%) over {r['instructions']} instructions")


def main(argv=None) -> int:
  parser_ = parser()
  a = parser_.parse_args(argv)
  if (a.text is None) == (a.elf is None):
    parser_.error("give --text TEXT, or --elf FILE with --function NAME")
  if a.elf is not None and not a.function:
    parser_.error("--elf needs --function NAME (the symbol to take from the binary)")
  if a.text is not None and "[MASK]" not in a.text:
    parser_.error("--text has no [MASK]: put [MASK] where a token should be predicted")

  def go() -> int:
    # JAX and the model here, not at module level: --help answers without them (~1.3 s).
    from lmscale_jax.inference import mask_predictions, trained_model

    model = trained_model.load(a.workdir, a.hf, a.step, a.tokenizer)
    if a.text is not None:
      preds = mask_predictions.fill_text(model, a.text, a.top_k)
      print(json.dumps(preds)) if a.json else show_text(preds)
    else:
      r = fill_function(model, a.elf, a.function)
      print(json.dumps(r)) if a.json else show_function(r)
    return 0

  return args.guarded(go, "nothing was written")


if __name__ == "__main__":
  sys.exit(main())
