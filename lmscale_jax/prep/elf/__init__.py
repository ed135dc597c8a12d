"""Reading ELF files and normalising their x86-64 code: files → functions → pretoken text.

The part of preparation that the similarity dataset (:mod:`lmscale_jax.similarity`) and the
retrieval evaluation (:mod:`lmscale_jax.evals`) share with it: they import this subpackage, never
the rest of :mod:`lmscale_jax.prep` (its pool, its shards, its options)."""
