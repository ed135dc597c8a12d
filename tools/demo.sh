#!/usr/bin/env bash
# Sets everything up, builds a small dataset from this machine's own ELF binaries and pretrains
# configs/tiny.py on the CPU, then prints the loss curve next to the unigram baseline.
#   bash tools/demo.sh            (DEMO_DIR=demo, DEMO_MB=24 of ELF input, DEMO_STEPS=1500)
# Ctrl-C or SIGTERM stops the training at the step it is at, with a checkpoint (passed on to it
# as SIGTERM, the preemption signal), and prints that step; the same command continues the run
# from there (any other run in DEMO_DIR/run is replaced by a new one). Exit status: 0 trained,
# eval loss below the unigram baseline; 130 stopped by Ctrl-C, 143 by SIGTERM (to this script,
# or to the training itself: its run_state.json says "preempted"), no final result printed
# then; any other non-zero status is an error named on its own line, or 1 for a final eval
# loss not below the baseline.
set -euo pipefail
source "$(dirname "$0")/_no_arguments.sh" "$0" "$@"  # --help, or no arguments at all
cd "$(dirname "$0")/.."
bash tools/setup.sh
dir=${DEMO_DIR:-demo}
steps=${DEMO_STEPS:-1500}
export JAX_PLATFORMS=cpu
# --val-fraction 0.03: configs/tiny.py evaluates 8 batches of 32; at the default 1% the
# validation split of 24 MB of ELF input held 4 distinct batches (a warning the demo caused);
# at 3% it holds 667 records, 20 distinct batches (measured 2026-12-04).
if [ ! -f "$dir/data/metadata.json" ]; then
  .venv/bin/lmscale prepare binary --input /usr/lib/x86_64-linux-gnu /usr/bin \
    --output "$dir/data" --seq-len 128 --val-fraction 0.03 \
    --max-input-bytes $(( ${DEMO_MB:-24} * 1000000 )) --overwrite
fi
.venv/bin/lmscale inspect-data "$dir/data" --verify

# "STATE STEP TOTAL_STEPS" of the run in $1 (run_state.json; "none -1 -1" without one).
run_state() {
  .venv/bin/python -c 'import sys
from lmscale_jax.cluster import run_state
s = run_state.read(sys.argv[1]) or {}
print(s.get("state", "none"), s.get("step", -1), s.get("total_steps", -1))' "$1"
}

read -r state step total < <(run_state "$dir/run")
if [ "$state" = preempted ]; then
  echo "demo: continuing the run in $dir/run from step $step" >&2
else
  rm -rf "$dir/run"
fi
# The training is a job of its own (set -m: its own process group), so a Ctrl-C in the terminal
# reaches only this script, which passes it on as SIGTERM: the run checkpoints the step it is at
# and exits 0 ("preempted"). A Ctrl-C reaching the training too would race that: it stops at a
# step boundary without a save, keeping only the periodic checkpoints (every 200 steps here).
# SIGTERM to this script alone used to end the script and leave the training running.
stopped_by=""
train_pid=""
stop_training() {
  stopped_by=${stopped_by:-$1}
  [ -z "$train_pid" ] || kill -TERM "$train_pid" 2>/dev/null || true
}
trap 'stop_training INT' INT
trap 'stop_training TERM' TERM
set -m
.venv/bin/python -m lmscale_jax.main --config=configs/tiny.py --workdir="$dir/run" \
  --config.data.path="$dir/data" --config.train.steps="$steps" &
train_pid=$!
set +m
[ -z "$stopped_by" ] || kill -TERM "$train_pid" 2>/dev/null || true  # a signal before $!
status=0
while :; do
  done_pid=""
  wait -n -p done_pid "$train_pid" && status=0 || status=$?
  [ -n "${done_pid:-}" ] && break  # else a trapped signal interrupted the wait: wait on
done
trap - INT TERM
read -r state step total < <(run_state "$dir/run")
# Stopped: a signal to the demo, or the training's own exit 0 as "preempted" (a "preempted"
# left by an earlier stop with an error exit now is that error, its own line above).
if [ "$state" != finished ] && { [ -n "$stopped_by" ] ||
                                 { [ "$status" -eq 0 ] && [ "$state" = preempted ]; }; }; then
  case $stopped_by in
    INT) how="Ctrl-C" ;;
    TERM) how="SIGTERM to the demo" ;;
    *) how="SIGTERM or SIGUSR1 to the training" ;;
  esac
  if [ "$state" = preempted ]; then
    echo "demo: training stopped at step $step of $total ($how); its checkpoint is kept in" \
      "$dir/run: run the same command again (bash tools/demo.sh, the same DEMO_* settings)" \
      "to continue from step $step" >&2
  else
    echo "demo: training stopped ($how) before it saved a checkpoint to continue from; the" \
      "same command starts it again" >&2
  fi
  [ "$stopped_by" = INT ] && exit 130
  exit 143
fi
[ "$status" -eq 0 ] || exit "$status"
.venv/bin/python - "$dir/run/metrics.jsonl" <<'PY'
import json, math, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
base = next(r["unigram_baseline"] for r in rows if "unigram_baseline" in r)
train = [r for r in rows if "loss" in r]
evals = [r for r in rows if "eval_loss" in r]
print(f"\n{'step':>6} {'train loss':>11} {'eval loss':>10}   unigram baseline {base:.3f} nats")
tr = {r["step"]: r["loss"] for r in train}
for step in sorted({train[0]["step"], *(r["step"] for r in evals)}):
  e = next((f"{r['eval_loss']:.3f}" for r in evals if r["step"] == step), "-")
  t = f"{tr[step]:.3f}" if step in tr else "-"
  print(f"{step:>6} {t:>11} {e:>10}")
final = evals[-1]["eval_loss"]
print(f"final eval MLM loss {final:.3f} vs unigram baseline {base:.3f}: perplexity "
      f"{math.exp(final):.1f} vs {math.exp(base):.1f} ({math.exp(base - final):.1f}× lower); "
      f"accuracy {evals[-1]['eval_mlm_accuracy']:.1%}")
sys.exit(0 if final < base else 1)
PY
