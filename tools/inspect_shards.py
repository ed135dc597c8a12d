"""Kept for old scripts: `lmscale inspect-data`."""
import sys

from lmscale_jax.cli.inspect_data import main

if __name__ == "__main__":
  sys.exit(main())
