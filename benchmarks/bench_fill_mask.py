"""Peak memory and time of ``lmscale fill-mask --elf F --function NAME`` against the function's
length: each instruction masked in a window of at most seq_len tokens around it, built a batch
at a time (``inference/mask_predictions.fill_mnemonics``), against the algorithm before it
(issue 55: one text per instruction, each the whole function, all built first), in one run:

  python benchmarks/bench_fill_mask.py (--workdir RUN | --hf DIR) [--sizes 500 2000 8000 32000]
      [--old-max 2000] [--out benchmarks/results/DATE-cpu-fill-mask-memory.json]

The functions are synthetic, assembled by the system compiler (gcc): N instructions of loads,
adds, xors and stores, one symbol. Each measurement is its own process, so its peak resident
memory (``os.wait4``'s ru_maxrss) is its own: the new algorithm is the installed command itself
(``lmscale fill-mask … --json``), the old one this file run as ``--old-child`` (the code as it
was, the same model loading and the same batched forward pass). The old algorithm is
quadratic, so it is run only up to --old-max instructions. A ``--text`` fill-mask is measured
too: what loading the model costs whatever the function. Memory and time do not depend on what
the model learned, only on its seq_len and size.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import _host  # noqa: E402
from lmscale_jax.cli import args  # noqa: E402

FUNCTION = "longfn"
BODY = ("  mov {k}(%rdi),%eax", "  add %esi,%eax", "  xor $0x{x:x},%eax", "  mov %eax,{k}(%rdi)")


def parser() -> args.Parser:
  p = args.Parser(description=__doc__.split("\n\n")[0])
  args.add_model_source(p)
  p.add_argument("--sizes", type=args.number(int, 3, 1 << 24), nargs="+",
                 default=[500, 2000, 8000, 32000], help="instructions per function")
  p.add_argument("--old-max", type=args.number(int, 0, 1 << 24), default=2000,
                 help="the largest function the old (quadratic) algorithm is run on")
  p.add_argument("--out", default="", help="append the result here (.json: one list)")
  p.add_argument("--old-child", nargs=2, metavar=("ELF", "NAME"), help=argparse.SUPPRESS)
  return p


def assemble(folder: str, n: int) -> str:
  """A shared library holding FUNCTION: ``n`` instructions (push, mov, the body, pop, ret)."""
  lines = [".text", f".globl {FUNCTION}", f".type {FUNCTION},@function", f"{FUNCTION}:",
           "  push %rbp", "  mov %rsp,%rbp"]
  lines += [BODY[i % 4].format(k=4 * (i // 4 % 500), x=i % 251) for i in range(n - 4)]
  lines += ["  pop %rbp", "  ret", f".size {FUNCTION}, .-{FUNCTION}", ""]
  source, out = os.path.join(folder, f"f{n}.s"), os.path.join(folder, f"f{n}.so")
  with open(source, "w") as f:
    f.write("\n".join(lines))
  subprocess.run(["gcc", "-shared", "-nostdlib", "-o", out, source], check=True, timeout=600)
  return out


def measured(argv: list[str]) -> dict:
  """Wall seconds and peak RSS (MB) of one process, and its stdout."""
  start = time.perf_counter()
  p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                       env={**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS",
                                                                          "cpu")})
  out = p.stdout.read()
  _, status, usage = os.wait4(p.pid, 0)
  p.returncode = os.waitstatus_to_exitcode(status)
  if p.returncode:
    raise SystemExit(f"error: {' '.join(argv)} exited {p.returncode}")
  return {"seconds": round(time.perf_counter() - start, 2),
          "max_rss_mb": round(usage.ru_maxrss / 1024, 1), "stdout": out}


def model_argv(a) -> list[str]:
  out = ["--workdir", a.workdir] if a.workdir else ["--hf", a.hf]
  return out + (["--step", str(a.step)] if a.step is not None else []) + (
      ["--tokenizer", a.tokenizer] if a.tokenizer else [])


def run_new(a, elf: str) -> dict:
  r = measured([sys.executable, "-m", "lmscale_jax.cli.lmscale", "fill-mask", *model_argv(a),
                "--elf", elf, "--function", FUNCTION, "--json"])
  done = json.loads(r.pop("stdout"))
  return {**r, "instructions": done["instructions"], "evaluated": done["evaluated"]}


def run_old(a, elf: str) -> dict:
  r = measured([sys.executable, os.path.abspath(__file__), *model_argv(a), "--old-child", elf,
                FUNCTION])
  done = json.loads(r.pop("stdout"))
  return {**r, **done}


def old_child(a) -> int:
  """The algorithm before (cli/fill_mask.py at 6eac3c3): every text built, then predicted."""
  from lmscale_jax.inference import mask_predictions, trained_model
  from lmscale_jax.prep.elf import elf_functions
  from lmscale_jax.store.dataset import NEXT

  model = trained_model.load(a.workdir, a.hf, a.step, a.tokenizer)
  insns = elf_functions.functions(a.old_child[0], only=a.old_child[1])[0].instructions
  texts, targets = [], []
  for i, insn in enumerate(insns):
    masked, pieces = mask_predictions.mask_mnemonic(model, insn)
    texts.append(f" {NEXT} ".join(insns[:i] + [masked] + insns[i + 1:]))
    targets.append(pieces)
  preds = mask_predictions.predict(model, texts, 1)
  evaluated = sum(len(p) >= len(w) for w, p in zip(targets, preds))
  print(json.dumps({"instructions": len(insns), "evaluated": evaluated}))
  return 0


def measure(a) -> dict:
  from lmscale_jax.inference import trained_model

  cfg = trained_model.load(a.workdir, a.hf, a.step, a.tokenizer).cfg
  text = measured([sys.executable, "-m", "lmscale_jax.cli.lmscale", "fill-mask", *model_argv(a),
                   "--text", "push rbp [NEXT] [MASK] rbp rsp", "--json"])
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for n in a.sizes:
      elf = assemble(tmp, n)
      rows.append({"algorithm": "window", **run_new(a, elf)})
      if n <= a.old_max:
        rows.append({"algorithm": "whole function (before)", **run_old(a, elf)})
      print(json.dumps(rows[-1]), file=sys.stderr)
  return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "device": "cpu", "host": _host.cpu_name(), "code": _host.code_version(),
          "model": a.workdir or a.hf, "seq_len": int(cfg.seq_len), "layers": int(cfg.layers),
          "hidden": int(cfg.hidden),
          "text_only": {k: v for k, v in text.items() if k != "stdout"}, "rows": rows}


def main(argv=None) -> int:
  a = parser().parse_args(argv)
  if bool(a.workdir) == bool(a.hf):
    print("error: give exactly one of --workdir RUN and --hf DIR", file=sys.stderr)
    return 1
  if a.old_child:
    return old_child(a)
  row = measure(a)
  print(json.dumps(row, indent=1))
  if a.out:
    _host.append_result(a.out, row)
  return 0


if __name__ == "__main__":
  sys.exit(main())
