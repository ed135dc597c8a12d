"""The compiler-provenance baseline: TF-IDF of the pretokens + logistic regression, on a task
built by lmscale provenance-build.

  python benchmarks/provenance_baseline.py --task DIR [--read-as RUN] [--json OUT.json]

scikit-learn's ``TfidfVectorizer(token_pattern=r"\\S+", lowercase=False)`` (each pretoken a
term: mnemonics, registers, ``[NEXT]``, constants; the same features as the similarity
benchmark's TF-IDF) fitted on train.jsonl only, then ``LogisticRegression`` with C and
max_iter fixed here before any test score was seen (no tuning: the test split is scored once).
Prints and writes (--json, atomically) accuracy, macro-F1 and per-label F1 on test.jsonl
(lmscale_jax/evals/classification.py, the scores the fine-tuned classifier reports), the
confusion matrix, the majority class's scores (the floor), the fit's seconds and whether it
converged, with the date, the machine and the code's commit. ``--read-as RUN`` first cuts
every text (train and test) to what that run's encoder reads (its tokenizer, cut at its
``seq_len``: ``trained_model.text_read``): the baseline seeing what the fine-tuned classifier sees.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import _host  # noqa: E402
from lmscale_jax.cli import args as cli_args  # noqa: E402  one line, exit 1 for a bad argument
from lmscale_jax.errors import UserError  # noqa: E402
from lmscale_jax.evals import classification, retrieval  # noqa: E402
from lmscale_jax.store import file_io, output_marks  # noqa: E402

TOOL = "benchmarks/provenance_baseline.py"  # the parser's prog, and the mark its --json carries

C = 10.0          # TF-IDF rows are unit length: C=1 under-fits a few thousand terms' weights
MAX_ITER = 2000   # lbfgs; whether it converged is reported


def parser():
  p = cli_args.Parser(prog=TOOL, description=__doc__.splitlines()[0])
  p.add_argument("--task", required=True, metavar="DIR",
                 help="a task directory of lmscale provenance-build")
  p.add_argument("--read-as", default=None, metavar="RUN",
                 help="cut every text to what this training run's encoder reads (its seq_len)")
  p.add_argument("--json", type=cli_args.output_file, default=None, metavar="OUT",
                 help="also write the result here")
  return p


def read_split(task: str, name: str) -> tuple[list[str], list[str]]:
  path = os.path.join(task, f"{name}.jsonl")
  if not os.path.isfile(path):
    raise UserError(f"--task {task}: no {name}.jsonl (build the task with lmscale "
                    "provenance-build)")
  texts, labels = [], []
  with open(path, encoding="utf-8") as f:
    for i, line in enumerate(f, 1):
      try:
        row = json.loads(line)
        texts.append(row["text"]), labels.append(row["label"])
      except (json.JSONDecodeError, KeyError, TypeError):
        raise UserError(f"{path}:{i}: expected a JSON object with \"text\" and \"label\"") from None
  if not texts:
    raise UserError(f"{path}: no examples")
  return texts, labels


def read_labels(task: str, *splits: list[str]) -> list[str]:
  """task.json's label set where there is one (a label missing from test still counts in
  macro-F1), else the labels seen."""
  path = os.path.join(task, "task.json")
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      return list(json.load(f)["labels"])
  return sorted({lab for labels in splits for lab in labels})


def fit_predict(train_x, train_y, test_x) -> tuple[list[str], dict]:
  from sklearn.exceptions import ConvergenceWarning
  from sklearn.linear_model import LogisticRegression

  start = time.perf_counter()
  vectorizer = retrieval.tfidf_vectorizer()
  model = LogisticRegression(C=C, max_iter=MAX_ITER)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", ConvergenceWarning)  # reported as "converged" instead
    model.fit(vectorizer.fit_transform(train_x), train_y)
  fit_s = time.perf_counter() - start
  predicted = model.predict(vectorizer.transform(test_x)).tolist()
  return predicted, {"features": len(vectorizer.vocabulary_), "fit_s": round(fit_s, 2),
                     "iterations": int(max(model.n_iter_)),
                     "converged": bool(max(model.n_iter_) < MAX_ITER)}


def read_as(workdir: str, *splits: list[str]) -> tuple[list[str], ...]:
  """Each split's texts cut to what ``workdir``'s encoder reads."""
  from lmscale_jax.inference import model_dir, trained_model

  model = trained_model.architecture(model_dir.read_run(workdir, "", None))
  return tuple([trained_model.text_read(model, t) for t in texts] for texts in splits)


def run(task: str, read_by: str | None = None) -> dict:
  (train_x, train_y), (test_x, test_y) = read_split(task, "train"), read_split(task, "test")
  if read_by:
    train_x, test_x = read_as(read_by, train_x, test_x)
  labels = read_labels(task, train_y, test_y)
  predicted, fit = fit_predict(train_x, train_y, test_x)
  return {"date": datetime.date.today().isoformat(), "device": _host.cpu_name(),
          "code": _host.code_version(), "task": task, "task_json_sha256": task_sha(task),
          "method": {"name": "tfidf+logreg",
                     "vectorizer": "TfidfVectorizer(token_pattern='\\\\S+', lowercase=False)",
                     "classifier": f"LogisticRegression(C={C}, max_iter={MAX_ITER})", **fit},
          "read_as": read_by and os.path.abspath(read_by),
          "examples": {"train": len(train_y), "test": len(test_y)},
          "scores": classification.classification_scores(test_y, predicted, labels),
          "majority": classification.majority_scores(train_y, test_y, labels)}


def task_sha(task: str) -> str | None:
  path = os.path.join(task, "task.json")
  return file_io.sha256_file(path) if os.path.isfile(path) else None


def summary(doc: dict) -> str:
  s, m = doc["scores"], doc["majority"]
  lines = [f"{doc['task']}: {doc['examples']['train']} training, {doc['examples']['test']} test "
           f"examples; {doc['method']['features']} TF-IDF terms; fit {doc['method']['fit_s']} s"
           + (f"; texts cut to what {doc['read_as']} reads" if doc.get("read_as") else ""),
           f"tfidf+logreg  accuracy {s['accuracy']:.4f}  macro-F1 {s['macro_f1']:.4f}",
           f"majority ({m['label']})  accuracy {m['accuracy']:.4f}  macro-F1 {m['macro_f1']:.4f}"]
  lines += [f"  {lab:<12} F1 {v['f1']:.4f}  (support {v['support']})"
            for lab, v in s["per_label"].items()]
  return "\n".join(lines)


def main(argv=None) -> int:
  a = parser().parse_args(argv)

  def go() -> int:
    if not os.path.isdir(a.task):
      raise UserError(f"--task {a.task}: no such directory (build one with lmscale "
                      "provenance-build)")
    doc = run(a.task, a.read_as)
    print(summary(doc))
    if a.json:
      output_marks.write_json(a.json, TOOL, doc)
    return 0

  return cli_args.guarded(go, "nothing was written")


if __name__ == "__main__":
  sys.exit(main())
