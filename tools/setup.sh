#!/usr/bin/env bash
# Creates ./.venv (Python >= 3.11) with lmscale_jax and its test tools installed. Idempotent.
set -euo pipefail
source "$(dirname "$0")/_no_arguments.sh" "$0" "$@"  # --help, or no arguments at all
cd "$(dirname "$0")/.."
py=""
for c in python3.13 python3.12 python3.11 python3; do
  if command -v "$c" >/dev/null && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    py=$c; break
  fi
done
[ -n "$py" ] || { echo "error: lmscale_jax needs Python >= 3.11 (python3.11+ not found on PATH)" >&2; exit 1; }
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
stamp=.venv/.lmscale-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[test]'
  touch "$stamp"
fi
