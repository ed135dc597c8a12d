import atexit
import os
import shutil
import tempfile

# Tests run on CPU unless the caller picks a platform (set before anything imports jax).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One XLA compilation cache for the whole run: both pytest workers and every process a test
# starts (they inherit the environment). The suite compiles the same small programs again and
# again (a run and its resume, one process and two, each lever): tests/test_model_variants.py
# took 147 s without a cache, 132 s with an empty one and 79 s with a full one (2026-12-07).
# Every program is kept (min compile time 0), and a size limit turns on jax's file lock, so a
# process never reads an entry another is writing. (An entry cut short by a test's kill -9 in
# the middle of its one write would be read with a warning and compiled again. No warnings
# filter for it: PYTHONWARNINGS goes onto every spawned worker's command line, which
# test_process_cleanup and test_sweep read, cut at 160 characters.)
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="lmscale-tests-xla-cache-")
  os.environ.update(JAX_COMPILATION_CACHE_DIR=_cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                    JAX_COMPILATION_CACHE_MAX_SIZE=str(8 << 30))
  _owner = os.getpid()  # the process that made it (xdist's controller) removes it
  atexit.register(lambda: os.getpid() == _owner and shutil.rmtree(_cache, ignore_errors=True))

# Grain's mp_prefetch workers (spawned) re-import __main__ and read absl flags (e.g. ArrayRecord's
# grain_num_threads_fetching_records); under pytest nothing parses them, so mark them parsed.
from absl import flags  # noqa: E402

flags.FLAGS.mark_as_parsed()
