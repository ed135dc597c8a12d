"""The names of every mode a config key takes: the one list :mod:`lmscale_jax.config.checks`
checks the key against before anything starts, and the list the implementing module dispatches
on (it imports the names from here, so the two cannot drift apart)."""

DTYPES = ("float32", "bfloat16")  # model.dtype, finetune.dtype, train.grad_allreduce_dtype
REMAT = ("none", "dots", "full")  # train.remat (model/bert.py: what the backward recomputes)
# model.attention_impl (model/bert.py); auto = cuDNN on a GPU in bfloat16, else XLA
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "pallas")
# model.packed_attention: "segment" = per-function attention windows inside a packed sequence,
# "cross" = one window over the whole sequence
PACKED_ATTENTION = ("segment", "cross")
# model.positions (model/bert.py): "absolute" 0..S-1 per sequence, "segment" from 0 at each
# [CLS], "instruction" undertale's instruction + argument index (from [NEXT]), no position table;
# "auto" the start model's (a resumed run, init_from), else "instruction" on a dataset with
# [NEXT] (binary code), "segment" without (text): model.bert.resolve_model_config
POSITIONS = ("auto", "absolute", "segment", "instruction")
NORMS = ("post", "pre")  # model.norm (model/bert.py): BERT's post-LN or pre-LN (undertale)
SCHEDULES = ("linear", "cosine")  # train.schedule (train/optim.py)
# train.nonfinite: "error" stops the run, naming the step and the last good checkpoint; "skip"
# drops the update and counts it (metrics nonfinite_skipped)
NONFINITE_MODES = ("error", "skip")
GRAD_ALLREDUCE = ("auto", "per_tensor", "flat")  # train.grad_allreduce (train/steps.py)
# train.dropout_rng: "threefry" is jax's default (bit-identical on any device count); "rbg"
# draws dropout masks with XLA's RngBitGenerator, much cheaper on GPU, not partition-invariant
DROPOUT_RNGS = ("threefry", "rbg")
ON_CORRUPT = ("error", "skip")  # data.on_corrupt (store/records.py)
ON_FULL = ("error", "skip")  # checkpoint.on_full (train/checkpoint.py)
POOLS = ("mean", "cls")  # finetune.pool (model/contrastive.py)
