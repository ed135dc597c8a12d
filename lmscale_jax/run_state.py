"""``python -m lmscale_jax.run_state``: the command ``launch/slurm.sbatch`` runs on the batch
node before and after training; the code is :mod:`lmscale_jax.cluster.run_state`."""

import sys

from lmscale_jax.cluster.run_state import main

if __name__ == "__main__":
  sys.exit(main())
