"""Kept for old scripts: `lmscale similarity-leakage`."""
import sys

from lmscale_jax.cli.similarity_leakage import main

if __name__ == "__main__":
  sys.exit(main())
