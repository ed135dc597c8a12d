"""A finished naming fine-tune scored again, as its last evaluation scored it but with today's
rules: the prediction rule chosen on the run's own calibration slice among
``name_run.rules()`` (a grid that has grown since the run), over the model's tokens alone or,
where the run's training file carries ``calls``, merged with the called names'
(``name_run.scored``), then the held-out file scored. Inference as ``lmscale name`` runs it
(float32); the run's ``naming_eval.json`` is left as it is.

  python benchmarks/naming_rescore.py --workdir RUN [--step N] [--task DIR] --json OUT
      [--overwrite]

``--json`` is written temp-then-rename, and never over a file this tool did not write (an
input, the run's own naming_eval.json) unless ``--overwrite``.
"""

from __future__ import annotations

import datetime
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import _host  # noqa: E402
from lmscale_jax.cli.args import Parser, guarded, output_file  # noqa: E402
from lmscale_jax.errors import UserError  # noqa: E402

TOOL = "benchmarks/naming_rescore.py"


def parser() -> Parser:
  p = Parser(prog=TOOL, description=__doc__.splitlines()[0])
  p.add_argument("--workdir", required=True, help="a naming fine-tune's --workdir")
  p.add_argument("--step", type=int, default=None, help="its checkpoint (default: the latest)")
  p.add_argument("--json", required=True, type=output_file, help="where to write the scores")
  p.add_argument("--task", default=None, metavar="DIR",
                 help="score with this rebuild of the run's task instead (lmscale naming-build "
                 "of the same files and seed: the same examples, e.g. now with \"calls\")")
  return p


def rebuilt(task, run_task, given: str):
  """``task`` (the rebuild's) where it holds the run's own examples, else one line."""
  for name in ("train", "test"):
    mine, theirs = getattr(task, name), getattr(run_task, name)
    if mine.texts != theirs.texts or mine.tokens != theirs.tokens:
      raise UserError(f"--task {given}: its {name}.jsonl is not the run's {theirs.path} "
                      "(other examples): rebuild it from the same files and --seed")
  return task


def rescored(workdir: str, step: int | None, task_dir: str | None = None) -> dict:
  from lmscale_jax.finetune import name_run
  from lmscale_jax.inference import name_suggestions
  from lmscale_jax.model import name_head

  namer = name_suggestions.load(workdir, step=step)
  model = namer.model
  task = name_run.check_inputs(model.run_config, workdir)  # the run's split and vocabulary
  if task_dir:
    config = model.run_config.copy_and_resolve_references()
    config.finetune.labels = os.path.join(task_dir, "train.jsonl")
    config.finetune.eval_labels = os.path.join(task_dir, "test.jsonl")
    task = rebuilt(name_run.check_inputs(config, workdir), task, task_dir)
  ranked = [name_suggestions.ranked(model, named.texts, name_head.TOP)
            for named in (task.calibration, task.test)]
  scores = name_run.scored(task, *ranked)  # with the called names where the run has them
  scores.pop("predictions")
  return {"step": model.step, "calibration_functions": len(task.calibration),
          "thresholds": list(name_run.THRESHOLDS), **scores}


def main(argv=None) -> int:
  a = parser().parse_args(argv)

  def go() -> int:
    from lmscale_jax.store import output_marks

    out = rescored(a.workdir, a.step, a.task)
    doc = {"workdir": os.path.abspath(a.workdir), "task": a.task and os.path.abspath(a.task),
           "date": datetime.date.today().isoformat(), "code": _host.code_version(),
           "device": _host.host_description(ROOT), **out}
    output_marks.write_json(a.json, TOOL, doc)
    r = out["rule"]
    print(f"{a.workdir} step {out['step']}: F1 {out['f1']:.4f} (P {out['precision']:.4f}, R "
          f"{out['recall']:.4f}), rule {r['kind']} {r.get('threshold', r.get('k'))} chosen on "
          f"{out['calibration_functions']} (calibration F1 {r['calibration_f1']:.4f})"
          + (" with the called names" if r.get("calls") else ""))
    return 0

  return guarded(go, "nothing was written")


if __name__ == "__main__":
  sys.exit(main())
