"""GPU self-check: run it first on a GPU node, before any job.

  lmscale gpu-check                       # configs/bert120m.py, this node's GPUs
  lmscale gpu-check --config configs/bert350m.py --json out.json
  lmscale gpu-check --allow-cpu --config configs/tiny.py --seq 64 --vocab 512

Reports the devices and their kind; driver, CUDA, cuDNN and NCCL versions; cuDNN attention
against XLA attention on the same padded bf16 inputs (output and gradients); one compiled bf16
training step of the config at a small and at the default per-device batch (samples/s, MFU
against the device peak table); with more than one local GPU an all-reduce of the gradient's
size and its bus bandwidth. The last line is PASS or FAIL with the reason; exit 0 on PASS,
1 on FAIL or a bad argument (one line). Without a GPU it says so and fails, unless --allow-cpu
(tiny shapes, what the tests run). The logic is lmscale_jax/gpu/check.py.
"""

from __future__ import annotations

import json
import os
import sys

from lmscale_jax.cli import args
from lmscale_jax.config import loader

TOOL = "lmscale gpu-check"  # the parser's prog, and the mark its --json FILE carries

# The checkout (configs/ is there): lmscale_jax/cli/ is two levels below it.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
  p = args.Parser(prog=TOOL, description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="configs/bert120m.py", help="config file (configs/*.py)")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="config override, e.g. train.remat=dots (repeatable)")
  p.add_argument("--seq", type=args.number(int, 8, 1 << 16), default=0,
                 help="sequence length (default: the config's model.seq_len, else 512)")
  p.add_argument("--vocab", type=args.number(int, 16, 65535), default=22016,
                 help="vocabulary size of the synthetic batches")
  p.add_argument("--batch", type=args.number(int, 0, 1 << 16), default=0,
                 help="default per-device batch (0 = the config's train.batch_size over "
                      "this node's devices)")
  p.add_argument("--small-batch", type=args.number(int, 1, 1 << 16), default=8,
                 help="the small per-device batch")
  # Checked before the check runs (minutes on a GPU); "-" is stdout.
  p.add_argument("--json", nargs="?", const="-", type=args.OutputFile(stdout=True),
                 metavar="FILE",
                 help="write the report as JSON to FILE (no FILE: to stdout, and the "
                      "progress and PASS/FAIL lines to stderr)")
  p.add_argument("--allow-cpu", action="store_true",
                 help="run on the CPU when there is no GPU (for tests; use tiny shapes)")
  return p.parse_args(argv)


def main(argv=None) -> int:
  a = parse_args(argv)

  def go() -> int:
    config = loader.load(a.config, sets=["model.dtype=bfloat16"] + a.set, root=ROOT)
    from lmscale_jax.gpu import check as gpu_check
    from lmscale_jax.store import output_marks

    out = sys.stderr if a.json == "-" else sys.stdout
    log = lambda line: print(line, file=out, flush=True)
    report = gpu_check.run(config, seq_len=a.seq or int(config.model.seq_len) or 512,
                           vocab_size=a.vocab, small_batch=a.small_batch,
                           batch=a.batch, allow_cpu=a.allow_cpu, log=log)
    report["config"] = a.config
    report["overrides"] = a.set
    if a.json == "-":
      print(json.dumps(report))
    elif a.json:
      output_marks.write_json(a.json, TOOL, report)
    log(f"{report['result']}: {report['reason']}")
    return 0 if report["result"] == "PASS" else 1

  return args.guarded(go, "nothing was written")


if __name__ == "__main__":
  sys.exit(main())
