"""Start pretraining from a Hugging Face masked-LM directory: write the run's config.

  lmscale import-hf --hf HF_DIR --data DATASET_DIR --output CONFIG.py
  lmscale train --config=CONFIG.py --workdir=DIR [--config.train.…=…]

Checks that HF_DIR is a BERT (BertForMaskedLM) or an lmscale remote-code export
(LmscaleForMaskedLM) this model can take (config.json, model.safetensors) and that
its vocabulary (tokenizer.json or vocab.txt) is the dataset's, then writes a config file:
the shared defaults with the model's shape from HF_DIR's config.json (layers, hidden, heads,
ffn, vocab, positions, type vocabulary, LayerNorm epsilon, dropout, model.norm and
model.positions: post and segment for a BERT), data.path and init_from=HF_DIR, which starts
step 0 from its weights. Training keys stay the defaults: set them in the file or with
--config.train.…
"""

from __future__ import annotations

import argparse
import os
import sys

from lmscale_jax.cli import args
from lmscale_jax.errors import UserError
from lmscale_jax.store import dataset, file_io

MODEL_KEYS = ("layers", "hidden", "heads", "ffn", "vocab_size", "seq_len", "type_vocab_size",
              "layer_norm_eps", "dropout", "attention_dropout", "initializer_range", "norm",
              "positions")


def parser() -> argparse.ArgumentParser:
  p = args.Parser(prog="lmscale import-hf", description=__doc__.splitlines()[0])
  p.add_argument("--hf", required=True, metavar="HF_DIR",
                 help="a BertForMaskedLM or LmscaleForMaskedLM directory")
  p.add_argument("--data", required=True, metavar="DATASET_DIR",
                 help="the dataset to pretrain on (prepared with the HF model's tokenizer)")
  # A config is for editing ("set them in the file"): an existing one, even one this command
  # wrote, is replaced only with --overwrite (no mark is looked for in a .py).
  p.add_argument("--output", required=True, type=args.output_file, metavar="CONFIG.py",
                 help="config file to write")
  return p


def config_text(hf_dir: str, data_dir: str) -> str:
  from lmscale_jax.inference import model_files

  model = model_files.hf_model_config(hf_dir)
  lines = [f"  c.model.{k} = {model[k]!r}" for k in MODEL_KEYS]
  return f'''"""Pretraining from {hf_dir} (written by lmscale import-hf).

  lmscale train --config={{this file}} --workdir=DIR
"""

from lmscale_jax.config import defaults as config_defaults


def get_config():
  c = config_defaults.get_base_config()
  c.init_from = {os.path.abspath(hf_dir)!r}
  c.data.path = {os.path.abspath(data_dir)!r}
{chr(10).join(lines)}
  return c
'''


def run(a) -> str:
  # JAX and the model here, not at module level: --help answers without them (~1.5 s).
  from lmscale_jax.inference import model_files
  from lmscale_jax.model import hf_convert

  meta = dataset.DatasetMeta.load(a.data)
  model_files.check_hf_files(a.hf)
  keys = hf_convert.model_keys(a.hf)
  for key, have in (("vocab_size", meta.vocab_size), ("seq_len", meta.seq_len)):
    if keys[key] != have:
      field = hf_convert.MODEL_KEYS[key]
      raise UserError(f"{a.hf}: {field}={keys[key]} but the dataset {a.data} has {key}={have}; "
                      f"prepare it with --tokenizer {a.hf}/tokenizer.json --seq-len "
                      f"{keys['seq_len']}")
  hf_convert.check_same_vocabulary(a.hf, a.data)
  if not os.path.exists(os.path.join(a.hf, hf_convert.WEIGHTS)):
    hf_convert.load_params(a.hf, None)  # raises the one-line reason
  file_io.atomic_write_bytes(a.output, config_text(a.hf, a.data).encode())
  return (f"wrote {a.output}; train with: lmscale train --config={a.output} "
          "--workdir=DIR")


def main(argv=None) -> int:
  a = parser().parse_args(argv)

  def go() -> int:
    print(run(a))
    return 0

  return args.guarded(go, "nothing was written")


if __name__ == "__main__":
  sys.exit(main())
