"""A classification fine-tuning run (``finetune.task="classify"``; undertale's
sequence-classification fine-tune): the encoder, the mean of its last hidden layer over the
non-pad tokens and a Dense head to one logit per class (:mod:`lmscale_jax.model.classifier`),
trained with cross-entropy on a labels file (:mod:`lmscale_jax.finetune.labels`) and scored
on a held-out one.

  finetune(config, workdir)   # config: get_config() with finetune.task="classify",
                              # finetune.labels, finetune.eval_labels and init.* set

Everything but the head, the batches and the evaluation is every fine-tuning run's
(:mod:`lmscale_jax.finetune.base_run`: the start model, frozen layers, the workdir, resume) and
the step is every run's with the classification task (:func:`classification_task`, a
SumTask: every ``train.*`` lever). The workdir also holds ``labels.json`` (the class names,
sorted: class ``i`` is ``names[i]``) and, after each evaluation (every ``train.eval_every``
steps and after the last), ``classification_eval.json``: accuracy, macro-F1, per-class
precision/recall/F1/support and the confusion matrix on the held-out file
(:func:`lmscale_jax.evals.classification.classification_scores`), beside the majority class's.
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
from lmscale_jax.evals import classification
from lmscale_jax.finetune import base_run, finetune_state
from lmscale_jax.finetune import labels as labels_lib
from lmscale_jax.model import bert as model_lib
from lmscale_jax.model import classifier as classifier_lib
from lmscale_jax.store import file_io
from lmscale_jax.train import checkpoint as ckpt_lib
from lmscale_jax.train import steps as steps_lib
from lmscale_jax.train import tasks

EVAL_REPORT = "classification_eval.json"


@dataclasses.dataclass
class LabelledTask:
  """The two files of a classification task, read and checked, and its class names."""
  train: labels_lib.Examples
  test: labels_lib.Examples
  names: list[str]


# ----------------------------------------------------------------------------- steps
def classification_task(model, labels: Callable, pad_id: int) -> tasks.SumTask:
  """A classification fine-tune's cross-entropy (:mod:`lmscale_jax.model.classifier`) summed
  over the rows of batches ``{"ids" [B,S], "label" [B]}`` / their count; a row labelled -1
  counts nowhere. ``labels(params)``: "frozen" or "train" per leaf, as the contrastive task's."""

  def loss_sum(params, batch, rng):
    logits = model.apply({"params": finetune_state.stop_frozen(params, labels)}, batch["ids"],
                         deterministic=False, rngs={"dropout": rng})
    real = batch["label"] >= 0
    target = jnp.where(real, batch["label"], 0)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), target)
    correct = (jnp.argmax(logits, -1) == target) & real
    return (ce * real).sum(), {"correct": correct.sum(),
                               "tokens": (batch["ids"] != pad_id).sum()}

  def metrics(sums):
    return {"accuracy": sums["correct"] / jnp.maximum(sums["weight"], 1.0),
            "tokens": sums["tokens"]}

  return tasks.SumTask(loss_sum=loss_sum,
                       weight=lambda b: (b["label"] >= 0).sum(dtype=jnp.float32),
                       metrics=metrics, compute_cast=finetune_state.head_in_float32("classifier"))


def build_steps(config, cfg, num_classes: int, mesh=None, *,
                manual: bool | None = None) -> steps_lib.Steps:
  """The one train step (:func:`steps_lib.build_task_steps`) of the classification task, with
  every lever of ``config.train``. ``init``: (encoder params, rng) -> TrainState with a fresh
  head; ``train_step``: (state, {"ids", "label"}) -> (state, metrics); ``eval_step``:
  (params, ids [B,S]) -> the classes' log-probabilities [B,C]."""
  model = classifier_lib.SequenceClassifier(cfg, num_classes)
  optimizer, labels = finetune_state.optimizer(config)

  def init_state(bert, rng):
    params = {"bert": bert, "classifier": classifier_lib.init_head(cfg, num_classes, rng)}
    return steps_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                                opt_state=optimizer.init(params))

  def predict(params, ids):
    logits = model.apply({"params": params}, ids, deterministic=True)
    return jax.nn.log_softmax(logits.astype(jnp.float32), -1)

  bert = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.key(0)))
  task = classification_task(model, labels, int(cfg.pad_id))
  return steps_lib.build_task_steps(config, task, model, optimizer, init_state,
                                    (bert, jax.random.key(0)), compute_dtype=str(cfg.dtype),
                                    mesh=mesh, manual=manual, eval_step=predict)


