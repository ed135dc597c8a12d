"""The function-naming baselines, on a task built by lmscale naming-build: the most frequent
training tokens, and nearest-neighbour name transfer with TF-IDF and (``--index-workdir``)
with a contrastive encoder's vectors.

  python benchmarks/naming_baselines.py --task DIR [--test-task DIR2] [--json OUT.json]
                                        [--index-workdir RUN [--tokenizer F]]

* ``frequent_tokens``: every test function gets the same suggestion, the k sub-tokens most
  training names hold (task.json's ``train_token_counts`` order: count, then the token), k the
  training names' mean number of distinct sub-tokens, rounded (chosen on training data only).
* ``tfidf_nearest``: scikit-learn's TfidfVectorizer over the pretokens (each pretoken a term,
  the similarity and provenance baselines' features) fitted on train.jsonl; each test function
  gets the tokens of its nearest training function by cosine similarity (ties: the first in
  train.jsonl's order).
* ``encoder_nearest`` (``--index-workdir``): the same transfer with a trained model's function
  vectors (``inference/function_vectors.embed``: what ``lmscale index`` keeps and ``lmscale
  search`` ranks with; a contrastive fine-tune's own pooling and projection), normalised, the
  nearest by cosine: the "name of the most similar known function" a search index gives.
* ``callee_copy`` (a task whose ELF examples carry ``calls``, the names each function calls
  that a stripped copy still shows): the sub-tokens of those names that training functions'
  own names held often enough (:mod:`lmscale_jax.inference.callee_copy`);
  ``callee_copy_else_tfidf_nearest``: that, or where it suggests nothing, ``tfidf_nearest``'s
  (neither again as ``…_own_dropped``: they copy no training name).
* each again as ``…_own_dropped`` (``--library-share S``, 0.5; 0: not): the training names less
  each library's own sub-tokens (those in at least S of its names: its namespace, ``xml``,
  ``g``), the naming fine-tune's targets (``finetune.name_library_share``): a test project's own
  prefix is never in training, so transferring a training library's only costs precision.

Both are scored by lmscale_jax/evals/naming.py's ``score`` (micro sub-token precision, recall,
F1 and exact-name accuracy: the fine-tuned head's scores) on test.jsonl, or on ``--test-task``'s
test.jsonl (another build of the same split, e.g. one variant per function where this task
trained on all; its test libraries must not be among this task's training ones). Prints and
writes (--json, atomically) the scores with the task's unseen-token shares, the date, the
machine and the code's commit.
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import _host  # noqa: E402
from lmscale_jax.cli import args as cli_args  # noqa: E402  one line, exit 1 for a bad argument
from lmscale_jax.errors import UserError  # noqa: E402
from lmscale_jax.config import finetune as finetune_config  # noqa: E402
from lmscale_jax.evals import naming, retrieval  # noqa: E402
from lmscale_jax.store import file_io, output_marks  # noqa: E402

TOOL = "benchmarks/naming_baselines.py"
COPY_GRID = (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5)  # callee_copy's thresholds
CHUNK = 512  # test rows per similarity product: CHUNK × training rows of float64 at a time
# The naming fine-tune's default (config/finetune.py, its one owner).
LIBRARY_SHARE = finetune_config.get_config().finetune.name_library_share


def parser():
  p = cli_args.Parser(prog=TOOL, description=__doc__.splitlines()[0])
  p.add_argument("--task", required=True, metavar="DIR",
                 help="a task directory of lmscale naming-build")
  p.add_argument("--test-task", default=None, metavar="DIR",
                 help="score on this task's test.jsonl instead (the same libraries split)")
  p.add_argument("--json", type=cli_args.output_file, default=None, metavar="OUT",
                 help="also write the result here")
  p.add_argument("--index-workdir", default=None, metavar="RUN",
                 help="also transfer names by this model's function vectors (a contrastive "
                 "fine-tune's run, as lmscale index takes)")
  p.add_argument("--library-share", type=float, default=LIBRARY_SHARE, metavar="S",
                 help="also each baseline with the training names less their libraries' own "
                 "sub-tokens (those in at least S of a library's names; the naming "
                 f"fine-tune's finetune.name_library_share, {LIBRARY_SHARE}); 0: not")
  p.add_argument("--tokenizer", default="", metavar="tokenizer.json",
                 help="(--index-workdir of a pretraining run) its dataset's tokenizer")
  return p


def read_split(task: str, name: str) -> list[dict]:
  path = os.path.join(task, f"{name}.jsonl")
  if not os.path.isfile(path):
    raise UserError(f"--task {task}: no {name}.jsonl (build the task with lmscale "
                    "naming-build)")
  rows = []
  with open(path, encoding="utf-8") as f:
    for i, line in enumerate(f, 1):
      try:
        row = json.loads(line)
        rows.append({"text": row["text"], "tokens": list(row["tokens"]),
                     "library": row["library"], "calls": row.get("calls")})
      except (json.JSONDecodeError, KeyError, TypeError):
        raise UserError(f"{path}:{i}: expected a JSON object with \"text\", \"tokens\" and "
                        "\"library\"") from None
  if not rows:
    raise UserError(f"{path}: no examples")
  return rows


def frequent_tokens(names: list[list[str]]) -> tuple[int, list[str]]:
  """(k, the k tokens most training names hold)."""
  held = collections.Counter(t for name in names for t in set(name))
  k = max(1, round(sum(len(set(name)) for name in names) / len(names)))
  return k, [t for t, _ in sorted(held.items(), key=lambda kv: (-kv[1], kv[0]))[:k]]


def most_similar(b, a) -> list[int]:
  """Each row of ``b``'s most similar row of ``a`` (rows of unit length: the dot is the cosine;
  the first of equals), CHUNK rows of ``b`` at a time; sparse (TF-IDF) or dense."""
  import numpy as np

  found = []
  for i in range(0, b.shape[0], CHUNK):
    sims = b[i:i + CHUNK] @ a.T
    found += np.argmax(sims.toarray() if hasattr(sims, "toarray") else sims, axis=1).tolist()
  return found


def nearest(train: list[dict], test: list[dict]) -> tuple[list[int], dict]:
  """The index of each test row's nearest training row (TF-IDF cosine)."""
  start = time.perf_counter()
  vectorizer = retrieval.tfidf_vectorizer()
  a = vectorizer.fit_transform([r["text"] for r in train])
  b = vectorizer.transform([r["text"] for r in test])
  found = most_similar(b, a)
  return found, {"features": len(vectorizer.vocabulary_),
                 "seconds": round(time.perf_counter() - start, 2)}


