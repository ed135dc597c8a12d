"""The pretraining run: preflight, steps, optimizer, sharding, checkpoints, workdir, metrics."""
