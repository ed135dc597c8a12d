"""A grid of short, bounded training runs, one JSON row per run (lmscale report plots them).

  lmscale sweep --data DATASET --config configs/tiny.py --processes 1,2 --workers 0,2 \
      --batch 8 --accum 1 --output benchmarks/results/2026-12-01-cpu-sweep.jsonl

Axes (every combination is one point): --processes, --workers (data.workers), --config (files)
× --model (named override sets, e.g. --model wide:model.hidden=256,model.ffn=1024), --batch
(per-device microbatch: sequences one device computes per forward/backward) and --accum
(train.grad_accum_steps); as in Hugging Face's Trainer, the global batch train.batch_size is
batch × accum × devices. --set KEY=VALUE overrides any other config key for every point.

Each run is short and bounded: --steps steps logged every --log-every, evaluation (1 batch) and
a checkpoint only at the last step, killed after --timeout seconds. Its row holds the medians,
over the logging windows after the first (start-up and compilation), of samples/s (global),
non-pad tokens/s, MFU (null on CPU), input-wait fraction and step time from the run's
metrics.jsonl, and the compiled peak device memory of its training step (one compilation per
distinct step, in one process with as many devices, before the runs: flops.peak_bytes). A run
that fails (out of memory, a launch failure, a timeout, an error) is a row with status
"failed" and the reason; the sweep goes on. With --budget-gb a point whose compiled peak
exceeds the budget is recorded as out-of-memory without running it (a device budget simulated
on CPU; on a GPU the run itself would fail). The results file is rewritten atomically after
every point, keeping one row per point; a rerun skips the points it holds (--retry-failed
reruns failed ones).

Run directories: --runs (default runs/sweep-<results stem>), one per point, named by the
point's key; a point rerun starts from an empty one. --tag labels a variant (e.g. other --env
thread settings) so that lmscale report keeps its series apart.

Launchers: "local" runs launch/local.sh N (CPU processes here, one GPU each where there are at
least N). "slurm" submits each point, one after the other, as `sbatch --wait
launch/slurm.sbatch …` (one task per GPU, --gpus-per-node per node; the job stages --data to
node-local disk as DATA_SRC; its time limit is --timeout rounded up to minutes; --slurm-arg
passes --partition and the like; --runs must be on storage every node sees; the peak-memory
compilation is off unless --probe, which compiles on this host's backend). --dry-run prints
every point's command and runs nothing.
"""

from __future__ import annotations

import argparse
import os
import sys

from lmscale_jax.cli import args
from lmscale_jax.study import report
from lmscale_jax.study import sweep as sw
from lmscale_jax.study import sweep_grid as sg


def int_list(flag: str, lo: int):
  def parse(text: str) -> list[int]:
    try:
      values = [int(x) for x in text.split(",")]
    except ValueError:
      values = []
    if not values or min(values) < lo:
      raise argparse.ArgumentTypeError(
          f"{flag} {text!r}: expected comma-separated integers >= {lo}")
    return sorted(set(values))
  return parse


def parse_args(argv=None):
  p = args.Parser(prog="lmscale sweep", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter,
                  epilog="Axes, measurements and launchers: see lmscale sweep's docstring.")
  p.add_argument("--data", required=True, metavar="DIR", help="a prepared dataset directory")
  # Rewritten after every point with every row it held kept: appended to, never replaced.
  p.add_argument("--output", required=True, type=args.append_file, metavar="JSONL",
                 help="results file (resumed)")
  p.add_argument("--config", type=lambda s: s.split(","), default=["configs/tiny.py"],
                 help="config file(s), comma-separated (default configs/tiny.py)")
  p.add_argument("--model", action="append", metavar="LABEL:KEY=V[,KEY=V]",
                 help="a model variant (repeatable; default: each config as it is)")
  p.add_argument("--processes", type=int_list("--processes", 1), default=[1])
  p.add_argument("--workers", type=int_list("--workers", 0), default=[0],
                 help="data.workers values")
  p.add_argument("--batch", type=int_list("--batch", 1), default=[8],
                 help="per-device microbatch sizes")
  p.add_argument("--accum", type=int_list("--accum", 1), default=[1],
                 help="train.grad_accum_steps values")
  p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                 help="config override for every point (repeatable)")
  p.add_argument("--steps", type=int_list("--steps", 2), default=[30])
  p.add_argument("--log-every", type=int_list("--log-every", 1), default=[5])
  p.add_argument("--timeout", type=int_list("--timeout", 10), default=[600],
                 help="seconds a point may run (Slurm: its time limit, minutes rounded up)")
  p.add_argument("--budget-gb", type=float, default=0.0,
                 help="record points whose compiled peak exceeds this as out-of-memory")
  p.add_argument("--probe", action=argparse.BooleanOptionalAction, default=None,
                 help="compile each step for its peak memory (default: on for local)")
  p.add_argument("--launcher", choices=["local", "slurm"], default="local")
  p.add_argument("--devices-per-process", type=int_list("--devices-per-process", 1),
                 default=[1], help="local, CPU: DEVICES_PER_PROCESS")
  p.add_argument("--gpus-per-node", type=int_list("--gpus-per-node", 1), default=[2],
                 help="slurm: GPUs (= training tasks) per node")
  p.add_argument("--slurm-arg", action="append", default=[], help="extra sbatch argument")
  p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                 help="environment of the launched runs (repeatable; part of the point)")
  p.add_argument("--tag", default="", help="a label stored in each row (tells variants apart)")
  p.add_argument("--runs", metavar="DIR",
                 help="run directories (default: runs/sweep-<OUTPUT stem>)")
  p.add_argument("--retry-failed", action="store_true", help="rerun points recorded as failed")
  p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
  a = p.parse_args(argv)
  # Runs start in the checkout (launch/*.sh): configs relative to it, the dataset absolute.
  a.config = [sw.root_relative(c) for c in a.config]
  a.data = os.path.abspath(a.data)
  for flag in ("steps", "log_every", "timeout", "devices_per_process", "gpus_per_node"):
    values = getattr(a, flag)
    if len(values) != 1:
      p.error(f"--{flag.replace('_', '-')} takes one value (got {values})")
    setattr(a, flag, values[0])
  if a.steps < 2 * a.log_every:
    p.error(f"--steps {a.steps} with --log-every {a.log_every}: need at least two logging "
            "windows (the first, with start-up, is not measured)")
  if not os.path.isfile(os.path.join(a.data, "metadata.json")):
    p.error(f"--data {a.data}: not a prepared dataset (no metadata.json)")
  if not (a.budget_gb >= 0):
    p.error(f"--budget-gb {a.budget_gb}: expected a number >= 0")
  if any("=" not in kv for kv in a.env):
    p.error(f"--env {a.env}: expected KEY=VALUE")
  a.sets = [kv for s in a.sets for kv in sg.key_values(s, "--set")]
  for key, _ in a.sets:
    if key in sg.GRID_KEYS:
      p.error(f"--set {key}: set by the sweep; use {sg.GRID_KEYS[key]}")
  a.probe = a.launcher == "local" if a.probe is None else a.probe
  return a


def sweep(o: sw.SweepOptions) -> int:
  if o.dry_run:
    for line in sw.dry_run(o):
      print(line)
    return 0
  print(report.runs_table(sw.sweep(o)))
  return 0


def main(argv=None) -> int:
  return args.guarded(lambda: sweep(sw.SweepOptions(**vars(parse_args(argv)))),
                      "rerun the same command: finished points are kept and skipped")


if __name__ == "__main__":
  sys.exit(main())
