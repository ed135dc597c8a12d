"""Kept for old scripts: `lmscale storage-model`."""
import sys

from lmscale_jax.cli.storage_model import main

if __name__ == "__main__":
  sys.exit(main())
