#!/usr/bin/env bash
# Sets everything up (tools/setup.sh) and runs the test suite on the CPU.
#   bash tools/test.sh [PYTEST ARGS…]   (e.g. -k NAME, tests/test_prepare.py); -h/--help: this
set -euo pipefail
usage() { awk 'NR == 1 { next } /^#( |$)/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; }
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
cd "$(dirname "$0")/.."
bash tools/setup.sh
source tools/_quiet_pip.sh
# The Hugging Face tests (tests/test_hf_*.py) run transformers in a virtual environment of its
# own, .venv-hf (torch + transformers, no jax), made once and reused: torch==2.13.0 is the CPU
# wheel (~1.2 GB installed, ~45 s; a plain `torch` would pull the ~6 GB CUDA build).
if [ ! -f .venv-hf/.lmscale-installed ]; then
  "$(.venv/bin/python -c 'import sys; print(sys._base_executable)')" -m venv .venv-hf
  echo "test: installing torch (CPU) and transformers into .venv-hf (about a minute, once)" >&2
  quiet_pip .venv-hf/bin/python .venv-hf/pip-install.log torch==2.13.0 'transformers>=5,<6' \
    safetensors
  touch .venv-hf/.lmscale-installed
fi
export LMSCALE_HF_PYTHON="$PWD/.venv-hf/bin/python"
# The page's browser test (tests/test_serve_page.py) drives Debian's Chromium through Playwright,
# in a venv of its own, .venv-browser (playwright only: its wheel carries its driver; the browser
# is the system's, never `playwright install`'s download). The stripped-binary tests
# (tests/test_stripped_functions.py) compile with gcc and clang, the two compilers of the
# similarity corpora: on a machine with gcc only (this project's image as it boots) they all
# skipped. What is missing of the two is installed when this runs as root with apt-get (about
# a minute, once); otherwise those tests skip, saying what they need.
missing=()
command -v chromium >/dev/null || missing+=(chromium)
command -v clang >/dev/null || missing+=(clang)
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "test: installing ${missing[*]} (Debian's packages) for the browser and" \
    "stripped-binary tests, once" >&2
  log="${TMPDIR:-/tmp}/lmscale-apt.log"
  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"; } \
    >"$log" 2>&1 || echo "test: apt-get install ${missing[*]} failed ($log); their tests skip" >&2
fi
if [ ! -f .venv-browser/.lmscale-installed ]; then
  "$(.venv/bin/python -c 'import sys; print(sys._base_executable)')" -m venv .venv-browser
  quiet_pip .venv-browser/bin/python .venv-browser/pip-install.log 'playwright>=1.40,<2'
  touch .venv-browser/.lmscale-installed
fi
export LMSCALE_BROWSER_PYTHON="$PWD/.venv-browser/bin/python"
export JAX_PLATFORMS=cpu
# Two pytest workers (pytest-xdist), each test file on one of them (its module fixtures built
# once): one worker kept 1.3 of CI's 2 cores busy (/proc/stat, a whole run), waiting on the
# processes its tests start. More would only take turns on 2 cores. LMSCALE_TEST_WORKERS=0
# runs in this process (a debugger, -x).
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 \
  -n "${LMSCALE_TEST_WORKERS:-2}" --dist loadfile tests "$@"
