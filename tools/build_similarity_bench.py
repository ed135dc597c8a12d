"""Kept for old scripts: `lmscale similarity-build`."""
import sys

from lmscale_jax.cli.similarity_build import main

if __name__ == "__main__":
  sys.exit(main())
