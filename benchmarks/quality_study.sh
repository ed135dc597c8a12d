#!/usr/bin/env bash
# Issue 59's study, downstream quality against pretraining compute, the whole grid stage by
# stage (each skipped where it is done, so a stopped study continues, in this or a later
# session with OUT kept):
#   bash benchmarks/quality_study.sh OUT   (BUDGETS="900 1800 3600 7200 14400"
#                                           WIDE_BUDGETS="1800 3600" DRY_RUN=1 …)
# Cells: the default encoder (DEFAULT, a benchmarks/longer_functions.sh VARIANTS word:
# seq256-instruction:256:instruction:post) pretrained for each of BUDGETS seconds at the
# study's one calibrated step time (STEP_TIME=0.5222703018000174 s, the 2026-12-05 calibration
# of that model on an idle 2-core machine), and the wider model (WIDE:
# seq256-instruction-4x256:256:instruction:post:layers=4,hidden=256,heads=4,ffn=1024) at the
# pretraining FLOPs of the default encoder at each of WIDE_BUDGETS (the model-size axis; its
# own step time is calibrated first, 40 steps, and recorded). Each cell is OUT/NAME-LABEL
# (e.g. seq256-instruction-15m): its budget.json (benchmarks/quality_budget.py), then
# benchmarks/longer_functions.sh over it (pretraining, the contrastive fine-tunes from the
# pretrained and from random weights at SEEDS="0 1", eval and eval2 at pool 100 and 1,000,
# compiler provenance's fine-tunes at CLS_STEPS=600 beside TF-IDF + logistic regression),
# sharing OUT/shared (corpora, tokenizer, prepared data: CORPUS_MB=240). A finished cell
# leaves OUT/NAME-LABEL/done and its table is copied once to
# benchmarks/results/DATE-cpu-quality-cell-NAME-LABEL.json. TABLES: more cell tables
# (longer_functions_table.py JSONs) measured elsewhere; a cell one of them holds is not run.
# Last, benchmarks/quality_curve.py over every table: benchmarks/results/DATE-cpu-quality-curve
# .json and .md, docs/images/quality-against-compute.png. DRY_RUN=1 prints each stage and
# whether it is done, and runs nothing. EVAL3=FILE (lmscale similarity-build --set eval3's
# JSONL) adds eval3 at pool 100, 1,000 and 10,000 to every cell (benchmarks/similarity_claims.sh). Cost on 2 CPU cores (2026-12-06, under load): corpora
# 27 min once, a cell's pretraining its budget (about 1.4x under load), each contrastive
# fine-tune about 20 min (two at once), each provenance fine-tune 8-10 min, scoring eval 7
# min (docs/similarity.md, "Quality against compute").
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
default=${DEFAULT:-seq256-instruction:256:instruction:post}
wide=${WIDE:-seq256-instruction-4x256:256:instruction:post:layers=4,hidden=256,heads=4,ffn=1024}
budgets=${BUDGETS-900 1800 3600 7200 14400}  # "" runs none
wide_budgets=${WIDE_BUDGETS-1800 3600}
step_time=${STEP_TIME:-0.5222703018000174}
export SEEDS=${SEEDS:-0 1} FT_STEPS=${FT_STEPS:-600} CLS_STEPS=${CLS_STEPS:-600}
export CORPUS_MB=${CORPUS_MB:-240}
# eval3 (pool 10,000) in every cell where its benchmark is given; a cell done before it gets
# only its eval3 stage (every other stage is skipped where done).
export EVAL3=${EVAL3:-} SETS=${SETS:-eval eval2${EVAL3:+ eval3}}
dry=${DRY_RUN:-}
today=$(date +%F)
[ -n "$dry" ] || mkdir -p "$out/shared"

