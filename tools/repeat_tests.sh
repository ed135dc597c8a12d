#!/usr/bin/env bash
# Runs the same tests N times in a row, to tell a flaky test from a fixed one; optionally while
# a second copy of the whole suite loads the machine (what made a failure appear on CI).
#
#   bash tools/repeat_tests.sh N [--loaded] PYTEST_ARGS…
#   e.g. bash tools/repeat_tests.sh 20 --loaded tests/test_distributed.py -k lost
#
# Each run's outcome and pytest's summary go to stdout, each run's full output to
# runs/repeat-<date>/run-<i>.log; the last line is "repeat: N passed, M failed" (exit 1 if any
# failed). --loaded runs `bash tools/test.sh` over and over in the background meanwhile (its
# output in runs/repeat-<date>/load-<j>.log) and stops it at the end.
set -euo pipefail
usage() { awk 'NR == 1 { next } /^#( |$)/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; }
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  "") echo "error: give N and the tests (see --help)" >&2; exit 1 ;;
esac
n=$1
shift
[[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "error: N must be a positive count, got '$n'" >&2; exit 1; }
loaded=0
if [[ "${1:-}" == --loaded ]]; then loaded=1; shift; fi
cd "$(dirname "$0")/.."
bash tools/setup.sh
out="runs/repeat-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$out"
load_pid=""
if ((loaded)); then
  # Its own session, so that stopping it stops every process the suite started.
  setsid bash -c 'j=0; while :; do j=$((j + 1)); bash tools/test.sh > "$1/load-$j.log" 2>&1 || true
                  done' _ "$out" &
  load_pid=$!
  trap 'kill -- -"$load_pid" 2>/dev/null || true' EXIT
fi
passed=0 failed=0
for ((i = 1; i <= n; i++)); do
  start=$SECONDS
  if JAX_PLATFORMS=cpu .venv/bin/python -m pytest -q -p no:cacheprovider -s "$@" \
      > "$out/run-$i.log" 2>&1; then
    passed=$((passed + 1)); outcome=passed
  else
    failed=$((failed + 1)); outcome=FAILED
  fi
  echo "run $i/$n: $outcome in $((SECONDS - start)) s: $(tail -n 1 "$out/run-$i.log")"
done
echo "repeat: $passed passed, $failed failed"
((failed == 0))
