"""Kept for old scripts: `lmscale inspect`."""
import sys

from lmscale_jax.cli.inspect_checkpoint import main

if __name__ == "__main__":
  sys.exit(main())
