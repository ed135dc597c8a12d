"""The ``lmscale`` command: one module per subcommand, each with ``main(argv=None) -> int``
(:mod:`lmscale_jax.cli.lmscale` dispatches); :mod:`lmscale_jax.cli.args` holds their shared
argument types and error handling."""
