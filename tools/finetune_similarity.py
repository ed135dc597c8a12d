"""Fine-tune an encoder for binary code similarity (contrastive, InfoNCE over in-batch negatives).

  python tools/finetune_similarity.py --pairs PAIRS.jsonl --workdir OUT
      (--init-workdir RUN [--step N] [--tokenizer F] | --init-hf DIR | --init-random RUN_OR_DIR)
      [--steps 1000] [--batch-size 32] [--learning-rate 5e-5] [--warmup-steps 100]
      [--temperature 0.05] [--proj-dim 128] [--pool mean|cls] [--freeze-layers 0]
      [--dropout 0.1] [--seed 0] [--checkpoint-every 500] [--log-every 10] [--max-groups 0]
      [--allow-config-change] [--config.SECTION.KEY=VALUE …]

PAIRS is a file in the similarity benchmark's format (tools/build_similarity_bench.py): each
step takes --batch-size distinct source functions and two of their compiled variants. Start
from a pretraining run's checkpoint, an HF directory, or (--init-random, the baseline) fresh
weights of a run's or HF directory's architecture. The hyper-parameters are
lmscale_jax/config/finetune.py's config; the flags above set its common keys, --config.K=V
any key (e.g. --config.finetune.dtype=bfloat16 on GPUs). OUT is a workdir like pretraining's:
rerun the same command to resume a stopped run; the result is a model for tools/embed.py,
tools/eval_similarity.py --workdir OUT and tools/export_hf.py --workdir OUT. Several
processes start as python -m lmscale_jax.main does (LMSCALE_* variables or Slurm; the
config's distributed section). See docs/finetune.md.
"""

from __future__ import annotations

import argparse
import sys

import _cli
from lmscale_jax.config import finetune as finetune_config
from lmscale_jax.errors import UserError
from lmscale_jax.study import sweep_grid

# flag → config key; None defaults leave the config's value.
FLAGS = {"steps": "train.steps", "batch_size": "train.batch_size",
         "learning_rate": "train.learning_rate", "warmup_steps": "train.warmup_steps",
         "temperature": "finetune.temperature", "proj_dim": "finetune.proj_dim",
         "pool": "finetune.pool", "freeze_layers": "finetune.freeze_layers",
         "dropout": "finetune.dropout", "seed": "train.seed",
         "checkpoint_every": "checkpoint.every", "log_every": "train.log_every",
         "max_groups": "data.max_groups"}


def parser() -> argparse.ArgumentParser:
  p = _cli.Parser(description=__doc__.splitlines()[0],
                  epilog="--config.SECTION.KEY=VALUE sets any key of "
                  "lmscale_jax/config/finetune.py (after the flags above)")
  p.add_argument("--pairs", required=True, type=_cli.input_file, metavar="PAIRS.jsonl",
                 help="a similarity-benchmark-format file (tools/build_similarity_bench.py)")
  p.add_argument("--workdir", required=True, metavar="OUT", help="the run's directory")
  start = p.add_mutually_exclusive_group(required=True)
  start.add_argument("--init-workdir", metavar="RUN", help="a pretraining run's --workdir")
  start.add_argument("--init-hf", metavar="DIR", help="a Hugging Face BERT directory")
  start.add_argument("--init-random", metavar="RUN_OR_DIR",
                     help="fresh weights of this run's (or HF directory's) architecture")
  p.add_argument("--step", type=_cli.number(int, 0, 1 << 62), default=None,
                 help="(--init-workdir) its checkpoint; default the latest")
  p.add_argument("--tokenizer", default="", type=_cli.input_file, metavar="tokenizer.json",
                 help="(--init-workdir/--init-random of a run) the dataset's tokenizer")
  num = _cli.number
  for flag, kind, lo, hi, what in (
      ("steps", int, 1, 1 << 40, "training steps"),
      ("batch_size", int, 2, 1 << 20, "pairs per step (global)"),
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
       "(0: all; learning curves)")):
    names = dict.fromkeys([f"--{flag.replace('_', '-')}", f"--{flag}"])  # both spellings
    p.add_argument(*names, dest=flag, default=None, type=num(kind, lo, hi), help=what)
  p.add_argument("--pool", choices=["mean", "cls"], default=None,
                 help="mean over non-pad tokens (default) or [CLS]")
  p.add_argument("--allow-config-change", "--allow_config_change", action="store_true",
                 help="resume under changed hyper-parameters (recorded in config.json)")
  return p