label() {  # seconds -> 15m, 1h, 90m …
  if (( $1 % 3600 == 0 )); then echo "$(( $1 / 3600 ))h"; else echo "$(( $1 / 60 ))m"; fi
}
held_elsewhere() {  # NAME SECONDS -> "yes" when a table of TABLES holds that cell
  [ -n "${TABLES:-}" ] || { echo no; return; }
  $py -c 'import json, sys
name, s = sys.argv[1], int(sys.argv[2])
print("yes" if any(name in d["budget"]["variants"] and d["budget"]["budget_s"] == s
                   for d in map(lambda p: json.load(open(p)), sys.argv[3:])) else "no")' \
    "$1" "$2" $TABLES
}
stage() {  # WHAT, then the command: run it, or (DRY_RUN) say it would
  echo "== $1" >&2
  if [ -n "$dry" ]; then echo "   would run: ${*:2}" >&2; else "${@:2}"; fi
}
cell() {  # NAME VARIANT SECONDS BUDGET_ARGS… -> runs the cell OUT/NAME-LABEL unless done
  local name=$1 variant=$2 seconds=$3 dir
  dir=$out/$name-$(label "$seconds")
  if [ "$(held_elsewhere "$name" "$seconds")" = yes ]; then
    echo "== $name at $(label "$seconds"): held by a table of TABLES, not run" >&2; return
  fi
  if [ -f "$dir/done" ] && { [ -z "$EVAL3" ] || [ -f "$dir/$name/scores-eval3.json" ]; }; then
    echo "== $name at $(label "$seconds"): done ($dir)" >&2; return
  fi
  [ -n "$dry" ] || { mkdir -p "$dir"; [ -e "$dir/shared" ] || ln -s ../shared "$dir/shared"; }
  local to=(); [ -n "$dry" ] || to=(--output "$dir/budget.json")  # a dry run prints it
  [ -f "$dir/budget.json" ] || stage "$name at $(label "$seconds"): budget.json" \
    $py benchmarks/quality_budget.py --variant "$variant" --budget-s "$seconds" "${@:4}" "${to[@]}"
  stage "$name at $(label "$seconds"): pretrain, fine-tune, score, provenance ($dir.log)" \
    run_cell "$variant" "$seconds" "$dir"
}
run_cell() {  # VARIANT SECONDS DIR
  VARIANTS="$1" BUDGET_S="$2" bash benchmarks/longer_functions.sh "$3" >> "$3.log" 2>&1 \
    || { tail -3 "$3.log" >&2; exit 1; }
  touch "$3/done"
}

IFS=: read -r dname _ <<< "$default"
IFS=: read -r wname wseq _ <<< "$wide"
for s in $budgets; do
  cell "$dname" "$default" "$s" --step-time "$step_time"
done
# The wider model's own step time (a 40-step run on the shared data, longer_functions.sh's
# calibration), then its cells at the default encoder's FLOPs.
cal=$out/calibrate-$wname
if [ -n "$wide_budgets" ] && [ ! -f "$cal/budget.json" ]; then
  [ -n "$dry" ] || { mkdir -p "$cal"; [ -e "$cal/shared" ] || ln -s ../shared "$cal/shared"; }
  stage "$wname: its step time (40 steps: $cal/budget.json)" \
    env CALIBRATE_ONLY=1 VARIANTS="$wide" BUDGET_S=1 bash benchmarks/longer_functions.sh "$cal"
fi
wide_time() {
  [ -f "$cal/budget.json" ] || { echo "(after its calibration)"; return; }
  $py -c 'import json, sys; print(next(iter(json.load(open(sys.argv[1]))["variants"].values()))["step_time"])' \
    "$cal/budget.json"
}
for s in $wide_budgets; do
  cell "$wname" "$wide" "$s" --step-time "$(wide_time)" --match "$default" \
    --match-step-time "$step_time" --data "$out/shared/pretrain-seq$wseq"
done

copy_table() {  # SRC DST: temp then rename, so an interrupted copy leaves no partial table
  cp "$1" "$2.tmp" && mv "$2.tmp" "$2"
}
latest_table() {  # NAME -> the newest of that cell's tables in benchmarks/results, or nothing
  # (never a failure: under pipefail, ls of a cell with no table yet ended the study, exit 2)
  ls benchmarks/results/*-cpu-quality-cell-"$1".json 2>/dev/null | tail -1 || true
}
# Each finished cell's table into benchmarks/results (again, dated, when it changed: a stage
# added later, e.g. eval3), then the curve over all of them.
tables=(${TABLES:-})
for done in "$out"/*/done; do
  [ -f "$done" ] || continue
  dir=$(dirname "$done"); name=$(basename "$dir")
  last=$(latest_table "$name")
  [ -n "$last" ] && cmp -s "$last" "$dir/longer_functions.json" || \
    stage "$name: its table into benchmarks/results" \
    copy_table "$dir/longer_functions.json" "benchmarks/results/$today-cpu-quality-cell-$name.json"
  last=$(latest_table "$name")  # the copy (DRY_RUN: none, so the cell's own)
  tables+=("${last:-$dir/longer_functions.json}")
done
join() { local IFS=,; echo "$*"; }
if [ ${#tables[@]} -eq 0 ]; then
  echo "== the curve: no finished cell yet" >&2; exit 0
fi
stage "the curve over ${#tables[@]} cell tables" $py benchmarks/quality_curve.py "${tables[@]}" \
  --variant "$dname" --variant "$wname" \
  ${budgets:+--expect "$dname@$(join $budgets)"} \
  ${wide_budgets:+--expect "$wname@$(join $wide_budgets)"} \
  --json "benchmarks/results/$today-cpu-quality-curve.json" \
  --markdown "benchmarks/results/$today-cpu-quality-curve.md" \
  --plot docs/images/quality-against-compute.png
