"""Kept for old scripts: `lmscale prepare binary`."""
import sys

from lmscale_jax.cli.prepare import main

if __name__ == "__main__":
  sys.exit(main(["binary", *sys.argv[1:]]))
