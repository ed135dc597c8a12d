"""Kept for old scripts: `lmscale prepare cluster`."""
import sys

from lmscale_jax.cli.prepare import main

if __name__ == "__main__":
  sys.exit(main(["cluster", *sys.argv[1:]]))
