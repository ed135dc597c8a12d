"""Fine-tune an encoder: for binary code similarity (contrastive), as a classifier, or to name functions.

  lmscale finetune --pairs PAIRS.jsonl --workdir OUT
      (--init-workdir RUN [--step N] [--tokenizer F] | --init-hf DIR | --init-random RUN_OR_DIR)
      [--steps 1000] [--batch-size 32] [--learning-rate 5e-5] [--warmup-steps 100]
      [--temperature 0.05] [--proj-dim 128] [--pool mean|cls] [--freeze-layers 0]
      [--dropout 0.1] [--seed 0] [--checkpoint-every 500] [--log-every 10] [--max-groups 0]
      [--allow-config-change] [--config FILE] [--config.SECTION.KEY=VALUE …]
  lmscale finetune --task classify --labels TRAIN.jsonl --eval-labels TEST.jsonl --workdir OUT
      (--init-workdir RUN …) [--eval-every 500] [--windows 1] [the flags above but --pairs,
      --temperature, --proj-dim, --pool, --max-groups]
  lmscale finetune --task name --labels DIR/train.jsonl --eval-labels DIR/test.jsonl
      --workdir OUT (--init-workdir RUN …) [the classify flags]

The default task, contrastive: PAIRS is a file in the similarity benchmark's format (lmscale
similarity-build): each step takes --batch-size distinct source functions and two of their
compiled variants. Start from a pretraining run's checkpoint, an HF directory, or
(--init-random, the baseline) fresh weights of a run's or HF directory's architecture. The
hyper-parameters are lmscale_jax/config/finetune.py's config (or --config FILE's get_config()
of that shape); the flags above set its common keys, --config.K=V any key (e.g.
--config.finetune.dtype=bfloat16 on GPUs), typed by the key's default
(lmscale_jax.config.loader). OUT is a workdir like
pretraining's: rerun the same command to resume a stopped run; the result is a model for
lmscale embed, lmscale eval-similarity --workdir OUT and lmscale export-hf --workdir OUT.

--task classify: TRAIN and TEST are JSONL files of {"text": "<pretokenised instruction text>",
"label": "<class>"} objects; a masked-mean-pooled linear head learns the labels, and TEST's
accuracy and macro-F1 are logged every --eval-every steps and after the last (OUT's
classification_eval.json); lmscale classify --workdir OUT --labels FILE scores any file.
--windows N reads a function longer than the model's sequence as up to N windows cut at
instructions: each trains as an example of its label, and a function is scored by their mean
log-probabilities (8 on provenance: docs/similarity.md).

--task name: TRAIN and TEST are a naming task's files (lmscale naming-build: {"text", "name",
"tokens": [sub-tokens]} per line); a masked-mean-pooled head of one sigmoid per name sub-token
seen in --config.finetune.name_min_count (2) training names learns them, each name less its
library's own sub-tokens (its namespace: in --config.finetune.name_library_share, 0.5, of that
library's names; 0 keeps every one); the prediction rule
(a probability threshold, or the k best tokens) is chosen on a slice of TRAIN's libraries
held out of training (--config.finetune.name_calibration, 0.1), and TEST's token precision,
recall, F1 and exact-name accuracy are logged every --eval-every steps and after the last
(OUT's naming_eval.json); lmscale name --workdir OUT --elf FILE names a binary's functions.

Several processes start as lmscale train does, through the same start-up and exit codes
(lmscale_jax.train.startup: LMSCALE_* variables or Slurm; the config's distributed section).
See docs/finetune.md.
"""

from __future__ import annotations

import argparse
import sys

from lmscale_jax import exits
from lmscale_jax.cli import args as cli_args
from lmscale_jax.config import finetune as finetune_config
from lmscale_jax.config import loader
from lmscale_jax.errors import UserError
from lmscale_jax.train import startup

