"""Kept for old scripts: `lmscale report`."""
import sys

from lmscale_jax.cli.report import main

if __name__ == "__main__":
  sys.exit(main())
