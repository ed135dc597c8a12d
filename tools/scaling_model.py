"""Kept for old scripts: `lmscale scaling-model`."""
import sys

from lmscale_jax.cli.scaling_model import main

if __name__ == "__main__":
  sys.exit(main())
