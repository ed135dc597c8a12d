"""Kept for old scripts: `lmscale prepare text`."""
import sys

from lmscale_jax.cli.prepare import main

if __name__ == "__main__":
  sys.exit(main(["text", *sys.argv[1:]]))
