"""BERT-large shape (24 × 1024, 16 heads, FFN 4096; ~335M params with a 30k vocabulary) at
sequence length 512, bfloat16 compute, BERT's original optimizer settings (batch 256,
peak LR 1e-4, 10k warmup steps, linear decay, 1M steps)."""

import importlib.util
import os


def _base_config():
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "base.py")
  spec = importlib.util.spec_from_file_location("lmscale_configs_base", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_base_config()


def get_config():
  c = _base_config()
  c.data.workers = 4  # ~20k+ samples/s each on a CPU core: far above the step rate

  c.model.seq_len = 512
  c.model.layers = 24
  c.model.hidden = 1024
  c.model.heads = 16
  c.model.ffn = 4096
  c.model.dtype = "bfloat16"

  c.train.batch_size = 256
  c.train.steps = 1_000_000
  c.train.learning_rate = 1e-4
  c.train.warmup_steps = 10_000
  return c
