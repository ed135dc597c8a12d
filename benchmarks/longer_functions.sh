#!/usr/bin/env bash
# Issue 38's study: does the model get better at binary-code similarity with longer functions
# (seq 128 vs 256), instruction-trace positions (undertale's) and pre-LN? Each variant is
# pretrained for the same CPU time on this machine, then fine-tuned identically from its
# weights and from random weights (two seeds), and scored on the held-out sets at pool 100 and
# 1,000, all pairs and O0↔O3 (benchmarks/similarity_claims.sh per variant, sharing the corpora,
# the tokenizer and the prepared data):
#   bash benchmarks/longer_functions.sh OUT   (BUDGET_S=1800 SEEDS="0 1" FT_STEPS=600 EVAL3=FILE
#                                              SETS="eval eval2" VARIANTS="…" CORPUS_MB=240)
# VARIANTS: NAME:SEQ:POSITIONS:NORM[:MODEL] words (default: seq128-segment-post
# seq256-segment-post seq256-instruction-post seq256-instruction-pre); MODEL, optional, is more
# model.* overrides, KEY=VALUE joined by commas (a wider model: layers=4,hidden=256,heads=4,
# ffn=1024), recorded in budget.json. The budget: each variant's pretraining steps
# are BUDGET_S / its step time, measured first (a 40-step run of each, one after the other, on
# an otherwise idle machine: OUT/budget.json; CALIBRATE_ONLY=1 stops once it is written; a
# budget.json written beforehand, e.g. from another study's step time, is used as it is:
# benchmarks/quality_study.sh). The untrained encoders are scored at one draw
# (DRAWS=""; similarity_claims.sh draws more). Stages are skipped where their output exists,
# so a stopped study continues; the table is OUT/longer_functions.json. A smoke run:
# BUDGET_S=20 SEEDS=0 FT_STEPS=10 CLS_STEPS=10 QUERIES=50 CORPUS_MB=24 SETS=eval. Then the
# compiler-provenance task (lmscale provenance-build over the three corpora), fine-tuned for
# CLS_STEPS (600) from each variant's weights and from random ones (CLS_WINDOWS, 1: each function
# read as up to that many windows, lmscale finetune --windows; the runs are cls-*-w<N> past 1),
# beside its TF-IDF + logistic-regression baseline (benchmarks/provenance_baseline.py).
set -euo pipefail
usage() { awk 'NR == 1 { next } /^#( |$)/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; }
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  ""|-*) echo "error: give the study's directory: bash $0 OUT (see --help)" >&2; exit 1 ;;
esac
out=$(realpath -m "$1")
cd "$(dirname "$0")/.."
export JAX_PLATFORMS=cpu
py=.venv/bin/python
variants=${VARIANTS:-seq128:128:segment:post seq256:256:segment:post \
seq256-instruction:256:instruction:post seq256-instruction-pre:256:instruction:pre}
mkdir -p "$out"

