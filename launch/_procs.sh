# Shared by launch/local.sh and launch/node.sh (sourced, not run): start this machine's
# training processes with the LMSCALE_* variables lmscale_jax.cluster.topology reads, prefix their
# output with the process id, and supervise them.

# lmscale_python: the interpreter (PYTHON, else the checkout's .venv, else python3).
lmscale_python() {
  local root=$1
  if [[ -n "${PYTHON:-}" ]]; then echo "$PYTHON"
  elif [[ -x "$root/.venv/bin/python" ]]; then echo "$root/.venv/bin/python"
  else echo python3; fi
}

# lmscale_gpu_count: GPUs nvidia-smi lists (0 without it, or when JAX_PLATFORMS=cpu).
lmscale_gpu_count() {
  if [[ "${JAX_PLATFORMS:-}" == cpu ]] || ! command -v nvidia-smi >/dev/null 2>&1; then
    echo 0; return
  fi
  nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
}

# lmscale_run COUNT FIRST_ID TOTAL COORDINATOR DEVICES -- MAIN_ARGS...
#   Starts COUNT processes with ids FIRST_ID … of a TOTAL-process job. DEVICES: "cpu" (each
#   gets DEVICES_PER_PROCESS CPU devices, default 1), "gpu-each" (process k of this machine
#   drives GPU k) or "gpu-all" (one process drives every visible GPU).
#   Returns 0 if every process exits 0, else the first non-zero status. When one fails the
#   others get GRACE_S seconds (default 30) to stop on their own (the runtime's heartbeat),
#   then are killed; Ctrl-C / SIGTERM is passed on to all of them (SIGKILL STOP_S seconds
#   later, default 60): they checkpoint and exit 0.
lmscale_run() {
  local count=$1 first=$2 total=$3 coordinator=$4 devices=$5
  shift 5
  [[ "${1:-}" == "--" ]] && shift
  local -a pids=()
  local i id
  for ((i = 0; i < count; i++)); do
    id=$((first + i))
    local -a env_=(LMSCALE_COORDINATOR="$coordinator" LMSCALE_NUM_PROCESSES="$total"
                   LMSCALE_PROCESS_ID="$id")
    case $devices in
      cpu) env_+=(JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES="${DEVICES_PER_PROCESS:-1}") ;;
      gpu-each) env_+=(LMSCALE_LOCAL_DEVICE_IDS="$i") ;;
      gpu-all) ;;
      *) echo "lmscale_run: unknown device mode $devices" >&2; return 2 ;;
    esac
    # -u: unbuffered, so a process's last lines are not lost when a peer's failure kills it.
    env "${env_[@]}" "$LMSCALE_PY" -u -m lmscale_jax.main "$@" \
      > >(sed -u "s/^/[$id] /") 2> >(sed -u "s/^/[$id] /" >&2) &
    pids+=($!)
  done
  # SIGTERM makes the processes agree on a step, checkpoint it and exit 0
  # (lmscale_jax/cluster/preemption.py); whatever is still running STOP_S seconds later is killed.
  # The stopper's pid is kept: the final `wait` below would otherwise wait for its sleep too,
  # and the launcher exited STOP_S after its processes had (60 s by default).
  local stopper=""
  trap 'echo "launch: stopping all processes (checkpoint, then exit)" >&2
        kill -TERM "${pids[@]}" 2>/dev/null
        ( sleep "${STOP_S:-60}"; kill -KILL "${pids[@]}" ) >/dev/null 2>&1 &
        stopper=$!' INT TERM
  local rc=0 done_pid status killer="" p
  local -a live=("${pids[@]}")
  while ((${#live[@]} > 0)); do
    done_pid=""
    wait -n -p done_pid "${live[@]}"
    status=$?
    [[ -z "${done_pid:-}" ]] && continue  # a trapped signal interrupted wait
    local -a still=()
    for p in "${live[@]}"; do [[ "$p" != "$done_pid" ]] && still+=("$p"); done
    live=("${still[@]}")
    if ((status != 0 && rc == 0)); then
      rc=$status
      echo "launch: process pid $done_pid exited with status $status; stopping the others" \
        "in ${GRACE_S:-30} s unless they stop first" >&2
      # No inherited stdout/stderr: an orphaned sleep must not hold a caller's pipe open.
      ( sleep "${GRACE_S:-30}"; kill -TERM "${pids[@]}"
        sleep 5; kill -KILL "${pids[@]}" ) >/dev/null 2>&1 &
      killer=$!
    fi
  done
  [[ -n "$killer" ]] && kill "$killer" 2>/dev/null
  [[ -n "$stopper" ]] && kill "$stopper" 2>/dev/null
  trap - INT TERM
  wait 2>/dev/null  # the output prefixers
  return $rc
}
