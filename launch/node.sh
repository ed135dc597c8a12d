#!/usr/bin/env bash
# One node's share of a multi-node job, for clusters without Slurm: run it once on every node.
#
#   COORDINATOR=node0:12355 NUM_NODES=N NODE_RANK=r GPUS_PER_NODE=G launch/node.sh \
#       [-- <lmscale_jax.main args>]
#
# COORDINATOR: host:port of node 0 (NODE_RANK=0 runs process 0 there; the port must be free on
#   it and reachable from every node; taken, process 0 stops with an error naming it).
#   LMSCALE_JOB_ID: optional, the same on every node (tells this job from another one
#   started on the same COORDINATOR).
# PROCS_PER_NODE: G (default: one process per GPU) or 1 (one process driving all G GPUs).
# STAGE_FROM=/shared/dataset DATA_DIR=/local/ssd/dataset: first copy the dataset to this
#   node's local disk (lmscale stage; a rerun verifies and copies nothing), then train from
#   DATA_DIR (passed as --config.data.path). STAGE_WORKERS: parallel copies (default 16).
#   STAGE_ONLY_NEEDED=1: copy only the shards this node's processes read and train with
#   --config.data.shard_by_process=True (1/NUM_NODES of the data per node; see docs/cluster.md).
# GPUS_PER_NODE=0 runs PROCS_PER_NODE CPU processes (testing the launch without GPUs).
# The workdir (--workdir) must be on storage every node sees.
set -euo pipefail
usage() { awk 'NR == 1 { next } /^#( |$)/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; }
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/launch/_procs.sh"
: "${COORDINATOR:?set COORDINATOR=host:port (node 0)}" "${NUM_NODES:?set NUM_NODES}"
: "${NODE_RANK:?set NODE_RANK (0 … NUM_NODES-1)}" "${GPUS_PER_NODE:?set GPUS_PER_NODE}"
[[ "${1:-}" == "--" ]] && shift
if ! [[ "$NUM_NODES" =~ ^[1-9][0-9]*$ && "$NODE_RANK" =~ ^[0-9]+$ \
        && "$GPUS_PER_NODE" =~ ^[0-9]+$ ]] || ((NODE_RANK >= NUM_NODES)); then
  echo "error: need NUM_NODES >= 1, 0 <= NODE_RANK < NUM_NODES, GPUS_PER_NODE >= 0" \
    "(got $NUM_NODES, $NODE_RANK, $GPUS_PER_NODE)" >&2
  exit 1
fi
procs=${PROCS_PER_NODE:-$GPUS_PER_NODE}
if ((GPUS_PER_NODE == 0)); then
  devices=cpu
  procs=${PROCS_PER_NODE:-1}
elif ((procs == 1)); then
  devices=gpu-all
elif ((procs == GPUS_PER_NODE)); then
  devices=gpu-each
else
  echo "error: PROCS_PER_NODE=$procs: expected 1 or GPUS_PER_NODE ($GPUS_PER_NODE)" >&2
  exit 1
fi
LMSCALE_PY=$(lmscale_python "$root")
cd "$root"
args=("$@")
first=$((NODE_RANK * procs))  # this node's first process id
if [[ -n "${STAGE_FROM:-}" ]]; then
  : "${DATA_DIR:?set DATA_DIR (node-local) together with STAGE_FROM}"
  progress=--no-progress
  [[ -t 2 ]] && progress=""
  echo "node $NODE_RANK: staging $STAGE_FROM -> $DATA_DIR" >&2
  only=()
  if [[ -n "${STAGE_ONLY_NEEDED:-}" && "$STAGE_ONLY_NEEDED" != 0 ]]; then
    only=(--only-needed --plan by_shard --num-processes $((NUM_NODES * procs))
          --process-ids "$(seq -s, "$first" $((first + procs - 1)))")
    args+=(--config.data.shard_by_process=True)
  fi
  "$LMSCALE_PY" -m lmscale_jax.cli.lmscale stage "$STAGE_FROM" "$DATA_DIR" \
    --workers "${STAGE_WORKERS:-16}" $progress ${only[@]+"${only[@]}"}
  args+=(--config.data.path="$DATA_DIR")
fi
echo "node $NODE_RANK of $NUM_NODES: processes $first…$((first + procs - 1))" \
  "of $((NUM_NODES * procs)), coordinator $COORDINATOR ($devices)" >&2
set +e
lmscale_run "$procs" "$first" $((NUM_NODES * procs)) "$COORDINATOR" "$devices" -- "${args[@]}"
exit $?
