# Sourced by tools/setup.sh and tools/test.sh: quiet_pip PYTHON LOG ARGS… runs
# `PYTHON -m pip install -q ARGS…` with pip's and the build backend's output (setuptools'
# editable-install notices, a package index's warnings) in LOG, shown only if it fails: a
# newcomer's first run prints nothing it did not ask for.
quiet_pip() {
  local py=$1 log=$2
  shift 2
  if ! "$py" -m pip install -q "$@" >"$log" 2>&1; then
    cat "$log" >&2
    echo "error: pip install $* failed (its output above, kept in $log)" >&2
    exit 1
  fi
}
