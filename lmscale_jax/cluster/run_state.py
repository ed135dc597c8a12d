"""``workdir/run_state.json``: how the latest run ended, and whether a job script should requeue.

Training (process 0) writes it (``workdir.write_run_state``): ``running`` at the start (a crash
leaves that), ``finished`` or ``preempted`` at the end, with the step reached and, inside
Slurm, the job id and restart count of the allocation that wrote it. ``launch/slurm.sbatch``
asks :func:`requeue_decision` after its training step
(``python -m lmscale_jax.cluster.run_state``): requeue only a run that this allocation saw
preempted after it made progress, and at most ``MAX_REQUEUES`` times, so a stale ``preempted``
(an earlier allocation's, or a ``--dry_run`` that trained nothing) never requeues forever.

Imports nothing heavy: the batch script runs it on the batch node before and after training.

  python -m lmscale_jax.cluster.run_state step WORKDIR   # the step reached so far (-1: none)
  python -m lmscale_jax.cluster.run_state requeue WORKDIR --since-step N [--max-requeues 20]
      # exit 0: requeue; 1: do not; the reason on stdout either way
  # a bad command line: exit 1 and one "error:" line, as every entry point (docs/design.md)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from typing import Mapping

FILE = "run_state.json"
MAX_REQUEUES = 20  # launch/slurm.sbatch's default (MAX_REQUEUES)


def record(state: str, step: int, total_steps: int, checkpoint: str,
           env: Mapping[str, str] | None = None) -> dict:
  """The content of ``run_state.json`` for a run in ``state`` at ``step``."""
  env = os.environ if env is None else env
  job = env.get("SLURM_JOB_ID") or None
  return {"state": state, "step": int(step), "total_steps": int(total_steps),
          "checkpoint": checkpoint, "slurm_job_id": job,
          "slurm_restart_count": int(env.get("SLURM_RESTART_COUNT") or 0) if job else None,
          "host": socket.gethostname(), "time": time.time()}


def read(workdir: str) -> dict | None:
  """``workdir/run_state.json``, or None if absent or unreadable."""
  try:
    with open(os.path.join(workdir, FILE)) as f:
      state = json.load(f)
  except (OSError, ValueError):
    return None
  return state if isinstance(state, dict) else None


class BadRunState(ValueError):
  """``run_state.json`` is JSON but its step is no integer (a damaged or hand-edited file)."""


def reached_step(state: dict | None, workdir: str) -> int:
  """The step ``state`` records (-1: no state, or none recorded); one that is no integer is a
  :class:`BadRunState` naming the file (``"step": "x"`` was a traceback from int())."""
  step = -1 if state is None else state.get("step", -1)
  if isinstance(step, bool) or not isinstance(step, int):
    raise BadRunState(f"{os.path.join(workdir, FILE)}: \"step\" is {json.dumps(step)}: "
                      "expected an integer (a damaged or hand-edited file; training rewrites it "
                      "as it starts)")
  return step


def requeue_decision(state: dict | None, *, since_step: int, job_id: str, restart_count: int,
                     max_requeues: int = MAX_REQUEUES) -> tuple[bool, str]:
  """(requeue?, why) for the allocation ``job_id``/``restart_count`` whose training step began
  at ``since_step`` (-1: no run state then)."""
  this = f"job {job_id} restart {restart_count}"
  if state is None:
    return False, f"no readable {FILE}: training did not start"
  if state.get("state") != "preempted":
    how = {"finished": "the run finished", "running": "the run crashed or was killed "
           "without a checkpoint (state 'running')"}.get(state.get("state"),
                                                         f"state {state.get('state')!r}")
    return False, f"{how} at step {state.get('step')}"
  writer = f"job {state.get('slurm_job_id')} restart {state.get('slurm_restart_count')}"
  if str(state.get("slurm_job_id")) != str(job_id) or \
      state.get("slurm_restart_count") != restart_count:
    return False, (f"{FILE} says preempted, but was written by {writer}, not by this "
                   f"allocation ({this}): stale, nothing was trained here")
  step = int(state.get("step", -1))
  if step <= since_step:
    return False, f"preempted at step {step}, no progress in this allocation ({this})"
  if restart_count >= max_requeues:
    return False, (f"preempted at step {step}, but the job was requeued {restart_count} times "
                   f"already (MAX_REQUEUES={max_requeues})")
  return True, (f"preempted at step {step} of {state.get('total_steps')} (from step "
                f"{max(since_step, 0)} in {this}): requeue {restart_count + 1} of at most "
                f"{max_requeues}")


class _Parser(argparse.ArgumentParser):
  """argparse with the exit code of every entry point: a bad command line is exit 1 and one
  ``error:`` line, not argparse's 2 and usage block (``cli.args.Parser``'s rule, kept here:
  cluster/ imports no cli/, and the batch node imports nothing heavy). Its subparsers too."""

  def error(self, message):
    self.exit(1, f"error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
  # As the user typed it: ``lmscale run-state`` (the dispatcher sets argv[0]) or python -m.
  typed = sys.argv[0] if sys.argv and sys.argv[0].startswith("lmscale ") else None
  parser = _Parser(prog=typed or "python -m lmscale_jax.cluster.run_state",
                   description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="command", required=True)
  sub.add_parser("step", help="the step reached so far (-1: none)").add_argument("workdir")
  ask = sub.add_parser("requeue", help="exit 0 when this allocation should requeue the job")
  ask.add_argument("workdir")
  ask.add_argument("--since-step", type=int, required=True,
                   help="the step `step` printed before the training step")
  ask.add_argument("--max-requeues", type=int, default=MAX_REQUEUES)
  return parser


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  state = read(args.workdir)
  try:
    step = reached_step(state, args.workdir)  # both commands: requeue compares it too
  except BadRunState as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  if args.command == "step":
    print(step)
    return 0
  ok, why = requeue_decision(
      state, since_step=args.since_step, job_id=os.environ.get("SLURM_JOB_ID", ""),
      restart_count=int(os.environ.get("SLURM_RESTART_COUNT") or 0),
      max_requeues=args.max_requeues)
  print(f"{'requeue' if ok else 'no requeue'}: {why}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
