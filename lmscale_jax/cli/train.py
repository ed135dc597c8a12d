"""``lmscale train``: pretraining, the same arguments and the same code as
``python -m lmscale_jax.main`` (:mod:`lmscale_jax.main`; ``lmscale train --help`` lists them).

  lmscale train --config configs/tiny.py --workdir DIR --config.data.path=DATASET
      [--config.a.b=v …] [--dry-run] [--verify-data] [--allow-config-change]
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
  from lmscale_jax import main as train_main

  return train_main.run_command(sys.argv[1:] if argv is None else list(argv))


if __name__ == "__main__":
  sys.exit(main())
