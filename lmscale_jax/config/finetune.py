"""The configuration of fine-tuning (``finetune.task``: contrastive, finetune/contrastive_run.py;
classify, finetune/classify_run.py; name, finetune/name_run.py): an ml_collections
config like ``configs/*.py``, so ``--config.section.key=value`` overrides it
(lmscale finetune), with the same ``train``, ``checkpoint`` and ``distributed``
sections as pretraining (its optimizer, checkpointing and multi-process start-up read them).
"""

from __future__ import annotations

import ml_collections

from lmscale_jax.config import checks as config_checks
from lmscale_jax.config import defaults as config_defaults
from lmscale_jax.config import modes
from lmscale_jax.errors import ConfigError

INIT_SOURCES = ("workdir", "hf", "random")
TASKS = ("contrastive", "classify", "name")
LABELLED = ("classify", "name")  # the tasks of a --labels/--eval-labels pair of files


def get_config() -> ml_collections.ConfigDict:
  base = config_defaults.get_base_config()
  c = ml_collections.ConfigDict()
  c.data = ml_collections.ConfigDict()
  c.data.pairs = ""              # a similarity-benchmark-format file (finetune_pairs)
  c.data.max_groups = 0          # > 0: train on that many of its groups (seeded; learning curves)

  c.init = ml_collections.ConfigDict()
  c.init.source = "workdir"      # workdir | hf | random (see the module docstring)
  c.init.path = ""               # the run, HF directory, or (random) whose architecture
  c.init.step = -1               # (workdir) the checkpoint; -1 = the latest
  c.init.tokenizer = ""          # (workdir, random) the dataset's tokenizer.json if moved

  c.finetune = ml_collections.ConfigDict()
  c.finetune.task = "contrastive"  # contrastive (pairs) | classify | name (labels: JSONL files)
  c.finetune.labels = ""         # (classify, name) the training file: {"text", "label"} per
                                 # line (name: {"text", "tokens"}, lmscale naming-build's)
  c.finetune.eval_labels = ""    # (classify, name) the held-out file scored every eval_every
  c.finetune.name_min_count = 2  # (name) a sub-token is an output if this many training names
                                 # hold it (XFL's vocabulary)
  c.finetune.name_calibration = 0.1  # (name) the share of training rows (whole libraries) held
                                 # out to choose the prediction rule on
  c.finetune.name_library_share = 0.5  # (name) a sub-token in at least this share of one training
                                 # library's names is that library's own (its namespace: xml,
                                 # g, sqlite) and not a target there: a new project's own never
                                 # is in training (docs/naming.md; 0: every sub-token a target)
  c.finetune.windows = 1         # (classify) a function longer than the model's sequence is read
                                 # as up to this many windows cut at instructions: each trains as
                                 # an example, a function scores as their mean log-probabilities
                                 # (provenance: docs/similarity.md); 1 = its first window only
  c.finetune.temperature = 0.05  # InfoNCE logits = cosine / temperature
  c.finetune.proj_dim = 128      # the projection head's output size
  c.finetune.pool = "mean"       # mean (non-pad tokens) | cls
  c.finetune.freeze_layers = 0   # k > 0: the embeddings and the k lowest layers stay fixed
  c.finetune.dropout = 0.1       # the encoder's dropout while fine-tuning (model.dropout)
  c.finetune.dtype = "float32"   # compute dtype (bfloat16 on GPUs); parameters stay float32

  c.train = ml_collections.ConfigDict()
  c.train.batch_size = 32        # pairs per step (global); each row's negatives: the others
  c.train.steps = 1000
  c.train.learning_rate = 5e-5
  c.train.warmup_steps = 100
  for key in ("warmup_fraction", "schedule", "end_lr_frac", "weight_decay", "b1", "b2", "eps",
              "clip_norm", "seed"):
    c.train[key] = base.train[key]
  c.train.log_every = 10
  c.train.eval_every = 500       # (classify) steps between held-out scores (and after the last)
  # The levers of the one train step (train/steps.py), pretraining's defaults: FSDP, gradient
  # accumulation (GradCache: the negatives still span the global batch), the gradient
  # reduction's dtype and shape, the encoder's recomputation, dropout's generator, what a
  # non-finite step does, fault injection (tests).
  for key in ("fsdp", "grad_accum_steps", "grad_allreduce_dtype", "grad_allreduce", "remat",
              "dropout_rng", "nonfinite", "max_consecutive_nonfinite",
              "inject_nonfinite_steps"):
    c.train[key] = base.train[key]

  c.checkpoint = base.checkpoint
  c.checkpoint.every = 500
  c.checkpoint.keep = 2
  c.distributed = base.distributed
  return c


