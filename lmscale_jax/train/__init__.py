"""The run core of every task (pretraining: :mod:`lmscale_jax.pretrain`; the fine-tunes:
:mod:`lmscale_jax.finetune`), which names none of them: start-up and exits, preflight, the one
loop, the one step and its gradient paths, optimizer, sharding, checkpoints, workdir and its
config record, metrics."""