def apply_overrides(config, items: list[str]) -> None:
  """``--config.SECTION.KEY=VALUE`` items into ``config``, each checked: a known key, a value
  of its type."""
  for item in items:
    key, eq, text = item.removeprefix("--config.").partition("=")
    parts = key.split(".")
    if not item.startswith("--config.") or not eq or len(parts) != 2:
      raise UserError(f"unrecognized argument {item!r} (expected --config.SECTION.KEY=VALUE)")
    section, leaf = parts
    if section not in config or leaf not in config[section]:
      known = ", ".join(f"{s}.{k}" for s in config for k in config[s])
      raise UserError(f"--config.{key}: no such key; the config has {known}")
    # the sweep's parser: a value as the type of the key's default (as ml_collections keeps it)
    config[section][leaf] = sweep_grid.parse_value(config[section][leaf], text,
                                                   f"--config.{key}")


def build_config(a, rest: list[str]):
  c = finetune_config.get_config()
  c.data.pairs = a.pairs
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
  apply_overrides(c, rest)
  finetune_config.check_config(c)
  return c


def run(config, workdir: str, allow_change: bool) -> int:
  from lmscale_jax.cluster import distributed, preemption
  from lmscale_jax.finetune import trainer as finetune
  from lmscale_jax.train import preflight
  from lmscale_jax.train import workdir as workdir_lib

  import jax

  pairs = finetune.check_inputs(config, workdir)  # bad input: nothing created, no runtime
  distributed.initialize(config)  # before anything touches a JAX backend
  preemption.install()
  took = distributed.agree("workdir lock", lambda: workdir_lib.lock_workdir(workdir)
                           if jax.process_index() == 0 else None)
  try:
    preflight.preflight(config, workdir)
    row = finetune.finetune(config, workdir, allow_config_change=allow_change, pairs=pairs,
                            say=lambda line: print(line, flush=True))
  finally:
    if took:  # for callers in-process (tests); a process's exit releases it anyway
      workdir_lib.unlock_workdir(workdir)
  if jax.process_index() == 0 and "loss" not in row:
    print(f"{workdir} is already at step {config.train.steps}: nothing to train (a larger "
          "--steps continues it)")
  elif jax.process_index() == 0 and row["step"] == config.train.steps:
    print(f"done: step {row['step']}, loss {row['loss']:.4f}, in-batch accuracy "
          f"{row['accuracy']:.3f}; the model: {workdir} (tools/embed.py --workdir, "
          "tools/eval_similarity.py --workdir, tools/export_hf.py --workdir)")
  return 0


def main(argv=None) -> int:
  parser_ = parser()
  a, rest = parser_.parse_known_args(argv)
  stray = [x for x in rest if not x.startswith("--config.")]
  if stray:
    parser_.error(f"unrecognized arguments: {' '.join(stray)}")

  def go() -> int:
    config = build_config(a, rest)
    try:
      return run(config, a.workdir, a.allow_config_change)
    except Exception as e:
      _leave_if_multi_process(e, config.distributed.heartbeat_timeout)
      raise

  return _cli.guarded(go, f"the last complete checkpoint in {a.workdir}/checkpoints is kept: "
                      "rerun the same command to resume from it")


def _leave_if_multi_process(e: Exception, heartbeat_timeout_s: float) -> None:
  """A failed process of a multi-process run leaves at once (lmscale_jax.cluster.distributed.exit_now):
  its peers, blocked in a collective, stop within distributed.heartbeat_timeout. A collective
  that failed because a peer is gone is the runtime's to report, as in main (the supervisor's
  one line, exit 75)."""
  jax = sys.modules.get("jax")
  if jax is None or not jax.distributed.is_initialized():
    return
  from lmscale_jax.cluster import distributed

  distributed.await_runtime(e, heartbeat_timeout_s)
  what = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
  print(f"error: process {jax.process_index()}: {what}", file=sys.stderr, flush=True)
  distributed.exit_now(_cli.EXIT_USAGE if isinstance(e, UserError) else 1)


if __name__ == "__main__":
  sys.exit(main())
