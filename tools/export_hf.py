"""Kept for old scripts: `lmscale export-hf`."""
import sys

from lmscale_jax.cli.export_hf import main

if __name__ == "__main__":
  sys.exit(main())
