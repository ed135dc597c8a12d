"""undertale's "medium" model and optimiser: the model pretrained in "Scaling Performance of Large
Language Model Pretraining" (arXiv 2509.05258), from github.com/undertale-re/undertale (files
named below; paths inside that repository).

  python -m lmscale_jax.main --config=configs/undertale_medium.py \
      --config.data.path=BINARY_DATASET --workdir=W [--config.train.steps=N] [--dry_run]

The same as undertale:
  model.layers 12, hidden 768, heads 12, ffn 3072, seq_len 512, dropout 0.1, layer_norm_eps
      1e-12: undertale/models/configuration.py (``medium`` and ``regularization``)
  model.norm "pre": undertale/models/transformer.py, TransformerEncoderLayer (norm1 → attention
      → add, norm2 → feed-forward → add)
  model.positions "instruction": undertale/models/custom.py, InstructionTracePositionEmbedding
      (token + instruction index + argument index, no position table; a binary dataset's [NEXT])
  train.learning_rate 1e-4 (LR) and train.warmup_fraction 0.025 (WARMUP, ``int(warmup *
      total_steps)``), then cosine to 0 (CosineAnnealingLR, eta_min 0):
      undertale/models/maskedlm.py, configure_optimizers
  train.b1 0.9, b2 0.999, eps 1e-8, weight_decay 0.01: torch.optim.AdamW's defaults (maskedlm.py
      passes only lr)
  train.batch_size 11,776 = 184 per GPU (BATCH) × 2 GPUs per node (--ntasks-per-node) × 32 nodes
      (--nodes): pipelines/models/pretrain-maskedlm.slurm
  data.mask_prob 0.15, 80% [MASK] / 10% random / 10% kept: maskedlm.py, MaskedLMCollator

Where undertale differs, and what is chosen here:
  * Run length: undertale trains up to 48 epochs (undertale/parsers.py, --epochs) with early
    stopping on validation F1 (patience 5, pipelines/models/pretrain-maskedlm.py); we count
    steps. 20,000 steps is our choice (≈ 235M sequences); set --config.train.steps for your
    corpus: the warm-up stays 2.5% of it.
  * Gradient clipping: none in undertale (Lightning's Trainer without gradient_clip_val); we
    clip the global norm at 1.0 (train.clip_norm must be finite), BERT's value: a pre-LN model
    at batch 11,776 rarely reaches it.
  * Warm-up start: torch's LinearLR starts at lr / warmup_steps; ours at 0 (one step apart).
  * Weight decay: torch's AdamW decays every parameter; ours skips biases and LayerNorms
    (BERT's recipe, train/optim.py decay_mask).
  * Final LayerNorm: undertale has none after its pre-LN layers (its MLM head has its own
    LayerNorm); norm="pre" here adds final_LayerNorm before the head (model/bert.py).
  * LayerNorm eps: undertale's layers use torch's default 1e-5 (``LayerNorm(hidden)``), its
    embedding and head 1e-12; one eps here, 1e-12 (configuration.py's value).
  * Decoder: undertale's is an untied Linear (vocab × 768 + bias); ours is the transposed
    word embedding + a bias (BERT), 768 × vocab parameters fewer.
  * Token types: undertale has no token-type table; ours has BERT's two rows (only row 0 is
    ever used: a learned constant on every token, 1,536 parameters).
  * Dropout: undertale drops after the embedding and the feed-forward only; ours also after the
    attention output (BERT), with no attention-probability dropout in either.
  * Masking: undertale masks each token with probability 0.15 (a varying count); ours predicts
    ceil(0.15 × 512) = 77 positions per sequence (data.max_predictions, at most).
  * Precision: undertale trains in float32 (Lightning's default); bfloat16 compute here
    (float32 parameters and optimiser state), as every GPU config of this repository.
  * Initialisation: torch's defaults (embeddings N(0, 1), Linear Kaiming-uniform); ours
    N(0, 0.02) (BERT).
"""

from lmscale_jax.config import defaults as config_defaults

PER_GPU_BATCH = 184      # BATCH, pipelines/models/pretrain-maskedlm.slurm
GPUS = 32 * 2            # --nodes=32 × --ntasks-per-node=2, the same file


def get_config():
  c = config_defaults.bert_config(layers=12, hidden=768, heads=12, ffn=3072)
  c.model.seq_len = 512
  c.model.dropout = 0.1
  c.model.layer_norm_eps = 1e-12
  c.model.norm = "pre"
  c.model.positions = "instruction"

  c.train.batch_size = PER_GPU_BATCH * GPUS  # 11,776
  c.train.steps = 20_000
  c.train.learning_rate = 1e-4
  c.train.warmup_fraction = 0.025
  c.train.warmup_steps = 500  # unused while warmup_fraction > 0 (its 2.5% of 20,000)
  c.train.schedule = "cosine"
  c.train.end_lr_frac = 0.0
  c.train.b1, c.train.b2, c.train.eps = 0.9, 0.999, 1e-8
  c.train.weight_decay = 0.01
  c.train.clip_norm = 1.0
  c.train.eval_every = 1_000
  c.checkpoint.every = 1_000
  return c