def callee_suggestions(train: list[dict], test: list[dict]) -> tuple[list[list[str]], dict]:
  """Each test function's callee_copy suggestion (rates and threshold from the training split)
  → (suggestions, the rule)."""
  from lmscale_jax.inference import callee_copy

  calls = [r["calls"] for r in train]
  rates = callee_copy.fit(calls, [r["tokens"] for r in train])
  names = [r["tokens"] for r in train]
  weights = naming.library_weights([r["library"] for r in train])  # chosen as a run chooses
  threshold = max(COPY_GRID, key=lambda t: naming.score(callee_copy.suggested(rates, calls, t),
                                                        names, weights)["f1"])
  return callee_copy.suggested(rates, [r["calls"] for r in test], threshold), {
      "threshold": threshold, "overall_copy_rate": round(rates.overall, 4),
      "test_functions_calling_names": sum(bool(r["calls"]) for r in test)}


def encoder_nearest(workdir: str, tokenizer: str, train: list[dict],
                    test: list[dict]) -> tuple[list[int], dict]:
  """The index of each test row's nearest training row by the model's normalised vectors."""
  import numpy as np

  from lmscale_jax.inference import function_vectors, trained_model

  start = time.perf_counter()
  model = trained_model.load(workdir=workdir, tokenizer_path=tokenizer)

  def vectors(rows):
    inputs = ((str(i), "", *trained_model.encode(model, r["text"])) for i, r in enumerate(rows))
    v = function_vectors.embed(model, inputs)["embeddings"]
    return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)

  found = most_similar(vectors(test), vectors(train))
  return found, {"model": workdir, "step": model.step,
                 "pool": function_vectors.resolve_pool(model, None),
                 "seconds": round(time.perf_counter() - start, 2)}


