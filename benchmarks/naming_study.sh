#!/usr/bin/env bash
# Issue 58's naming measurement: the naming fine-tune (lmscale finetune --task name) from a
# pretrained encoder and from random weights of its architecture, two seeds, the same steps, on
# one naming-build task; each run's naming_eval.json holds its held-out scores:
#   bash benchmarks/naming_study.sh PRETRAIN_RUN TOKENIZER TASK_DIR OUT   (STEPS=600 SEEDS="0 1"
#                                                                          LR=3e-4 STARTS="pre rand")
# A run whose naming_eval.json exists is skipped, so a stopped study continues. The baselines on
# the same task: python benchmarks/naming_baselines.py --task TASK_DIR.
set -euo pipefail
usage() { awk 'NR == 1 { next } /^#( |$)/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; }
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  ""|-*) echo "error: give PRETRAIN_RUN TOKENIZER TASK_DIR OUT (see --help)" >&2; exit 1 ;;
esac
[ $# -eq 4 ] || { echo "error: give PRETRAIN_RUN TOKENIZER TASK_DIR OUT (see --help)" >&2; exit 1; }
pre=$(realpath "$1"); tok=$(realpath "$2"); task=$(realpath "$3"); out=$(realpath -m "$4")
cd "$(dirname "$0")/.."
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
steps=${STEPS:-600}
mkdir -p "$out"
for s in ${SEEDS:-0 1}; do
  for start in ${STARTS:-pre rand}; do
    run=$out/$start-s$s
    [ -f "$run/naming_eval.json" ] && continue
    init=(--init-workdir "$pre"); [ $start = pre ] || init=(--init-random "$pre")
    .venv/bin/python -m lmscale_jax.cli.lmscale finetune --task name \
      --labels "$task/train.jsonl" --eval-labels "$task/test.jsonl" --workdir "$run" \
      "${init[@]}" --seed "$s" --tokenizer "$tok" --steps "$steps" --eval-every "$steps" \
      --checkpoint-every "$steps" --log-every 50 --learning-rate "${LR:-3e-4}" --warmup-steps 60 \
      > "$run.log" 2>&1 || { tail -3 "$run.log" >&2; exit 1; }
    echo "$start-s$s: $(tail -2 "$run.log" | head -1)"
  done
done
