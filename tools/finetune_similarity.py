"""Kept for scripts that run it: the code is ``lmscale finetune`` (lmscale_jax/cli/finetune.py)."""
import sys

from lmscale_jax.cli.finetune import main  # noqa: F401

if __name__ == "__main__":
  sys.exit(main())
