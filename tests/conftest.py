import os

# Tests run on CPU unless the caller picks a platform (set before anything imports jax).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Grain's mp_prefetch workers (spawned) re-import __main__ and read absl flags (e.g. ArrayRecord's
# grain_num_threads_fetching_records); under pytest nothing parses them, so mark them parsed.
from absl import flags  # noqa: E402

flags.FLAGS.mark_as_parsed()
