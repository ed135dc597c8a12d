"""Scores of a sequence classifier on a held-out split: accuracy, macro-F1, per-label
precision/recall/F1 and the confusion matrix, from scikit-learn's metrics (one definition for
the fine-tuned head and the TF-IDF + logistic-regression baseline, so their numbers compare).

Macro-F1 averages over ``labels`` (the task's whole label set), not over the labels that happen
to occur: a class the classifier never predicts, or one absent from a small test split, counts
as F1 0 (``zero_division=0``) instead of silently leaving the average.
"""

from __future__ import annotations

import collections


def classification_scores(y_true: list[str], y_pred: list[str], labels: list[str]) -> dict:
  """``{"accuracy", "macro_f1", "per_label": {label: {precision, recall, f1, support}},
  "confusion": [[…]] (rows true, columns predicted, in ``labels`` order), "labels"}``."""
  from sklearn import metrics  # imported when scoring (~0.5 s), not by whoever imports evals
  labels = list(labels)
  p, r, f, n = metrics.precision_recall_fscore_support(
      y_true, y_pred, labels=labels, average=None, zero_division=0)
  per_label = {lab: {"precision": float(p[i]), "recall": float(r[i]), "f1": float(f[i]),
                     "support": int(n[i])} for i, lab in enumerate(labels)}
  return {"accuracy": float(metrics.accuracy_score(y_true, y_pred)),
          "macro_f1": float(f.mean()) if len(labels) else 0.0,
          "per_label": per_label,
          "confusion": metrics.confusion_matrix(y_true, y_pred, labels=labels).tolist(),
          "labels": labels}


def majority_scores(y_train: list[str], y_true: list[str], labels: list[str]) -> dict:
  """The scores of always predicting the training split's most frequent label (ties: the
  first in ``labels``): the floor a classifier has to beat."""
  counts = collections.Counter(y_train)
  top = max(labels, key=lambda lab: (counts[lab], -labels.index(lab)))
  return {"label": top, **classification_scores(y_true, [top] * len(y_true), labels)}