# ----------------------------------------------------------------------------- scores
def windows_of(run_config) -> int:
  """How many windows the run reads a function as (``finetune.windows``; 1 in runs before it)."""
  return int(run_config.finetune.get("windows", 1))


def read_windows(model, examples: labels_lib.Examples,
                 most: int) -> tuple[np.ndarray, np.ndarray]:
  """ids [rows, S] of ``examples``, each read as up to ``most`` windows, and each row's
  example (:func:`labels_lib.windowed`)."""
  rows, owner = labels_lib.windowed(examples, model, most)
  return labels_lib.encode_all(model, rows.texts)[0], owner


def pooled_classes(log_probs: np.ndarray, owner: np.ndarray, count: int) -> np.ndarray:
  """Each example's class: the best of its windows' mean log-probabilities."""
  return np.argmax(labels_lib.pooled(log_probs, owner, count), -1)


def report(test: labels_lib.Examples, names: list[str], predicted: np.ndarray,
           train: labels_lib.Examples | None = None) -> dict:
  """The scores of class ids ``predicted`` on ``test`` (and, given ``train``, the majority
  class's): what classification_eval.json and lmscale classify write."""
  guesses = [names[i] for i in np.asarray(predicted).tolist()]
  out = {"file": os.path.abspath(test.path), "sha256": test.sha256, "examples": len(test),
         **classification.classification_scores(test.labels, guesses, names)}
  if train is not None:
    majority = classification.majority_scores(train.labels, test.labels, names)
    out["majority"] = {k: majority[k] for k in ("label", "accuracy", "macro_f1")}
  return out


class ClassifyLog(base_run.FinetuneLog):
  """The rows of a classification fine-tune: cross-entropy, the batch's accuracy, examples and
  tokens per second, ``truncated_frac``; evaluation rows ``eval_accuracy``,
  ``eval_macro_f1``."""

  rows = "examples"
  advice = "Lower train.learning_rate (train.nonfinite=skip skips such steps instead)"


# ----------------------------------------------------------------------------- the run
def check_inputs(config, workdir: str) -> LabelledTask:
  """The task's checks that need no runtime and write nothing (the start model's are
  :func:`base_run.check`'s): the config, both labels files (the held-out labels among the
  training ones)."""
  finetune_config.check_config(config)
  f = config.finetune
  train = labels_lib.read(f.labels, "--labels")
  test = labels_lib.read(f.eval_labels, "--eval-labels")
  names = labels_lib.class_names(train)
  labels_lib.check_known(test, names)
  labels_lib.check_enough(train, config.train.batch_size)
  return LabelledTask(train=train, test=test, names=names)


def finetune(config, workdir: str, *, allow_config_change: bool = False, inputs=None,
             say: Callable[[str], None] = logging.info, checked: bool = False) -> dict:
  """Fine-tunes a classifier (resuming from ``workdir`` if it holds a checkpoint); returns
  the last row (with the last evaluation's ``eval_accuracy``, ``eval_macro_f1``).
  ``inputs``: ``base_run.check``'s result if the caller has it."""
  inputs = inputs or base_run.check(config, workdir, check_inputs)
  return base_run.run_finetune(ClassifyFinetune(config, workdir, inputs, say),
                               allow_config_change, checked)


def done_line(row: dict, workdir: str) -> str:
  """``lmscale finetune``'s last words after a finished run: the held-out scores, the model."""
  return (f"held-out accuracy {row.get('eval_accuracy', float('nan')):.3f}, macro-F1 "
          f"{row.get('eval_macro_f1', float('nan')):.3f} ({workdir}/{EVAL_REPORT}); "
          "the model: lmscale classify --workdir, lmscale export-hf --workdir")


