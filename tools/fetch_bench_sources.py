"""Kept for old scripts: `lmscale similarity-sources`."""
import sys

from lmscale_jax.cli.similarity_sources import main

if __name__ == "__main__":
  sys.exit(main())
