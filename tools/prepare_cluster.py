"""Data preparation as stages of Slurm job arrays: prepare_binary.py's (or prepare_text.py's)
output byte for byte, the work spread over nodes (launch/prepare.sbatch runs the whole chain).

  python tools/prepare_cluster.py plan --input DIR… --output OUT [prepare_binary options]
                                       [--kind text] [--slices 64] [--buckets 64]
  python tools/prepare_cluster.py extract|dedup|pack|shards --output OUT [--task I --tasks N]
                                                            [--workers W]
  python tools/prepare_cluster.py layout|finish|status --output OUT [--workers W]

--task/--tasks default to Slurm's SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT (else 0 of 1);
--workers to SLURM_CPUS_PER_TASK (else all cores). Each array task takes a contiguous share of
its stage's units; a rerun redoes only the units without a completion marker.
"""
import json
import os
import sys

import _cli

from lmscale_jax.prep import cluster_extract, cluster_stages, worker_pool
from lmscale_jax.prep import options as prep_options

ARRAY_STAGES = ("extract", "dedup", "pack", "shards")


def _env_int(name: str, default: int) -> int:
  try:
    return int(os.environ.get(name, default))
  except ValueError:
    return default


def _plan(argv) -> int:
  kind = "text" if "--kind=text" in argv or "--kind text" in " ".join(argv) else "binary"
  p = _cli.parser(kind)
  p.prog = "prepare_cluster.py plan"
  p.add_argument("--kind", choices=["binary", "text"], default="binary")
  p.add_argument("--slices", type=_cli.number(int, 1, 1 << 20), default=64,
                 help="units of extraction (the resume granularity of the extract stage)")
  p.add_argument("--buckets", type=_cli.number(int, 1, 1 << 16), default=64,
                 help="hash partitions of the duplicate check (units of the dedup stage)")
  a = p.parse_args(argv)
  o = _cli.options(kind, a)

  def go() -> int:
    plan = cluster_extract.plan(o, a.slices, a.buckets)
    print(f"plan: {len(plan['files'])} input files, {len(plan['tasks'])} extraction tasks in "
          f"{len(plan['slices'])} slices, {plan['buckets']} buckets; next: the extract stage")
    return 0

  return _cli.guarded(go, "rerun the same command")


def _stage(stage: str, argv) -> int:
  p = _cli.Parser(prog=f"prepare_cluster.py {stage}")
  p.add_argument("--output", required=True, metavar="DIR")
  if stage in ARRAY_STAGES:
    p.add_argument("--task", type=_cli.number(int, 0, 1 << 20),
                   default=_env_int("SLURM_ARRAY_TASK_ID", 0))
    p.add_argument("--tasks", type=_cli.number(int, 1, 1 << 20),
                   default=_env_int("SLURM_ARRAY_TASK_COUNT", 1))
  p.add_argument("--workers", type=_cli.number(int, 0, prep_options.MAX_WORKERS),
                 default=_env_int("SLURM_CPUS_PER_TASK", 0), help="processes (0 = all cores)")
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

  return _cli.guarded(go, f"rerun the {stage} stage: it redoes only what is missing")


def main(argv) -> int:
  stages = [s for s in cluster_stages.STAGES] + ["status"]
  if argv and argv[0] in ("-h", "--help"):
    print(__doc__.strip())
    return 0
  if not argv:
    print(f"error: give a stage: one of {', '.join(stages)} (see prepare_cluster.py --help)",
          file=sys.stderr)
    return _cli.EXIT_USAGE
  if argv[0] not in stages:
    print(f"error: stage {argv[0]!r}: expected one of {', '.join(stages)} "
          "(see prepare_cluster.py --help)", file=sys.stderr)
    return _cli.EXIT_USAGE
  return _plan(argv[1:]) if argv[0] == "plan" else _stage(argv[0], argv[1:])


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
