"""Kept for old scripts: `lmscale import-hf`."""
import sys

from lmscale_jax.cli.import_hf import main

if __name__ == "__main__":
  sys.exit(main())
