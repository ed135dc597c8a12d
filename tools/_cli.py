"""Kept for scripts that import the tools' old helper module: the code is
:mod:`lmscale_jax.cli.args` and :mod:`lmscale_jax.cli.prepare`."""
from lmscale_jax.cli.args import *  # noqa: F401,F403
from lmscale_jax.cli.args import EXIT_INTERRUPTED, EXIT_TERMINATED, EXIT_USAGE  # noqa: F401
from lmscale_jax.cli.prepare import options, parser, run  # noqa: F401
