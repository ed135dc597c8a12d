"""Pretraining, one task of the run core (:mod:`lmscale_jax.train`): the MLM task and its
steps (:mod:`.mlm`), and the run (:mod:`.trainer`)."""
