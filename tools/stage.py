"""Kept for old scripts: `lmscale stage`."""
import sys

from lmscale_jax.cli.stage import main

if __name__ == "__main__":
  sys.exit(main())
