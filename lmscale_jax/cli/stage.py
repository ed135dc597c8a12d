"""Copy a dataset directory to node-local disk: parallel, sha256-verified, resumable.

  lmscale stage SRC_DATASET_DIR DEST_DIR [--workers N]
      [--only-needed --num-processes P --process-ids i,j [--plan interleaved|by_shard]]
      [--verify-all] [--no-progress] [--wait SECONDS]

A rerun copies only what is missing or fails verification (nothing, when DEST is intact).
Stagers started together into one DEST take turns (a lock in DEST): the later ones wait for
the first (--wait, default data.stage_timeout) and then find nothing to copy.
Exit status 0 when DEST is complete and verified; an error is one line on stderr (exit 1).
"""

from __future__ import annotations

import argparse
import json
import sys

from lmscale_jax.cli import args
from lmscale_jax.config import defaults as config_defaults
from lmscale_jax.input import staging


def _parser() -> argparse.ArgumentParser:
  parser = args.Parser(prog="lmscale stage", description=__doc__.splitlines()[0])
  parser.add_argument("src", metavar="SRC_DATASET_DIR", help="prepared dataset (shared storage)")
  parser.add_argument("dest", metavar="DEST_DIR", help="node-local directory to stage into")
  parser.add_argument("--workers", type=args.number(int, 1, 4096), default=8,
                      help="parallel file copies (default 8)")
  parser.add_argument("--only-needed", action="store_true",
                      help="copy only the shards that --process-ids will read (see --plan)")
  parser.add_argument("--num-processes", type=args.number(int, 1, 1 << 20), default=1,
                      help="processes in the whole job")
  parser.add_argument("--process-ids", default="0",
                      help="comma-separated ids of this node's processes (with --only-needed)")
  parser.add_argument("--plan", choices=staging.PLANS, default="interleaved",
                      help="how the loader assigns shards to processes: 'interleaved' (the "
                           "default, data.shard_by_process=False: every process reads every "
                           "shard) or 'by_shard' (data.shard_by_process=True: process i reads "
                           "shards i::P of every split)")
  parser.add_argument("--verify-all", action="store_true",
                      help="re-hash every file already in DEST, even those unchanged since "
                           "they were verified")
  parser.add_argument("--no-progress", action="store_true", help="no progress bar")
  wait = config_defaults.get_base_config().data.stage_timeout
  parser.add_argument("--wait", type=args.number(float, 0, 1e7), default=float(wait),
                      metavar="SECONDS",
                      help="seconds to wait for another stager already staging into DEST "
                           f"(default {wait}, data.stage_timeout)")
  return parser


def main(argv=None) -> int:
  parser = _parser()
  a = parser.parse_args(argv)
  if not a.only_needed and (a.num_processes != 1 or a.process_ids != "0"):
    parser.error("--num-processes/--process-ids only make sense with --only-needed")
  try:
    ids = [int(x) for x in a.process_ids.split(",") if x.strip()]
  except ValueError:
    parser.error(f"--process-ids {a.process_ids!r}: expected comma-separated integers")

  def go() -> int:
    out = staging.stage(a.src, a.dest, workers=a.workers, only_needed=a.only_needed,
                        num_processes=a.num_processes, process_ids=ids, plan=a.plan,
                        verify_all=a.verify_all, progress=not a.no_progress,
                        lock_timeout=a.wait)
    print(json.dumps(out))
    return 0

  return args.guarded(go, "rerun to finish (verified files are kept)")


if __name__ == "__main__":
  sys.exit(main())