class LabelledFinetune(base_run.FinetuneRun):
  """A fine-tune of a labels file (classification, naming): its checked inputs, scored every
  ``train.eval_every`` steps, and a resume refused where the training file changed."""

  def __init__(self, config, workdir: str, inputs: base_run.Checked,
               say: Callable[[str], None]):
    super().__init__(config, workdir, say, inputs.start)
    self.inputs = inputs.data  # LabelledTask, or name_run's NamingTask
    self.eval_every = int(self.config.train.eval_every)

  def check_resume(self, step: int) -> None:  # refused before anything is written
    labels_lib.check_resume(self.inputs.train, ckpt_lib.step_dir(self.workdir, step),
                            jax.process_index(), jax.process_count())


class ClassifyFinetune(LabelledFinetune):
  """Classification fine-tuning in the one loop: batches of labelled rows
  (:class:`labels_lib.LabelBatches`, its position saved), the held-out file scored every
  ``train.eval_every`` steps and after the last, :class:`ClassifyLog`'s rows."""

  def build(self) -> None:
    t, inputs = self.config.train, self.inputs
    if jax.process_index() == 0:
      classifier_lib.save_labels(self.workdir, inputs.names)
    self.steps = build_steps(self.config, self.model.cfg, len(inputs.names))
    self.windows = windows_of(self.config)
    self.train_rows, _ = labels_lib.windowed(inputs.train, self.model, self.windows)
    self.batches = labels_lib.LabelBatches(self.train_rows, inputs.names, self.model,
                                           seed=t.seed,
                                           batch_size=t.batch_size,
                                           process_index=jax.process_index(),
                                           process_count=jax.process_count())
    self.test_ids, self.test_owner = read_windows(self.model, inputs.test, self.windows)

  def describe(self) -> str:
    i = self.inputs
    read = (f" read as {len(self.train_rows)} windows (at most {self.windows} each; scored "
            "by their mean)" if self.windows > 1 else "")
    return (f"{len(i.train)} examples of {len(i.names)} classes from {i.train.path}{read}, "
            f"{len(i.test)} held out in {i.test.path}, head {self.model.cfg.hidden}→"
            f"{len(i.names)} (mean pooling)")

  def make_log(self, start: int, checkpointer) -> ClassifyLog:
    return ClassifyLog(self.config, self.workdir, start, checkpointer, self.batches, self.say)

  def evaluate(self, state) -> dict:
    log_probs = predict(self.steps, state.params, self.test_ids, self.config.train.batch_size,
                        self.model.special_ids["[PAD]"])
    predicted = pooled_classes(log_probs, self.test_owner, len(self.inputs.test))
    scores = report(self.inputs.test, self.inputs.names, predicted, self.inputs.train)
    step = int(jax.device_get(state.step))
    if jax.process_index() == 0:
      file_io.atomic_write_json(os.path.join(self.workdir, EVAL_REPORT),
                                {"step": step, **scores})
    self.say(f"step {step}: held-out accuracy {scores['accuracy']:.3f}, macro-F1 "
             f"{scores['macro_f1']:.3f} ({len(self.inputs.test)} examples; majority class "
             f"{scores['majority']['accuracy']:.3f})")
    return {"eval_accuracy": scores["accuracy"], "eval_macro_f1": scores["macro_f1"]}


def predict(steps: steps_lib.Steps, params, ids: np.ndarray, batch_size: int,
            pad_id: int) -> np.ndarray:
  """The predicted class of every row of ``ids`` [N,S] (every process holds them all), in
  global batches of ``batch_size`` rows (the last padded with [PAD] rows), each process
  giving its share of the rows as in training. (Any ``eval_step`` whose outputs, a tree of
  arrays, are per row: the naming task's top tokens.)"""
  share = batch_size // jax.process_count()
  first = jax.process_index() * share
  out = []
  for start in range(0, len(ids), batch_size):
    chunk = ids[start:start + batch_size]
    full = np.full((batch_size, ids.shape[1]), pad_id, np.int32)
    full[:len(chunk)] = chunk
    batch = jax.make_array_from_process_local_data(steps.batch_sharding,
                                                   full[first:first + share])
    out.append(jax.tree.map(lambda a, n=len(chunk): np.asarray(a)[:n],
                            jax.device_get(steps.eval_step(params, batch))))
  return jax.tree.map(lambda *parts: np.concatenate(parts), *out)
