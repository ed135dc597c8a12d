"""Kept for old scripts: `lmscale max-batch`."""
import sys

from lmscale_jax.cli.max_batch import main

if __name__ == "__main__":
  sys.exit(main())