# flag → config key; None defaults leave the config's value.
FLAGS = {"steps": "train.steps", "batch_size": "train.batch_size",
         "learning_rate": "train.learning_rate", "warmup_steps": "train.warmup_steps",
         "temperature": "finetune.temperature", "proj_dim": "finetune.proj_dim",
         "pool": "finetune.pool", "freeze_layers": "finetune.freeze_layers",
         "dropout": "finetune.dropout", "seed": "train.seed",
         "checkpoint_every": "checkpoint.every", "log_every": "train.log_every",
         "max_groups": "data.max_groups", "eval_every": "train.eval_every",
         "windows": "finetune.windows"}


def parser() -> argparse.ArgumentParser:
  p = cli_args.Parser(prog="lmscale finetune", description=__doc__.splitlines()[0],
                      epilog="--config.SECTION.KEY=VALUE sets any key of "
                      "lmscale_jax/config/finetune.py (after the flags above)")
  p.add_argument("--task", choices=["contrastive", "classify", "name"], default=None,
                 help="contrastive (pairs, the default), classify or name (labels)")
  p.add_argument("--pairs", default="", type=cli_args.input_file, metavar="PAIRS.jsonl",
                 help="(contrastive) a similarity-benchmark-format file (lmscale "
                 "similarity-build)")
  p.add_argument("--labels", default="", type=cli_args.input_file, metavar="TRAIN.jsonl",
                 help='(classify) the training examples: {"text", "label"} per line; (name) '
                 'a naming task\'s train.jsonl')
  p.add_argument("--eval-labels", "--eval_labels", dest="eval_labels", default="",
                 type=cli_args.input_file, metavar="TEST.jsonl",
                 help="(classify, name) the held-out examples, scored every --eval-every steps")
  p.add_argument("--workdir", required=True, metavar="OUT", help="the run's directory")
  start = p.add_mutually_exclusive_group(required=True)
  start.add_argument("--init-workdir", metavar="RUN", help="a pretraining run's --workdir")
  start.add_argument("--init-hf", metavar="DIR", help="a Hugging Face BERT directory")
  start.add_argument("--init-random", metavar="RUN_OR_DIR",
                     help="fresh weights of this run's (or HF directory's) architecture")
  p.add_argument("--step", type=cli_args.number(int, 0, 1 << 62), default=None,
                 help="(--init-workdir) its checkpoint; default the latest")
  p.add_argument("--tokenizer", default="", type=cli_args.input_file, metavar="tokenizer.json",
                 help="(--init-workdir/--init-random of a run) the dataset's tokenizer")
  num = cli_args.number
  for flag, kind, lo, hi, what in (
      ("steps", int, 1, 1 << 40, "training steps"),
      ("batch_size", int, 2, 1 << 20, "pairs (classify: examples) per step, global"),
      ("learning_rate", float, 1e-12, 10.0, "peak learning rate"),
      ("warmup_steps", int, 0, 1 << 40, "linear warm-up steps"),
      ("temperature", float, 1e-6, 100.0, "InfoNCE temperature"),
      ("proj_dim", int, 1, 1 << 16, "projection head output size"),
      ("freeze_layers", int, 0, 1 << 10, "freeze the embeddings and this many lowest layers"),
      ("dropout", float, 0.0, 0.99, "encoder dropout while fine-tuning"),
      ("seed", int, 0, (1 << 31) - 1, "batches, dropout, head (and --init-random) seed"),
      ("checkpoint_every", int, 1, 1 << 40, "steps between checkpoints"),
      ("log_every", int, 1, 1 << 40, "steps per metrics row"),
      ("max_groups", int, 0, 1 << 40, "train on a seeded random subset of this many groups "
       "(0: all; learning curves)"),
      ("eval_every", int, 1, 1 << 40, "(classify, name) steps between held-out scores"),
      ("windows", int, 1, 1 << 10, "(classify) read a longer function as up to this many "
       "windows: train on each, score by their mean (default 1: its first window)")):
    names = dict.fromkeys([f"--{flag.replace('_', '-')}", f"--{flag}"])  # both spellings
    p.add_argument(*names, dest=flag, default=None, type=num(kind, lo, hi), help=what)
  p.add_argument("--pool", choices=["mean", "cls"], default=None,
                 help="mean over non-pad tokens (default) or [CLS]")
  p.add_argument("--allow-config-change", "--allow_config_change", action="store_true",
                 help="resume under changed hyper-parameters (recorded in config.json)")
  p.add_argument("--config", default="", type=cli_args.input_file, metavar="FILE",
                 help="a .py whose get_config() replaces lmscale_jax/config/finetune.py's "
                 "defaults (the flags and --config.K=V still apply)")
  return p


