"""A 2-layer, 128-wide BERT that trains on a 2-core CPU in minutes (float32 compute).

  python -m lmscale_jax.main --config=configs/tiny.py --config.data.path=DATASET --workdir=W
"""

from lmscale_jax.config import defaults as config_defaults


def get_config():
  c = config_defaults.get_base_config()
  c.data.workers = 0
  c.data.prefetch_buffer = 4
  c.data.read_threads = 2

  c.model.layers = 2
  c.model.hidden = 128
  c.model.heads = 2
  c.model.ffn = 512
  c.model.dtype = "float32"  # CPUs have no fast bfloat16 matmuls
  c.model.dropout = 0.0      # a few hundred steps on a small corpus: nothing to regularise yet

  c.train.batch_size = 32
  c.train.steps = 800
  c.train.learning_rate = 2e-3
  c.train.warmup_steps = 60
  c.train.log_every = 20
  c.train.eval_every = 200
  c.train.eval_batches = 8

  c.checkpoint.every = 200
  c.checkpoint.keep = 2
  return c
