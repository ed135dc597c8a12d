"""Evaluate a training run's checkpoint: MLM loss, accuracy and perplexity over a split.

  lmscale evaluate --workdir DIR --data DATASET_DIR [--split validation] [--step N]
      [--batches K]

Masking is deterministic (the evaluation seed training uses), and the batches are the ones
training evaluates on: with --batches K equal to the run's train.eval_batches the result is
the run's own eval_loss at that step. Without --batches the whole split is read once (the last
batch's rows past the end of the split get no weight). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from lmscale_jax.cli import args
from lmscale_jax.store import dataset


def parser() -> argparse.ArgumentParser:
  p = args.Parser(prog="lmscale evaluate", description=__doc__.splitlines()[0])
  p.add_argument("--workdir", required=True, help="the training run's --workdir")
  p.add_argument("--data", required=True, metavar="DATASET_DIR",
                 help="the dataset (the run's data.path, or a staged copy of it)")
  p.add_argument("--split", choices=list(dataset.SPLITS), default="validation")
  p.add_argument("--step", type=args.number(int, 0, 1 << 62), default=None,
                 help="checkpoint step (default: the latest)")
  p.add_argument("--batches", type=args.number(int, 1, 1 << 40), default=None,
                 help="evaluate this many batches of train.batch_size, as training does "
                      "(default: the whole split once)")
  return p


class WholeSplit:
  """The first ceil(n / b) evaluation batches, the rows that wrap past the split's end
  weighted 0: every record counted once, masked as training's evaluation masks it."""

  def __init__(self, batches, records: int, batch_size: int):
    self.batches, self.records, self.batch_size = batches, records, batch_size

  def __iter__(self):
    for k, batch in enumerate(self.batches):
      extra = (k + 1) * self.batch_size - self.records
      if extra > 0:
        batch = dict(batch, mlm_weights=batch["mlm_weights"].copy())
        batch["mlm_weights"][self.batch_size - extra:] = 0.0
      yield batch


def evaluate(a) -> dict:
  # JAX and the model here, not at module level: --help answers without them (~1.3 s).
  from lmscale_jax.inference import model_files
  from lmscale_jax.input import grain_pipeline
  from lmscale_jax.pretrain import mlm
  from lmscale_jax.pretrain import trainer as train

  config, record = model_files.read_run(a.workdir)
  config.data.path = a.data
  meta = dataset.DatasetMeta.load(a.data)
  # Before the restore: not Orbax's traceback, and not a silent score on another tokenizer.
  model_files.check_dataset(record["model"], meta, a.workdir, record=record)
  args.check_split(meta, a.split)
  records, b = meta.num_records(a.split), int(config.train.batch_size)
  whole = a.batches is None
  config.train.eval_batches = -(-records // b) if whole else a.batches
  setup = train.build_setup(config, meta)
  # The eval step alone: no optimizer built, no Adam moment read (the parameters only).
  scorer = mlm.build_eval_step(setup.model_cfg, fsdp=bool(config.train.fsdp))
  step, params = model_files.restore_params(a.workdir, a.step, scorer.abstract_params)
  batches = grain_pipeline.make_dataset(config, meta, a.split, train=False)
  out = train.evaluate(scorer, params, WholeSplit(batches, records, b) if whole else batches)
  return {"workdir": a.workdir, "step": step, "data": a.data, "split": a.split,
          "batches": int(config.train.eval_batches), "batch_size": b,
          "records": records if whole else int(config.train.eval_batches) * b,
          "loss": out["eval_loss"], "accuracy": out["eval_mlm_accuracy"],
          "perplexity": math.exp(min(out["eval_loss"], 700.0))}


def main(argv=None) -> int:
  a = parser().parse_args(argv)

  def go() -> int:
    print(json.dumps(evaluate(a)))
    return 0

  return args.guarded(go, "nothing was written")


if __name__ == "__main__":
  sys.exit(main())
