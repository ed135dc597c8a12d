"""The fine-tuning tasks on the run core (:mod:`lmscale_jax.train`): what they share (the
checks, the start model, the state, the log: ``base_run``, ``finetune_state``, ``batches``) and
one module of hooks per task: contrastive (``contrastive_run``), classification
(``classify_run``), function naming (``name_run``)."""
