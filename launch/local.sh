#!/usr/bin/env bash
# N training processes on this machine, coordinated over localhost (tests, scaling studies).
#
#   launch/local.sh N [-- <lmscale_jax.main args>]
#   launch/local.sh 4 -- --config=configs/tiny.py --config.data.path=DATA --workdir=runs/x
#
# Process i gets LMSCALE_COORDINATOR=localhost:<free port>, LMSCALE_NUM_PROCESSES=N and
# LMSCALE_PROCESS_ID=i. Devices: with at least N GPUs process i drives GPU i; otherwise the
# processes run on CPU with DEVICES_PER_PROCESS (default 1) devices each (JAX_PLATFORMS=cpu
# forces that). Output lines carry a "[i] " prefix. Exit status: 0 when every process
# succeeded, else the first failure's. Environment: PORT, PYTHON, DEVICES_PER_PROCESS, GRACE_S,
# LMSCALE_JOB_ID (default: random; tells this job's processes from another's on the same PORT).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/launch/_procs.sh"
usage() { sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 1; }
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then  # asked for: stdout, success
  sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
  exit 0
fi
[[ $# -ge 1 && "$1" =~ ^[1-9][0-9]*$ ]] || usage
n=$1
shift
[[ "${1:-}" == "--" ]] && shift
LMSCALE_PY=$(lmscale_python "$root")
cd "$root"
# A port the kernel has just handed out, hence free (a race with other programs is unlikely).
free_port='import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
port=${PORT:-$("$LMSCALE_PY" -c "$free_port")}
export LMSCALE_JOB_ID=${LMSCALE_JOB_ID:-local-$$-$RANDOM}
if (( $(lmscale_gpu_count) >= n )); then devices=gpu-each; else devices=cpu; fi
echo "launch: $n process(es) on localhost:$port ($devices)" >&2
set +e
lmscale_run "$n" 0 "$n" "localhost:$port" "$devices" -- "$@"
exit $?