def build_config(a, rest: list[str]):
  """The run's config: --config FILE's (else the defaults), the flags, then --config.K=V."""
  c = loader.load(a.config, defaults=finetune_config.get_config)
  if a.task:
    c.finetune.task = a.task
  c.data.pairs = a.pairs or c.data.pairs
  c.finetune.labels = a.labels or c.finetune.labels
  c.finetune.eval_labels = a.eval_labels or c.finetune.eval_labels
  source = ("workdir", a.init_workdir) if a.init_workdir else (
      ("hf", a.init_hf) if a.init_hf else ("random", a.init_random))
  c.init.source, c.init.path = source
  c.init.step = -1 if a.step is None else a.step
  c.init.tokenizer = a.tokenizer
  if a.step is not None and not a.init_workdir:
    raise UserError("--step is the --init-workdir checkpoint: give it with --init-workdir")
  for flag, key in FLAGS.items():
    value = getattr(a, flag)
    if value is not None:
      section, leaf = key.split(".")
      c[section][leaf] = value
  loader.apply_overrides(c, loader.split_overrides(rest)[0])
  return c  # checked once, by the task's check_inputs (before the runtime: run's checks)


def run(config, workdir: str, allow_change: bool) -> int:
  """The run through the one start-up (lmscale_jax.train.startup): the inputs checked before
  anything is created, then the runtime, the workdir lock and preflight; its exit code."""
  from lmscale_jax.finetune import base_run  # jax: not for --help

  module = _task_module(config)
  return startup.run(config, workdir, lambda inputs: _finetune(config, workdir, allow_change,
                                                                 inputs),
                     checks=lambda: base_run.check(config, workdir, module.check_inputs))


def _task_module(config):
  if config.finetune.task == "name":
    from lmscale_jax.finetune import name_run
    return name_run
  if config.finetune.task == "classify":
    from lmscale_jax.finetune import classify_run
    return classify_run
  from lmscale_jax.finetune import contrastive_run
  return contrastive_run


def _finetune(config, workdir: str, allow_change: bool, inputs) -> None:
  import jax

  module = _task_module(config)
  say = lambda line: print(line, flush=True)  # noqa: E731
  # checked: start-up's preflight checked the batch over the job's devices.
  row = module.finetune(config, workdir, allow_config_change=allow_change, inputs=inputs,
                        say=say, checked=True)
  if jax.process_index() == 0 and "loss" not in row:
    print(f"{workdir} is already at step {config.train.steps}: nothing to train (a larger "
          "--steps continues it)")
  elif jax.process_index() == 0 and row["step"] == config.train.steps:
    print(f"done: step {row['step']}, loss {row['loss']:.4f}, {module.done_line(row, workdir)}")


def main(argv=None) -> int:
  parser_ = parser()
  a, rest = parser_.parse_known_args(argv)
  stray = [x for x in rest if not x.startswith("--config.")]
  if stray:
    parser_.error(f"unrecognized arguments: {' '.join(stray)}")
  try:
    config = build_config(a, rest)
  except UserError as e:  # before any start-up: nothing to clean up
    return exits.error_line(str(e), exits.EXIT_ERROR)
  return run(config, a.workdir, a.allow_config_change)


if __name__ == "__main__":
  sys.exit(main())
