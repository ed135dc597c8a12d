"""The largest per-device batch whose training step fits a device-memory budget, per lever.

  lmscale max-batch --config configs/bert350m.py --budget-gb 80
  lmscale max-batch --table --budget-gb 80 --json out.jsonl   # 120M / 350M / 1B

Peak memory comes from the compiler, not from running anything: the jitted training step is
lowered with abstract (shape-only) state and batch and compiled, and
``compiled.memory_analysis()`` gives argument, output, alias and temporary sizes; the peak is
arguments + outputs - donated aliases + temporaries (``flops.peak_bytes``). Nothing is
allocated, so the 1B model is measured on any machine that can compile it.

Search: the step's memory is affine in the batch (state + per-sequence activations), so two
compilations (``--probe``, default 4 and 8 microbatch sequences) fit it, the fit predicts the
largest batch, and that prediction is then checked by compiling at it (and one more
sequence's worth above it), walking down or up until the boundary is found (usually 2-3 more
compilations). Batches are multiples of ``train.grad_accum_steps``.

The numbers are the backend's own: on a GPU they are XLA:GPU's buffer assignment with cuDNN
flash attention; on a CPU (here, CI) XLA:CPU's, with XLA attention that materialises the
[B,N,S,S] scores and a scheduler that realises less of the remat savings -- a CPU table
ranks the levers but is not a GPU budget. The runtime's own reservation (CUDA context, cuDNN
workspaces, allocator fragmentation) is not included: keep ``--budget-gb`` a few GB under the
card. ``train.fsdp`` needs several devices; on CPU ``--devices N`` simulates N.

Levers (``--levers``, comma-separated, ``+`` combines): plain, remat_dots, remat_full,
accumN (train.grad_accum_steps=N), fsdp, bf16reduce (train.grad_allreduce_dtype=bfloat16).
"""

from __future__ import annotations

import sys

from lmscale_jax.cli import args  # no jax: configure_backend still comes first
from lmscale_jax.study import max_batch as mb
from lmscale_jax.study.max_batch import TABLE_LEVERS, TABLE_MODELS
# tests/test_levers.py searches with this command's max_batch: it stays reachable here.
from lmscale_jax.study.max_batch import max_batch  # noqa: F401


def parse_args(argv=None):
  ap = args.Parser(prog="lmscale max-batch", description=__doc__.split("\n\n")[0])
  ap.add_argument("--config", help="config file (configs/*.py) or a shipped config's name")
  ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                  help="config override, e.g. model.layers=20 (repeatable)")
  ap.add_argument("--name", help="model label in the output (default: the config's stem)")
  ap.add_argument("--table", action="store_true",
                  help=f"every model of {sorted(TABLE_MODELS)} with every lever")
  ap.add_argument("--models", default=",".join(TABLE_MODELS), help="--table models")
  ap.add_argument("--levers", default=None,
                  help=f"comma-separated levers (default plain; --table: {TABLE_LEVERS})")
  ap.add_argument("--budget-gb", type=float, default=80.0, help="device memory budget, GiB")
  ap.add_argument("--seq", type=int, default=512)
  ap.add_argument("--vocab", type=int, default=22016, help="vocabulary size (peer default)")
  ap.add_argument("--devices", type=int, default=0,
                  help="CPU only: simulate this many devices (needed for fsdp)")
  ap.add_argument("--probe", default="4,8", help="microbatch sizes of the two fit points")
  ap.add_argument("--max-batch", type=int, default=4096, help="search bound per device")
  ap.add_argument("--granularity", type=int, default=1,
                  help="batches are multiples of this (and of grad_accum_steps): fewer "
                       "compilations for a coarser answer")
  ap.add_argument("--fit-only", action="store_true",
                  help="two compilations per entry: report the affine fit's prediction "
                       "(max_per_device_fit), unverified")
  ap.add_argument("--json", type=args.append_file,
                  help="append one JSON object per (model, lever) to this file")
  ap.add_argument("--render", type=args.input_file, metavar="JSONL",
                  help="only print the table of a --json file")
  return ap.parse_args(argv)


def main(argv=None) -> int:
  o = mb.MaxBatchOptions(**vars(parse_args(argv)))
  if o.render:
    print(mb.table(mb.read_rows(o.render)))
    return 0
  mb.configure_backend(o.devices)  # before anything imports jax

  def go() -> int:
    rows = mb.run(o)  # a bad lever or no model: one line
    print("\n" + mb.summary(o, rows))
    print(mb.table(rows))
    return 0

  return args.guarded(go, "the rows already appended to --json are kept")


if __name__ == "__main__":
  sys.exit(main())
