"""What a benchmark ran on, for its results file (shared by the CPU benchmarks): the package's
description of a host (lmscale_jax/study/host.py), so tools and benchmarks write the same."""

from lmscale_jax.study.host import code_version, cpu_name, host_description  # noqa: F401