# The shared stages once (corpora, tokenizer, pretraining inputs): a claims run that stops
# before pretraining (PRE_STEPS=0 is refused, so prepare the data of each length directly).
model_args() {  # SEQ POSITIONS NORM [MODEL] -> the pretraining's --config overrides
  local kv args="--config.model.positions=$2 --config.model.norm=$3"
  for kv in ${4//,/ }; do args+=" --config.model.$kv"; done
  echo "$args"
}
calibrate() {  # NAME SEQ POSITIONS NORM [MODEL] -> seconds per step (40 steps, the last 20 timed)
  local dir=$out/calibrate/$1
  mkdir -p "$out/calibrate"
  [ -f "$dir/metrics.jsonl" ] && grep -q '"step": 40' "$dir/metrics.jsonl" || {
    rm -rf "$dir"
    $py -m lmscale_jax.main --config=configs/tiny.py --workdir="$dir" \
      --config.data.path="$out/shared/pretrain-seq$2" --config.train.steps=40 \
      --config.train.log_every=20 --config.train.eval_every=1000 \
      --config.checkpoint.every=1000 $(model_args "$2" "$3" "$4" "${5:-}") > "$dir.log" 2>&1
  }
  $py -c 'import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if "step_time" in l]
print(rows[-1]["step_time"])' "$dir/metrics.jsonl"
}

for v in $variants; do
  IFS=: read -r name seq positions norm model <<< "$v"
  # The shared data for this length: the claims script prepares it (and the corpora) when its
  # pretraining is asked for; here only the preparation runs (SETS= and no seeds do nothing).
  [ -f "$out/shared/pretrain-seq$seq/metadata.json" ] || \
    SHARED="$out/shared" SEQ_LEN="$seq" PREPARE_ONLY=1 \
    bash benchmarks/similarity_claims.sh "$out/$name"
done
budget=${BUDGET_S:-1800}
[ -f "$out/budget.json" ] || {
  rows=()
  for v in $variants; do
    IFS=: read -r name seq positions norm model <<< "$v"
    t=$(calibrate "$name" "$seq" "$positions" "$norm" "$model")
    extra=""; [ -z "$model" ] || extra=", \"model\": \"$model\""
    rows+=("\"$name\": {\"seq_len\": $seq, \"positions\": \"$positions\", \"norm\": \"$norm\"$extra, \"step_time\": $t, \"steps\": $($py -c "print(max(1, round($budget / $t)))")}")
  done
  (IFS=,; echo "{\"budget_s\": $budget, \"variants\": {${rows[*]}}}") > "$out/budget.json.tmp"
  mv "$out/budget.json.tmp" "$out/budget.json"
}
[ -z "${CALIBRATE_ONLY:-}" ] || exit 0  # the step times only (benchmarks/quality_study.sh)
for v in $variants; do
  IFS=: read -r name seq positions norm model <<< "$v"
  steps=$($py -c 'import json, sys; print(json.load(open(sys.argv[1]))["variants"][sys.argv[2]]["steps"])' \
    "$out/budget.json" "$name")
  SHARED="$out/shared" SEQ_LEN="$seq" PRE_STEPS="$steps" \
    PRE_ARGS="$(model_args "$seq" "$positions" "$norm" "$model")" SEEDS="${SEEDS:-0 1}" DRAWS="${DRAWS-}" \
    bash benchmarks/similarity_claims.sh "$out/$name"
done
# The compiler-provenance task (lmscale provenance-build: the three corpora, split by library),
# fine-tuned identically from each variant's pretrained weights and from random weights.
task=$out/shared/provenance
corpora=$out/shared/corpora
[ -f "$task/task.json" ] || $py -m lmscale_jax.cli.lmscale provenance-build \
  --bench "$corpora/eval.jsonl" "$corpora/eval2.jsonl" "$corpora/train-pairs.jsonl" \
  --output "$task"
cls_steps=${CLS_STEPS:-600} cls_windows=${CLS_WINDOWS:-1}
windowed=$([ "$cls_windows" = 1 ] || echo "-w$cls_windows")
for v in $variants; do
  IFS=: read -r name seq positions norm model <<< "$v"
  for s in ${SEEDS:-0 1}; do
    for start in pre rand; do
      run=$out/$name/cls-$start-s$s$windowed
      [ -f "$run/classification_eval.json" ] && grep -q "\"step\": $cls_steps" \
        "$run/classification_eval.json" && continue
      init=(--init-workdir "$out/$name/pretrain/run")
      [ $start = pre ] || init=(--init-random "$out/$name/pretrain/run")
      $py -m lmscale_jax.cli.lmscale finetune --task classify --labels "$task/train.jsonl" \
        --eval-labels "$task/test.jsonl" --workdir "$run" "${init[@]}" --seed "$s" \
        --tokenizer "$out/shared/demo/data/tokenizer.json" --steps "$cls_steps" \
        --windows "$cls_windows" --eval-every "$cls_steps" --checkpoint-every "$cls_steps" \
        --log-every 50 --learning-rate 3e-4 --warmup-steps 60 > "$run.log" 2>&1 \
        || { tail -3 "$run.log" >&2; exit 1; }
    done
  done
done
[ -f "$out/provenance-baseline.json" ] || $py benchmarks/provenance_baseline.py --task "$task" \
  --json "$out/provenance-baseline.json"
# The table is rebuilt on every run (--overwrite: also over one written before outputs were marked).
$py benchmarks/longer_functions_table.py --study "$out" --json "$out/longer_functions.json" \
  --overwrite