# ----------------------------------------------------------------------------- config
_INTS = (("train.batch_size", 2), ("train.steps", 1), ("train.warmup_steps", 0),
         ("train.log_every", 1), ("train.eval_every", 1), ("train.seed", 0),
         ("train.grad_accum_steps", 1),
         ("train.max_consecutive_nonfinite", 1), ("checkpoint.every", 1),
         ("checkpoint.keep", 1), ("finetune.proj_dim", 1), ("finetune.freeze_layers", 0),
         ("init.step", -1), ("data.max_groups", 0), ("finetune.name_min_count", 1),
         ("finetune.windows", 1))
_FLOATS = (("finetune.temperature", 0.0, 100.0, True, False),
           ("finetune.name_calibration", 0.0, 0.5, True, True),
           ("finetune.name_library_share", 0.0, 1.0, False, True),
           ("finetune.dropout", 0.0, 1.0, False, True),
           ("train.learning_rate", 0.0, float("inf"), True, True),
           ("train.end_lr_frac", 0.0, 1.0, False, False),
           ("train.warmup_fraction", 0.0, 1.0, False, True),
           ("train.weight_decay", 0.0, float("inf"), False, True),
           ("train.b1", 0.0, 1.0, False, True), ("train.b2", 0.0, 1.0, False, True),
           ("train.eps", 0.0, float("inf"), True, True),
           ("train.clip_norm", 0.0, float("inf"), True, True))


def check_config(config) -> None:
  """Types, ranges and choices of every key, one line naming the first bad one."""
  for key, low in _INTS:
    config_checks.check_int(config, key, low)
  for key, *bounds in _FLOATS:
    config_checks.check_float(config, key, *bounds)
  for value, options, key in (
      (config.init.source, INIT_SOURCES, "init.source"),
      (config.finetune.task, TASKS, "finetune.task"),
      (config.finetune.pool, modes.POOLS, "finetune.pool"),
      (config.finetune.dtype, modes.DTYPES, "finetune.dtype"),
      (config.train.schedule, modes.SCHEDULES, "train.schedule"),
      (config.train.nonfinite, modes.NONFINITE_MODES, "train.nonfinite"),
      (config.train.grad_allreduce_dtype, modes.DTYPES, "train.grad_allreduce_dtype"),
      (config.train.grad_allreduce, modes.GRAD_ALLREDUCE, "train.grad_allreduce"),
      (config.train.dropout_rng, modes.DROPOUT_RNGS, "train.dropout_rng"),
      (config.train.remat, modes.REMAT, "train.remat"),
      (config.checkpoint.on_full, modes.ON_FULL, "checkpoint.on_full")):
    config_checks.one_of(value, options, key)
  config_checks.parse_steps(config.train.inject_nonfinite_steps, "train.inject_nonfinite_steps")
  _check_task_inputs(config)
  if not config.init.path:
    raise ConfigError("init.path is empty: give the model to start from (--init-workdir RUN, "
                      "--init-hf DIR or --init-random RUN)")


def _check_task_inputs(config) -> None:
  """The task's files are given (and only its own)."""
  f = config.finetune
  if f.task == "contrastive" and not config.data.pairs:
    raise ConfigError("data.pairs is empty: give the pairs file (--pairs FILE)")
  if f.windows > 1 and f.task != "classify":
    raise ConfigError(f"finetune.windows={f.windows}: only --task classify reads a function as "
                      f"several windows; leave it at 1 for --task {f.task}")
  if f.task == "contrastive" and (f.labels or f.eval_labels):
    raise ConfigError("finetune.labels/eval_labels are the classification and naming tasks' "
                      "files: give --task classify or --task name with them, or leave them out")
  if f.task not in LABELLED:
    return
  if config.data.pairs:
    raise ConfigError(f"data.pairs (--pairs) is the contrastive task's file: --task {f.task} "
                      "trains on --labels FILE")
  if not f.labels or not f.eval_labels:
    raise ConfigError(f"finetune.labels and finetune.eval_labels: --task {f.task} needs both "
                      "(--labels TRAIN.jsonl --eval-labels TEST.jsonl)")
  if f.pool != "mean":
    raise ConfigError(f"finetune.pool={f.pool}: the {f.task} head pools by the mean over "
                      "non-pad tokens (undertale's); leave --pool out")
