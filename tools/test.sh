#!/usr/bin/env bash
# Sets everything up (tools/setup.sh) and runs the test suite on the CPU.
#   bash tools/test.sh [PYTEST ARGS…]   (e.g. -k NAME, tests/test_prepare.py); -h/--help: this
set -euo pipefail
usage() { awk 'NR == 1 { next } /^#( |$)/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; }
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
cd "$(dirname "$0")/.."
bash tools/setup.sh
export JAX_PLATFORMS=cpu
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 tests "$@"
