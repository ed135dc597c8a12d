"""BERT-base shape (12 × 768, 12 heads, FFN 3072; ~110M params with a 30k vocabulary) at
sequence length 512, bfloat16 compute, BERT's original optimizer settings (batch 256,
peak LR 1e-4, 10k warmup steps, linear decay, 1M steps)."""

from lmscale_jax.config import defaults as config_defaults


def get_config():
  return config_defaults.bert_config(layers=12, hidden=768, heads=12, ffn=3072)
