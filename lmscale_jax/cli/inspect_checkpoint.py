"""List, or verify, the checkpoints of a training workdir.

  lmscale inspect WORKDIR [--step N] [--verify]

Lists each complete checkpoint (oldest first) with its commit time, size, manifests and the
metrics logged at its step (workdir/metrics.jsonl), after a summary of the run's config
(workdir/config.json); checkpoints moved aside as corrupt, interrupted saves and files in
place of a step (which a run moves aside) are listed too. --verify re-reads every file
against every process's manifest and exits 1 naming each bad file (what a resume does before
it loads a checkpoint), or where there is no checkpoint to verify: run it before a long job
restarts, or in a job script. A config.json or metrics.jsonl the tools cannot read (cut short,
not what training writes) is named in the listing and exits 1 as well. Reads only.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

from lmscale_jax.cli import args

from lmscale_jax.errors import UserError
from lmscale_jax.store import file_io
from lmscale_jax.train import checkpoint_manifest as manifest_lib

# model_files and train/checkpoint import JAX and Orbax (~1.3 s): each function below imports
# what it uses, so that --help answers without them.

_METRICS = ("loss", "mlm_accuracy", "learning_rate", "eval_loss", "eval_mlm_accuracy")


def main(argv=None) -> int:
  p = args.Parser(prog="lmscale inspect", description=__doc__.splitlines()[0])
  p.add_argument("workdir")
  p.add_argument("--step", type=args.number(int, 0, 1 << 62), default=None, metavar="N",
                 help="only the checkpoint of step N")
  p.add_argument("--verify", action="store_true",
                 help="check every file against the manifests; exit 1 naming any bad file")
  a = p.parse_args(argv)
  return args.guarded(lambda: inspect(a.workdir, a.step, a.verify), "nothing was changed")


def config_summary(workdir: str) -> str:
  """The run's config in one line; a damaged config.json raises its one line (UserError)."""
  from lmscale_jax.inference import model_files

  saved = model_files.run_file(workdir)
  m, c = saved["model"], saved["config"]
  t, k = c["train"], c.get("checkpoint") if isinstance(c.get("checkpoint"), dict) else {}
  warmup = (f"{t['warmup_fraction']:.1%} of the steps" if t.get("warmup_fraction")
            else t.get("warmup_steps"))
  return (f"config: model {m['layers']} × {m['hidden']} (vocab {m['vocab_size']}, seq "
          f"{m['seq_len']}, {m.get('norm', 'post')}-LN, {m.get('positions')} positions); batch "
          f"{t.get('batch_size')}, lr {t.get('learning_rate')} "
          f"({t.get('schedule')}, warmup {warmup}), train.steps "
          f"{t.get('steps')}; checkpoint every {k.get('every')}, keep {k.get('keep')}; "
          f"{len(saved.get('changes') or [])} recorded change(s)")


def metrics_by_step(workdir: str) -> dict:
  from lmscale_jax.inference import model_files

  rows: dict = {}
  for row in model_files.metrics_rows(workdir):
    rows.setdefault(row["step"], {}).update({k: row[k] for k in _METRICS if k in row})
  return rows


def shown(metrics: dict) -> str:
  return ", ".join(f"{k} {'non-finite' if v is None else format(v, '.4g')}"
                   for k, v in metrics.items()) or "no metrics"


def _committed(step_dir: str) -> str:
  try:
    with open(os.path.join(step_dir, manifest_lib.STEP_METADATA)) as f:
      nsecs = json.load(f)["commit_timestamp_nsecs"]
    return datetime.datetime.fromtimestamp(nsecs / 1e9).strftime("%Y-%m-%d %H:%M:%S")
  except (OSError, ValueError, KeyError, TypeError):
    return "commit time unknown"


def describe(workdir: str, step: int, metrics: dict) -> str:
  from lmscale_jax.train import checkpoint as ckpt_lib

  path = ckpt_lib.step_dir(workdir, step)
  parts = manifest_lib.parts_present(path)
  count = max(parts.values(), default=0)
  manifests = (f"manifests {len(parts)}/{count}" if parts else
               "no manifest" if manifest_lib.expects_manifest(path) else "saved before manifests")
  return (f"step {step:>8}  {_committed(path)}  {ckpt_lib.dir_bytes(path) / 2**20:9.2f} MiB  "
          f"{manifests}  {shown(metrics.get(step, {}))}")


