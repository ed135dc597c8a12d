#!/usr/bin/env bash
# Sets everything up (tools/setup.sh) and runs the test suite on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
export JAX_PLATFORMS=cpu
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 tests "$@"
