"""Kept for old scripts: `lmscale embed`."""
import sys

from lmscale_jax.cli.embed import main

if __name__ == "__main__":
  sys.exit(main())
