"""What a benchmark ran on, for its results file (shared by the CPU benchmarks): the package's
description of a host (lmscale_jax/study/host.py), so tools and benchmarks write the same."""

from lmscale_jax.study.host import code_version, cpu_name, host_description  # noqa: F401


def append_result(path: str, row: dict) -> None:
  """Adds ``row`` to the results file ``path`` (a JSON list, made if missing), atomically: a
  rerun of a benchmark keeps the rows of the runs before it."""
  import json
  import os

  from lmscale_jax.store import file_io

  rows = json.load(open(path)) if os.path.exists(path) else []
  file_io.atomic_write_json(path, rows + [row])
