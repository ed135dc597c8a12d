"""Score a classification fine-tune on a labels file: accuracy, macro-F1, and its predictions.

  lmscale classify --workdir OUT [--step N] --labels FILE.jsonl [--json SCORES.json]
      [--batch-size 64]

OUT is a lmscale finetune --task classify workdir; FILE is a JSONL file of {"text": "<pretokenised
instruction text>", "label": "<class>"} objects (the format the run trained on), every label one
of the run's classes (its labels.json). Prints the accuracy, the macro-F1 over all of the run's
classes and the lowest per-class F1; --json writes them with the per-class counts, the
confusion matrix and one prediction per line of FILE (its line number, label, predicted class
and its optional library/function/binary), as the run's classification_eval.json.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

import numpy as np

from lmscale_jax.cli import args
from lmscale_jax.errors import UserError
from lmscale_jax.store import output_marks

if TYPE_CHECKING:  # annotations only
  from lmscale_jax.inference import trained_model

TOOL = "lmscale classify"  # the parser's prog, and the mark its --json carries


def parser() -> argparse.ArgumentParser:
  p = args.Parser(prog=TOOL, description=__doc__.splitlines()[0])
  p.add_argument("--workdir", required=True, help="a lmscale finetune --task classify run")
  p.add_argument("--step", type=args.number(int, 0, 1 << 62), default=None,
                 help="its checkpoint; default the latest")
  p.add_argument("--labels", required=True, type=args.input_file, metavar="FILE.jsonl",
                 help='the examples to score: {"text", "label"} per line')
  p.add_argument("--json", default="", type=args.output_file, metavar="SCORES.json",
                 help="write the scores and one prediction per example")
  p.add_argument("--batch-size", "--batch_size", dest="batch_size", default=64,
                 type=args.number(int, 1, 1 << 16), help="examples per forward pass")
  return p


def log_probs(model: trained_model.TrainedModel, ids: np.ndarray,
              batch_size: int) -> np.ndarray:
  """The class log-probabilities of every row of ``ids``, ``batch_size`` rows at a time."""
  from scipy import special  # scikit-learn's dependency

  from lmscale_jax.inference import trained_model

  logits = np.concatenate([trained_model.class_logits(model, ids[i:i + batch_size])
                           for i in range(0, len(ids), batch_size)])
  return special.log_softmax(logits.astype(np.float64), axis=-1)


def score(a) -> dict:
  # JAX and the model here, not at module level: --help answers without them (~1.8 s).
  from lmscale_jax.finetune import classify_run
  from lmscale_jax.finetune import labels as labels_lib
  from lmscale_jax.inference import trained_model

  examples = labels_lib.read(a.labels, "--labels")  # before the model: a bad file costs nothing
  model = trained_model.from_workdir(a.workdir, a.step)
  if model.classifier is None:
    raise UserError(f"--workdir {a.workdir} is not a classification fine-tune (lmscale "
                    "finetune --task classify makes one)")
  names = model.classifier["labels"]
  labels_lib.check_known(examples, names, "--labels")
  # A run trained on windows (finetune.windows) scores a function by their mean, as it was
  # evaluated while training.
  ids, owner = classify_run.read_windows(model, examples, classify_run.windows_of(model.run_config))
  predicted = classify_run.pooled_classes(log_probs(model, ids, a.batch_size), owner,
                                          len(examples))
  out = {"workdir": a.workdir, "step": model.step,
         **classify_run.report(examples, names, predicted)}
  out["predictions"] = [{"line": line, "label": label, "predicted": names[p], **info}
                        for line, label, p, info in zip(examples.lines, examples.labels,
                                                        predicted.tolist(), examples.info)]
  return out


def main(argv=None) -> int:
  a = parser().parse_args(argv)

  def go() -> int:
    out = score(a)
    if a.json:
      output_marks.write_json(a.json, TOOL, out)
    worst = min(out["per_label"].items(), key=lambda kv: kv[1]["f1"])
    print(f"{a.workdir} step {out['step']} on {a.labels}: {out['examples']} examples, accuracy "
          f"{out['accuracy']:.4f}, macro-F1 {out['macro_f1']:.4f} ({len(out['labels'])} "
          f"classes; lowest F1 {worst[1]['f1']:.3f}: {worst[0]!r})"
          + (f"; wrote {a.json}" if a.json else ""))
    return 0

  return args.guarded(go, f"nothing was written to {a.json}" if a.json else "nothing scored")


if __name__ == "__main__":
  sys.exit(main())