def list_entries(workdir: str, whole: bool) -> list[str]:
  """Lists the checkpoints moved aside, the interrupted saves and (``whole``: no --step) the
  entries in place of a step that are no directory; returns what those entries are."""
  from lmscale_jax.train import checkpoint as ckpt_lib

  root = ckpt_lib.checkpoints_dir(workdir)
  for name in sorted(os.listdir(root)):
    if ckpt_lib.CORRUPT_SUFFIX in name or name.endswith(".orbax-checkpoint-tmp"):
      kind = "moved aside (failed verification)" if ckpt_lib.CORRUPT_SUFFIX in name else (
          "interrupted save (removed by the next run)")
      print(f"{name}: {kind}")
  misplaced = ckpt_lib.misplaced_steps(workdir) if whole else []
  for s, (problem,) in sorted(misplaced):
    print(f"{s}: {problem} (a run moves it aside to {s}{ckpt_lib.CORRUPT_SUFFIX})")
  return [problem for _, (problem,) in misplaced]


def run_files(workdir: str) -> tuple[list[str], dict]:
  """Prints the config's summary; returns the damaged run files a resume or a tool reads, and
  the metrics by step."""
  damaged, metrics = [], {}
  try:
    print(config_summary(workdir))
  except UserError as e:
    damaged.append(str(e))
    print(f"config: {e}")
  try:
    metrics = metrics_by_step(workdir)
  except UserError as e:
    damaged.append(str(e))
    print(f"metrics: {e}")
  return damaged, metrics


def verify_steps(workdir: str, steps: list[int]) -> int:
  """How many of ``steps`` do not verify (each problem named on stderr)."""
  from lmscale_jax.train import checkpoint as ckpt_lib

  bad = 0
  for s in steps:
    problems = manifest_lib.verify(ckpt_lib.step_dir(workdir, s))
    print(f"verify step {s}: " + ("ok" if not problems else f"{len(problems)} problem(s)"))
    for problem in problems:
      print(f"  {problem}", file=sys.stderr)
    bad += bool(problems)
  if bad:
    print(f"error: {bad} of {len(steps)} checkpoint(s) in {ckpt_lib.checkpoints_dir(workdir)} "
          "do not verify (files named above)", file=sys.stderr)
  return bad


def inspect(workdir: str, step: int | None, verify: bool) -> int:
  from lmscale_jax.train import checkpoint as ckpt_lib

  root = ckpt_lib.checkpoints_dir(workdir)
  if os.path.exists(root) and not os.path.isdir(root):
    raise UserError(f"{root} is {file_io.not_regular(root) or 'a file'}: expected the "
                    "directory of the run's checkpoints")
  if not os.path.isdir(root):
    raise UserError(f"{workdir}: no checkpoints directory ({root}); give the --workdir of a "
                    "training run")
  steps = sorted(ckpt_lib.complete_steps(workdir))
  if step is not None:
    if step not in steps:
      raise UserError(f"{workdir}: no checkpoint at step {step}; it has steps "
                      f"{', '.join(map(str, steps)) or 'none'}")
    steps = [step]
  print(f"workdir {workdir}")
  damaged, metrics = run_files(workdir)
  for s in steps:
    print(describe(workdir, s, metrics))
  if not steps:
    print(f"no complete checkpoint in {root}")
  misplaced = list_entries(workdir, whole=step is None)
  if verify:  # what a resume would not load, or would move aside
    damaged += misplaced + ([] if steps else [
        f"{workdir}: no checkpoint to verify in {root} (none was saved yet, or each was "
        "moved aside)"])
  if damaged:
    print(f"error: {damaged[0]}" + (f" (and {len(damaged) - 1} more above)"
                                    if len(damaged) > 1 else ""), file=sys.stderr)
  bad = verify_steps(workdir, steps) if verify else 0
  return 1 if bad or damaged else 0


if __name__ == "__main__":
  sys.exit(main())
