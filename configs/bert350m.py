"""BERT-large shape (24 × 1024, 16 heads, FFN 4096; ~335M params with a 30k vocabulary) at
sequence length 512, bfloat16 compute, BERT's original optimizer settings (batch 256,
peak LR 1e-4, 10k warmup steps, linear decay, 1M steps)."""

from lmscale_jax.config import defaults as config_defaults


def get_config():
  return config_defaults.bert_config(layers=24, hidden=1024, heads=16, ffn=4096)
