"""Kept for old scripts: `lmscale evaluate`."""
import sys

from lmscale_jax.cli.evaluate import main

if __name__ == "__main__":
  sys.exit(main())
