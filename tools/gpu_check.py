"""Kept for old scripts: `lmscale gpu-check`."""
import sys

from lmscale_jax.cli.gpu_check import main

if __name__ == "__main__":
  sys.exit(main())