def run(task: str, test_task: str | None = None, index_workdir: str | None = None,
        tokenizer: str = "", share: float = 0.0) -> dict:
  train = read_split(task, "train")
  test = read_split(test_task or task, "test")
  if overlap := sorted({r["library"] for r in train} & {r["library"] for r in test}):
    raise UserError(f"--test-task {test_task}: its test libraries {', '.join(overlap[:5])} are "
                    f"in {task}'s training split (build both with the same --seed and files)")
  truth = [r["tokens"] for r in test]
  names = {"": [r["tokens"] for r in train]}
  if share > 0:  # the same transfer of the names less their libraries' own sub-tokens
    from lmscale_jax.finetune import name_labels  # here: it imports JAX, --help need not

    names["_own_dropped"] = name_labels.names_less_own([r["library"] for r in train],
                                                       names[""], share)
  baselines = {}
  for suffix, kept in names.items():
    k, top = frequent_tokens(kept)
    baselines["frequent_tokens" + suffix] = {"k": k, "tokens": top,
                                             "scores": naming.score([top] * len(test), truth)}
  found, fit = nearest(train, test)
  for suffix, kept in names.items():
    baselines["tfidf_nearest" + suffix] = {**fit, "scores": naming.score(
        [kept[j] for j in found], truth)}
  if any(r["calls"] is not None for r in train):  # built with calls (its ELF examples)
    copied, rule = callee_suggestions(train, test)
    baselines["callee_copy"] = {**rule, "scores": naming.score(copied, truth)}
    baselines["callee_copy_else_tfidf_nearest"] = {**rule, "scores": naming.score(
        [c or names[""][j] for c, j in zip(copied, found)], truth)}
  if index_workdir:
    found, fit = encoder_nearest(index_workdir, tokenizer, train, test)
    for suffix, kept in names.items():
      baselines["encoder_nearest" + suffix] = {**fit, "scores": naming.score(
          [kept[j] for j in found], truth)}
  return {"date": datetime.date.today().isoformat(), "device": _host.cpu_name(),
          "code": _host.code_version(), "task": task, "task_json_sha256": task_sha(task),
          "test_task": test_task or task, "library_share": share,
          "examples": {"train": len(train), "test": len(test)},
          "unseen_in_training": unseen(task, test_task), "baselines": baselines}


def task_sha(task: str) -> str | None:
  path = os.path.join(task, "task.json")
  return file_io.sha256_file(path) if os.path.isfile(path) else None


def unseen(task: str, test_task: str | None) -> dict | None:
  """task.json's unseen-token shares (where the test split is the task's own)."""
  path = os.path.join(task, "task.json")
  if test_task or not os.path.isfile(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f).get("unseen_in_training")


def summary(doc: dict) -> str:
  lines = [f"{doc['task']}: {doc['examples']['train']} training, {doc['examples']['test']} "
           f"test examples (test from {doc['test_task']})"]
  for name, b in doc["baselines"].items():
    s = b["scores"]
    lines.append(f"{name:<28} P {s['precision']:.4f}  R {s['recall']:.4f}  F1 {s['f1']:.4f}  "
                 f"exact {s['exact']:.4f}")
  return "\n".join(lines)


def main(argv=None) -> int:
  a = parser().parse_args(argv)

  def go() -> int:
    for d in filter(None, (a.task, a.test_task)):
      if not os.path.isdir(d):
        raise UserError(f"--task {d}: no such directory (build one with lmscale naming-build)")
    if not 0.0 <= a.library_share <= 1.0:
      raise UserError(f"--library-share {a.library_share}: expected a share from 0 to 1")
    doc = run(a.task, a.test_task, a.index_workdir, a.tokenizer, a.library_share)
    print(summary(doc))
    if a.json:
      output_marks.write_json(a.json, TOOL, doc)
    return 0

  return cli_args.guarded(go, "nothing was written")


if __name__ == "__main__":
  sys.exit(main())
