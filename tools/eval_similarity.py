"""Kept for old scripts: `lmscale eval-similarity`."""
import sys

from lmscale_jax.cli.eval_similarity import main

if __name__ == "__main__":
  sys.exit(main())
