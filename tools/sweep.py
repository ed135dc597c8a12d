"""Kept for old scripts: `lmscale sweep`."""
import sys

from lmscale_jax.cli.sweep import main

if __name__ == "__main__":
  sys.exit(main())
