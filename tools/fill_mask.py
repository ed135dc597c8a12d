"""Kept for old scripts: `lmscale fill-mask`."""
import sys

from lmscale_jax.cli.fill_mask import main

if __name__ == "__main__":
  sys.exit(main())
