"""One vector per function: the input to similarity search and to downstream models.

  lmscale embed (--workdir DIR [--step N] | --hf OUT) (--elf FILE… | --data DATASET_DIR
      [--split validation]) --output E.npz [--pool mean|cls]

Each function is encoded on its own as [CLS] function [SEP] (cut at the model's sequence
length); its vector is the mean of the last hidden layer over its tokens (--pool mean, the
default: [CLS], [SEP] and padding left out) or the [CLS] position's (--pool cls). A fine-tuned
model (a lmscale finetune workdir, or its export) gives its own embedding instead:
its pooling, projection head and L2 normalisation (lmscale_jax/model/contrastive.py). --elf takes
every named function of the binaries, as preparation does; --data takes every function of a
prepared split (the [SEP]-separated pieces of its packed sequences; no names are stored in a
dataset, so a function is named split:record:piece). E.npz holds `embeddings` float32 [N, H],
`names`, `files` (the ELF or shard file), `tokens` (tokens used), `truncated`, `pool` and
`projection` (whether the vectors are a fine-tuned head's).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from lmscale_jax.cli import args
from lmscale_jax.prep.elf import elf_functions
from lmscale_jax.store import dataset, output_marks, records

TOOL = "lmscale embed"  # the parser's prog, and the mark its .npz carries (store/output_marks)


def parser() -> argparse.ArgumentParser:
  p = args.Parser(prog=TOOL, description=__doc__.splitlines()[0])
  args.add_model_source(p)
  p.add_argument("--elf", nargs="+", default=None, type=args.input_file, metavar="FILE",
                 help="x86-64 ELF files")
  p.add_argument("--data", default=None, metavar="DATASET_DIR", help="a prepared dataset")
  p.add_argument("--split", choices=list(dataset.SPLITS), default="validation")
  p.add_argument("--pool", choices=["mean", "cls"], default=None,
                 help="default mean; a fine-tuned model: the pooling it was trained with")
  p.add_argument("--output", required=True, type=args.output_file, metavar="E.npz")
  return p


def elf_inputs(model, paths: list[str]):
  """(name, file, ids, truncated) per named function of the ELF files."""
  from lmscale_jax.inference import trained_model

  for path in paths:
    for fn in elf_functions.functions(path):
      ids, cut = trained_model.encode(model, fn.text)
      yield fn.name, path, ids, cut


def dataset_inputs(model, meta: dataset.DatasetMeta, split: str):
  """(name, shard file, ids, truncated) per [SEP]-separated function of a split's records;
  ``meta`` was checked against the model as it was loaded (trained_model.check_dataset)."""
  sp = meta.special_ids
  cls, sep, pad = sp["[CLS]"], sp["[SEP]"], sp["[PAD]"]
  reader = records.ShardRecords(meta, split)
  for r in range(len(reader)):
    seq = reader.decode(reader.read(np.array([r])), np.array([r]), meta.vocab_size)[0]
    body = seq[(seq != pad) & (seq != cls)]
    for k, piece in enumerate(np.split(body, np.flatnonzero(body == sep))):
      piece = piece[piece != sep]
      if len(piece):
        ids = np.concatenate([[cls], piece[:model.cfg.seq_len - 2], [sep]]).astype(np.int32)
        shard = reader.paths[int(np.searchsorted(reader.ends, r, side="right"))]
        yield f"{split}:{r}:{k}", shard, ids, len(piece) > model.cfg.seq_len - 2


def main(argv=None) -> int:
  parser_ = parser()
  a = parser_.parse_args(argv)
  if (a.elf is None) == (a.data is None):
    parser_.error("give --elf FILE… or --data DATASET_DIR (one of them)")

  def go() -> int:
    # JAX and the model here, not at module level: --help answers without them (~1.3 s).
    from lmscale_jax.inference import function_vectors, trained_model

    meta = dataset.DatasetMeta.load(a.data) if a.data is not None else None
    if meta is not None:
      args.check_split(meta, a.split)
    model = trained_model.load(a.workdir, a.hf, a.step, a.tokenizer, data=meta)
    inputs = (elf_inputs(model, a.elf) if meta is None
              else dataset_inputs(model, meta, a.split))
    out = function_vectors.embed(model, inputs, a.pool)
    output_marks.write_npz(a.output, TOOL, out)
    n, h = out["embeddings"].shape
    how = f"{out['pool']} pooling" + (", fine-tuned projection head" if out["projection"] else "")
    print(f"wrote {n} function embeddings of {h} dimensions ({how}) to {a.output}")
    return 0

  return args.guarded(go, f"nothing was written to {a.output}")


if __name__ == "__main__":
  sys.exit(main())
