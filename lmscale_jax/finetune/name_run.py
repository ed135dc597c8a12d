"""A function-naming fine-tuning run (``finetune.task="name"``; XFL's multi-label form of the
naming task): the encoder, masked-mean pooling and a Dense head to one logit per name sub-token
of the run's vocabulary (:mod:`lmscale_jax.model.name_head`), trained with binary
cross-entropy on a naming task's training file (:mod:`lmscale_jax.finetune.name_labels`) and
scored on its held-out file by :func:`lmscale_jax.evals.naming.score`.

  finetune(config, workdir)   # config: get_config() with finetune.task="name",
                              # finetune.labels, finetune.eval_labels and init.* set

A task of hooks on the shared run core (:mod:`lmscale_jax.finetune.base_run`,
:mod:`lmscale_jax.train.run_loop`), as the classification task is; the step is every run's
with :func:`naming_task` (every ``train.*`` lever). The head's bias starts at each
token's log-odds in the training names (the loss then starts near the names' entropy, not at
V·ln 2). The workdir also holds ``name_vocab.json`` (output ``i`` is ``tokens[i]``; a resume
whose task gives another vocabulary is refused) and, after each evaluation (every
``train.eval_every`` steps and after the last), ``naming_eval.json``: the prediction rule
chosen on the calibration slice of the training file (the best F1 among
:data:`name_head.RULES`, each at its best threshold or k; F1 with no library weighing more than
the slice's median one: ``naming.library_weights``), its precision, recall, F1 and
exact-name accuracy on the held-out file, every rule's scores there too, and one prediction
per held-out function.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from lmscale_jax.config import finetune as finetune_config
from lmscale_jax.evals import naming
from lmscale_jax.finetune import base_run, classify_run, finetune_state
from lmscale_jax.finetune import labels as labels_lib
from lmscale_jax.finetune import name_labels
from lmscale_jax.inference import callee_copy
from lmscale_jax.model import bert as model_lib
from lmscale_jax.model import classifier as classifier_lib
from lmscale_jax.model import name_head
from lmscale_jax.store import file_io
from lmscale_jax.train import steps as steps_lib
from lmscale_jax.train import tasks

EVAL_REPORT = name_head.EVAL_REPORT
TOP = name_head.TOP  # tokens per function the evaluation reads back
# Below 0.05 too: a 2,000-step run on the larger task chose 0.05, the grid's lowest then.
THRESHOLDS = (0.01, 0.02, 0.03, 0.04) + tuple(round(0.05 * i, 2) for i in range(1, 20))
KS = tuple(range(1, 7))


@dataclasses.dataclass
class NamingTask:
  """The two files of a naming task, read and checked, the vocabulary and the split of the
  training rows into those trained on and the calibration slice."""
  train: name_labels.Named
  test: name_labels.Named
  tokens: list[str]
  fit: name_labels.Named
  calibration: name_labels.Named
  # Copy rates of the called names' sub-tokens (inference/callee_copy), from the trained-on rows'
  # whole names; None where the training file has no "calls".
  copy: callee_copy.CopyRates | None = None


# ----------------------------------------------------------------------------- steps
def naming_task(model, labels: Callable, pad_id: int) -> tasks.SumTask:
  """A naming fine-tune's loss (:mod:`lmscale_jax.model.name_head`): binary cross-entropy of
  one sigmoid per name sub-token, summed over the vocabulary and the rows of batches ``{"ids"
  [B,S], "targets" [B,V]}`` / the rows. Its metric: the batch's micro token F1 at p >= 0.5
  (``f1``; true positives, predicted and true tokens summed over devices first)."""

  def loss_sum(params, batch, rng):
    logits = model.apply({"params": finetune_state.stop_frozen(params, labels)}, batch["ids"],
                         deterministic=False, rngs={"dropout": rng}).astype(jnp.float32)
    target = batch["targets"].astype(jnp.float32)
    bce = optax.sigmoid_binary_cross_entropy(logits, target).sum(-1)
    said = (logits >= 0).astype(jnp.float32)
    return bce.sum(), {"hit": (said * target).sum(), "said": said.sum(), "real": target.sum(),
                       "tokens": (batch["ids"] != pad_id).sum()}

  def metrics(sums):
    hit = sums["hit"]
    return {"f1": 2 * hit / jnp.maximum(sums["said"] + sums["real"], 1.0),
            "tokens": sums["tokens"]}

  return tasks.SumTask(loss_sum=loss_sum,
                       weight=lambda b: jnp.asarray(b["ids"].shape[0], jnp.float32),
                       metrics=metrics, compute_cast=finetune_state.head_in_float32("classifier"))


def build_steps(config, cfg, prior: np.ndarray, mesh=None, *,
                manual: bool | None = None) -> steps_lib.Steps:
  """The one train step of the naming task (``prior``: each token's share of the training
  names, the bias's start). ``eval_step``: (params, ids [B,S]) -> (the TOP best tokens'
  probabilities [B,K], their indices [B,K])."""
  outputs = len(prior)
  model = classifier_lib.SequenceClassifier(cfg, outputs)
  optimizer, labels = finetune_state.optimizer(config)
  p = np.clip(np.asarray(prior, np.float64), 1e-6, 1 - 1e-6)
  bias = jnp.asarray(np.log(p / (1 - p)), jnp.float32)

  def init_state(bert, rng):
    head = classifier_lib.init_head(cfg, outputs, rng)
    params = {"bert": bert, "classifier": {**head, "bias": bias}}
    return steps_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                                opt_state=optimizer.init(params))

  def predict(params, ids):
    logits = model.apply({"params": params}, ids, deterministic=True)
    return jax.lax.top_k(jax.nn.sigmoid(logits.astype(jnp.float32)), min(TOP, outputs))

  bert = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.key(0)))
  task = naming_task(model, labels, int(cfg.pad_id))
  return steps_lib.build_task_steps(config, task, model, optimizer, init_state,
                                    (bert, jax.random.key(0)), compute_dtype=str(cfg.dtype),
                                    mesh=mesh, manual=manual, eval_step=predict)


# ----------------------------------------------------------------------------- scores
def best_tokens(tokens: list[str], top: tuple[np.ndarray, np.ndarray]):
  """(each function's best tokens, best first; their probabilities [N,K])."""
  probs, index = (np.asarray(a) for a in top)
  return [[tokens[i] for i in row] for row in index.tolist()], probs


def rules():
  """Every rule the calibration slice chooses among."""
  for kind in ("threshold", "threshold_min1"):
    for t in THRESHOLDS:
      yield {"kind": kind, "threshold": t}
  for k in KS:
    yield {"kind": "topk", "k": k}


def choose_rule(names: list[list[str]], probs: np.ndarray,
                calibration: name_labels.Named) -> dict:
  """The rule of the best F1 on the calibration slice, its libraries weighed as
  ``naming.library_weights`` says ({"kind", its parameter, "calibration_f1"}); the best of each
  kind under ``by_kind``."""
  weights = naming.library_weights([i.get("library", "") for i in calibration.info])
  scored = [(naming.score(name_head.apply_rule(r, names, probs), calibration.tokens,
                          weights)["f1"], i, r) for i, r in enumerate(rules())]
  by_kind = {}
  for f1, _, r in scored:
    if f1 > by_kind.get(r["kind"], (-1.0, None))[0]:
      by_kind[r["kind"]] = (f1, r)
  best = max(scored, key=lambda x: (x[0], -x[1]))
  return {**best[2], "calibration_f1": best[0],
          "by_kind": {k: {**r, "calibration_f1": f1} for k, (f1, r) in by_kind.items()}}


def report(test: name_labels.Named, tokens: list[str], rule: dict, names, probs,
           shown: int = 5) -> dict:
  """The held-out scores of ``rule`` (and of each kind's best rule), the share of test
  sub-tokens outside the vocabulary, and one prediction per function."""
  predicted = name_head.apply_rule(rule, names, probs)
  known = set(tokens)
  real = [t for name in test.tokens for t in name]
  out = {"file": os.path.abspath(test.path), "sha256": test.sha256, "vocabulary": len(tokens),
         "rule": {k: v for k, v in rule.items() if k != "by_kind"},
         **naming.score(predicted, test.tokens),
         "test_tokens_outside_vocabulary": sum(t not in known for t in real) / max(1, len(real)),
         "rules": {k: {**r, **naming.score(name_head.apply_rule(r, names, probs), test.tokens)}
                   for k, r in rule.get("by_kind", {}).items()}}
  out["predictions"] = [
      {"line": line, "tokens": truth, "predicted": guess,
       "top": [[t, round(float(p), 4)] for t, p in zip(n[:shown], ps[:shown])], **info}
      for line, truth, guess, n, ps, info in zip(test.lines, test.tokens, predicted, names,
                                                 probs, test.info)]
  return out


def scored(task: NamingTask, calibration, test) -> dict:
  """The rule chosen on the calibration slice from the model's best tokens there
  (``calibration``: (tokens, probabilities)) and its held-out report (``report``) from the
  model's best tokens on the test file; where the task has calls, the better of that rule and
  the one reading them (:func:`with_calls`), and then ``without_calls``: the model's own rule
  and held-out scores, and ``without_model``: the calls' and namespace's alone
  (:func:`without_model`)."""
  rule = choose_rule(*calibration, task.calibration)
  if task.copy is None:
    return report(task.test, task.tokens, rule, *test)
  shares = [file_shares(n) for n in (task.calibration, task.test)]  # read once, used twice
  best, merged = with_calls(rule, task, calibration, test, shares)
  out = report(task.test, task.tokens, best, *merged)
  if best.get("calls"):
    alone = name_head.apply_rule(rule, *test)
    out["without_calls"] = {"rule": {k: v for k, v in rule.items() if k != "by_kind"},
                            **naming.score(alone, task.test.tokens)}
    out["without_model"] = without_model(task, shares)
  return out


def file_of(info: dict) -> str:
  """The file a labelled function comes from (its ``binary``, else its ``library``): the unit
  whose functions' calls show a namespace (``callee_copy.file_shares``)."""
  return str(info.get("binary") or info.get("library") or "")


def file_shares(named: name_labels.Named) -> list:
  return callee_copy.shares_by_file(named.calls, [file_of(i) for i in named.info])


def gated_rule(task: NamingTask, calibration, test, shares: list):
  """The rule chosen on the model's tokens (``calibration``, ``test``: (tokens, probabilities)),
  the called names' and their file's namespace, scored by a gate fitted on the calibration slice
  (``callee_copy.fit_gate``; the rule marked ``"calls": true`` and carrying its ``"gate"``;
  ``shares``: :func:`file_shares` of the slice and of the test file) → (the rule, the held-out
  tokens and scores it reads)."""
  named = task.calibration
  weights = naming.library_weights([i.get("library", "") for i in named.info])
  gate = callee_copy.fit_gate(*calibration, task.copy, named.calls, named.tokens, weights,
                              shares[0])
  gated = [callee_copy.gated(*best, task.copy, n.calls, gate, TOP, sh)
           for best, n, sh in ((calibration, named, shares[0]), (test, task.test, shares[1]))]
  return {**choose_rule(*gated[0], named), "calls": True, "gate": gate.as_json()}, gated[1]


def with_calls(rule: dict, task: NamingTask, calibration, test, shares: list):
  """The better, on the calibration slice, of ``rule`` (the model's tokens alone) and
  :func:`gated_rule`'s → (the rule, the held-out tokens and scores it reads)."""
  both, gated = gated_rule(task, calibration, test, shares)
  if both["calibration_f1"] <= rule["calibration_f1"]:
    return rule, test
  return both, gated


def without_model(task: NamingTask, shares: list) -> dict:
  """:func:`gated_rule` with no model tokens (the called names and the file's namespace
  alone): what the encoder's tokens add is the run's F1 less this one's."""
  empty = [([[] for _ in range(len(n))], [[] for _ in range(len(n))])
           for n in (task.calibration, task.test)]
  rule, (names, probs) = gated_rule(task, *empty, shares)
  return {"rule": {k: v for k, v in rule.items() if k not in ("by_kind", "gate")},
          **naming.score(name_head.apply_rule(rule, names, probs), task.test.tokens)}


class NameLog(base_run.FinetuneLog):
  """The rows of a naming fine-tune: binary cross-entropy summed over the vocabulary, the
  batch's micro token F1 at p >= 0.5 (``f1``), functions and tokens per second; evaluation
  rows ``eval_precision``, ``eval_recall``, ``eval_f1``, ``eval_exact``."""

  rows = "functions"
  score = "f1"
  advice = "Lower train.learning_rate (train.nonfinite=skip skips such steps instead)"


# ----------------------------------------------------------------------------- the run
def check_inputs(config, workdir: str) -> NamingTask:
  """The checks that need no runtime and write nothing: the config, both files, the
  vocabulary, the calibration split (the start model's are :func:`base_run.check`'s)."""
  finetune_config.check_config(config)
  f = config.finetune
  train = name_labels.read(f.labels, "--labels")
  test = name_labels.read(f.eval_labels, "--eval-labels")
  targets = name_labels.without_own(train, float(f.name_library_share))
  tokens = name_labels.vocabulary(targets, int(f.name_min_count))
  fit_rows, held = name_labels.calibration_split(train, float(f.name_calibration),
                                                 int(config.train.seed))
  # The rule is chosen on whole names, as the test file is scored.
  fit, calibration = targets.subset(fit_rows), train.subset(held)
  labels_lib.check_enough(fit, config.train.batch_size)
  check_vocab(workdir, tokens)
  whole = train.subset(fit_rows)
  copy = callee_copy.fit(whole.calls, whole.tokens) if train.has_calls else None
  return NamingTask(train=train, test=test, tokens=tokens, fit=fit, calibration=calibration,
                    copy=copy)


def check_vocab(workdir: str, tokens: list[str]) -> None:
  """A workdir that holds a naming run's vocabulary holds this task's."""
  if os.path.exists(os.path.join(workdir, name_head.VOCAB)):
    saved = name_head.load_vocab(workdir)["tokens"]
    name_head.check_same(saved, tokens, f"--workdir {workdir}",
                         "resume with the task (and finetune.name_min_count, "
                         "name_library_share) it was trained on, or give a new --workdir")


def finetune(config, workdir: str, *, allow_config_change: bool = False, inputs=None,
             say: Callable[[str], None] = logging.info, checked: bool = False) -> dict:
  """Fine-tunes a naming head (resuming from ``workdir`` if it holds a checkpoint); returns
  the last row (with the last evaluation's ``eval_f1`` …)."""
  inputs = inputs or base_run.check(config, workdir, check_inputs)
  return base_run.run_finetune(NameFinetune(config, workdir, inputs, say), allow_config_change,
                               checked)


def done_line(row: dict, workdir: str) -> str:
  """``lmscale finetune``'s last words after a finished run: the held-out scores, the model."""
  return (f"held-out token F1 {row.get('eval_f1', float('nan')):.3f}, exact "
          f"{row.get('eval_exact', float('nan')):.3f} ({workdir}/{EVAL_REPORT}); the "
          "model: lmscale name --workdir, lmscale export-hf --workdir")


class NameFinetune(classify_run.LabelledFinetune):
  """Naming fine-tuning in the one loop: batches of the training rows outside the calibration
  slice (:class:`name_labels.NameBatches`, its position saved), the rule chosen and the
  held-out file scored every ``train.eval_every`` steps and after the last."""

  def build(self) -> None:
    t, inputs, f = self.config.train, self.inputs, self.config.finetune
    if jax.process_index() == 0:
      name_head.save_vocab(self.workdir, inputs.tokens, int(f.name_min_count),
                           inputs.train.sha256)
      if inputs.copy is not None:
        callee_copy.save(self.workdir, inputs.copy)
    prior = name_labels.targets(inputs.fit, inputs.tokens).mean(0)
    self.steps = build_steps(self.config, self.model.cfg, prior)
    self.batches = name_labels.NameBatches(inputs.fit, inputs.tokens, self.model, seed=t.seed,
                                           batch_size=t.batch_size,
                                           process_index=jax.process_index(),
                                           process_count=jax.process_count())
    self.calibration_ids, _ = labels_lib.encode_all(self.model, inputs.calibration.texts)
    self.test_ids, _ = labels_lib.encode_all(self.model, inputs.test.texts)

  def describe(self) -> str:
    i = self.inputs
    return (f"{len(i.fit)} functions from {i.train.path} ({len(i.calibration)} more held out "
            f"to choose the prediction rule), {len(i.test)} scored in {i.test.path}, head "
            f"{self.model.cfg.hidden}→{len(i.tokens)} name sub-tokens (sigmoid, mean pooling)")

  def make_log(self, start: int, checkpointer) -> NameLog:
    return NameLog(self.config, self.workdir, start, checkpointer, self.batches, self.say)

  def best(self, params, ids: np.ndarray):
    top = classify_run.predict(self.steps, params, ids, self.config.train.batch_size,
                               self.model.special_ids["[PAD]"])
    return best_tokens(self.inputs.tokens, top)

  def evaluate(self, state) -> dict:
    i = self.inputs
    scores = scored(i, self.best(state.params, self.calibration_ids),
                    self.best(state.params, self.test_ids))
    step = int(jax.device_get(state.step))
    if jax.process_index() == 0:
      file_io.atomic_write_json(os.path.join(self.workdir, EVAL_REPORT),
                                {"step": step, "calibration_functions": len(i.calibration),
                                 **scores})
    r = scores["rule"]
    self.say(f"step {step}: held-out token precision {scores['precision']:.3f}, recall "
             f"{scores['recall']:.3f}, F1 {scores['f1']:.3f}, exact {scores['exact']:.3f} "
             f"({len(i.test)} functions; rule {r['kind']} "
             f"{r.get('threshold', r.get('k'))}{' with the called names' if r.get('calls') else ''}"
             f", chosen on {len(i.calibration)})")
    return {f"eval_{k}": scores[k] for k in ("precision", "recall", "f1", "exact")}
