#!/usr/bin/env bash
# The similarity claims of README.md and docs/similarity.md, measured on both held-out sets
# (eval: LZ4, Brotli, zstd, QuickJS; eval2: SQLite, libuv, libyaml, llhttp, CRoaring) at
# several fine-tuning seeds, with TF-IDF and the untrained encoders in the same tables:
#   bash benchmarks/similarity_claims.sh OUT      (SEEDS="0 1 2" PRE_STEPS=3000 FT_STEPS=600
#                                                  CORPUS_MB=240 QUERIES=0 SEQ_LEN=128
#                                                  PRE_ARGS="" SHARED=OUT SETS="eval eval2"
#                                                  DRAWS="1 2" EVAL3=FILE)
# SHARED holds what does not depend on the model (the corpora, the tokenizer, the pretraining
# inputs, the prepared pretraining data per SEQ_LEN), so several studies share it
# (benchmarks/longer_functions.sh); PRE_ARGS are more --config overrides of the pretraining
# (e.g. "--config.model.positions=instruction --config.model.norm=pre"); PREPARE_ONLY=1 stops
# after the shared stages. SETS may name eval3 (issue 59's pool-10,000 benchmark, built apart
# with lmscale similarity-build --set eval3: EVAL3 is its JSONL): scored at pool 100, 1,000 and
# 10,000 on EVAL3_QUERIES (2000) queries per pair and direction, at one draw.
# Stages, each skipped where its output is there (so a stopped study continues): fetch the
# sources, build eval, eval2 and the training pairs (disjoint from both), a pretraining corpus
# from this machine's /usr/lib/x86_64-linux-gnu without the evaluation sets' libraries (the
# demo's tokenizer), pretrain configs/tiny.py, fine-tune from it and from random weights at
# each seed, evaluate every model on both sets, and print the table
# (benchmarks/similarity_seeds.py; OUT/claims.json). On 2 CPU cores the defaults take about
# 3 hours; a smoke run: SEEDS=0 PRE_STEPS=20 FT_STEPS=10 QUERIES=50 CORPUS_MB=24.
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
seeds=${SEEDS:-0 1 2}
shared=$(realpath -m "${SHARED:-$out}")
corpora=$shared/corpora
seq_len=${SEQ_LEN:-128}
sets=${SETS:-eval eval2}
bench_of() {  # a set's benchmark file: the study's corpora, or eval3's (EVAL3, built apart)
  if [ "$1" != eval3 ]; then echo "$corpora/$1.jsonl"; return; fi
  [ -n "${EVAL3:-}" ] && [ -f "$EVAL3" ] || {
    echo "error: SETS has eval3 but EVAL3='${EVAL3:-}' is no file: give EVAL3=FILE.jsonl," \
      "the benchmark lmscale similarity-build --set eval3 wrote (docs/similarity-corpora.md)" >&2
    exit 1
  }
  echo "$EVAL3"
}
draws_of() {  # eval3 (64k functions) is scored once: its untrained encoders get no more draws
  [ "$1" = eval3 ] || echo "${DRAWS-1 2}"
}
for set in $sets; do bench_of "$set" > /dev/null; done  # before any work
mkdir -p "$corpora" "$out"

for set in eval eval2 train; do
  $py tools/fetch_bench_sources.py --output "$shared/bench_sources" --set "$set" > /dev/null
done
for set in eval eval2; do
  [ -f "$corpora/$set.jsonl" ] || $py tools/build_similarity_bench.py --set "$set" \
    --from "$shared/bench_sources" --compilers gcc,clang --opt O0,O1,O2,O3 --output "$corpora/$set.jsonl"
done
[ -f "$corpora/train-pairs.jsonl" ] || $py tools/build_similarity_bench.py --set train \
  --from "$shared/bench_sources" --compilers gcc,clang --opt O0,O1,O2,O3,Os --drop-duplicates \
  --disjoint-from "$corpora/eval.jsonl" "$corpora/eval2.jsonl" \
  --output "$corpora/train-pairs.jsonl"
$py tools/similarity_leakage.py --train "$corpora/train-pairs.jsonl" \
  --bench "$corpora/eval.jsonl" --check
$py tools/similarity_leakage.py --train "$corpora/train-pairs.jsonl" \
  --bench "$corpora/eval2.jsonl" --check

# The tokenizer is the demo's (24 MB of this machine's ELF files); the corpus is 10x that,
# without the system copies of the evaluation sets' libraries (a benchmark function seen in
# pretraining would be leakage; eval_similarity.py --train-elf counts what is left).
[ -f "$shared/demo/data/metadata.json" ] || $py tools/prepare_binary.py \
  --input /usr/lib/x86_64-linux-gnu /usr/bin --output "$shared/demo/data" --seq-len 128 \
  --vocab-size 4096 --max-input-bytes 24000000 --overwrite
tokenizer=$shared/demo/data/tokenizer.json
if [ ! -d "$shared/corpus_in" ]; then
  mkdir -p "$shared/corpus_in.tmp"
  $py - "$shared/corpus_in.tmp" <<'EOF'
import os, re, sys
src, dst = "/usr/lib/x86_64-linux-gnu", sys.argv[1]
left_out = re.compile(r"lz4|zstd|brotli|quickjs|sqlite|libuv|yaml|roaring|llhttp|http_parser")
seen = set()
for name in sorted(os.listdir(src)):
  real = os.path.realpath(os.path.join(src, name))
  if real in seen or not os.path.isfile(real) or left_out.search(os.path.basename(real)):
    continue
  with open(real, "rb") as f:
    if f.read(4) == b"\x7fELF":
      seen.add(real)
      os.symlink(real, os.path.join(dst, os.path.basename(real)))
EOF
  mv "$shared/corpus_in.tmp" "$shared/corpus_in"
fi
data=$shared/pretrain-seq$seq_len
[ -f "$data/metadata.json" ] || $py tools/prepare_binary.py \
  --input "$shared/corpus_in" --tokenizer "$tokenizer" --output "$data" \
  --seq-len "$seq_len" --max-input-bytes $(( ${CORPUS_MB:-240} * 1000000 )) --overwrite
[ -z "${PREPARE_ONLY:-}" ] || exit 0  # the shared stages only (benchmarks/longer_functions.sh)

done_at() {  # "yes" when the run in $1 finished its $2 steps
  $py -c 'import sys
from lmscale_jax.cluster import run_state
s = run_state.read(sys.argv[1]) or {}
print("yes" if s.get("state") == "finished" and s.get("step") == int(sys.argv[2]) else "no")' "$1" "$2"
}
pre_steps=${PRE_STEPS:-3000}
[ "$(done_at "$out/pretrain/run" "$pre_steps")" = yes ] || $py -m lmscale_jax.main \
  --config=configs/tiny.py --workdir="$out/pretrain/run" \
  --config.data.path="$data" --config.train.steps="$pre_steps" ${PRE_ARGS:-}

ft_steps=${FT_STEPS:-600}
finetune() {  # $1 workdir, then the start
  [ "$(done_at "$1" "$ft_steps")" = yes ] || $py tools/finetune_similarity.py \
    --pairs "$corpora/train-pairs.jsonl" --workdir "$1" "${@:2}" --tokenizer "$tokenizer" \
    --steps "$ft_steps" --log-every 50 --learning-rate 3e-4 --warmup-steps 60 \
    --checkpoint-every 200
}
# Two at once (each its own log, appended: a rerun that skips a finished run keeps its log): on
# 2 cores two runs of this tiny model finish sooner than
# one after the other.
runs=(--workdir "$out/pretrain/run")
for s in $seeds; do
  finetune "$out/ft-pre-s$s" --init-workdir "$out/pretrain/run" --seed "$s" \
    >> "$out/ft-pre-s$s.log" 2>&1 & pre=$!
  finetune "$out/ft-rand-s$s" --init-random "$out/pretrain/run" --seed "$s" \
    >> "$out/ft-rand-s$s.log" 2>&1 & rand=$!
  wait $pre || { tail -3 "$out/ft-pre-s$s.log" >&2; exit 1; }
  wait $rand || { tail -3 "$out/ft-rand-s$s.log" >&2; exit 1; }
  runs+=(--workdir "$out/ft-pre-s$s" --workdir "$out/ft-rand-s$s")
done

for set in $sets; do
  bench=$(bench_of "$set")
  pools=100,1000 queries=${QUERIES:-0}
  # eval3 was built for pool 10,000 (issue 59); EVAL3_QUERIES queries per pair and direction.
  [ "$set" != eval3 ] || { pools=100,1000,10000; queries=${EVAL3_QUERIES:-2000}; }
  [ -f "$out/scores-$set.json" ] || $py tools/eval_similarity.py \
    --bench "$bench" "${runs[@]}" --tokenizer "$tokenizer" --pool "$pools" \
    --queries "$queries" --train-elf "$shared/corpus_in" \
    --train-max-bytes $(( ${CORPUS_MB:-240} * 1000000 )) --json "$out/scores-$set.json"
  # The untrained encoders at more draws (--seed: other pools, other random weights): their
  # claims (MLM alone vs random weights vs TF-IDF) pair up draw by draw.
  for s in $(draws_of "$set"); do
    [ -f "$out/scores-$set-draw$s.json" ] || $py tools/eval_similarity.py \
      --bench "$bench" --workdir "$out/pretrain/run" --tokenizer "$tokenizer" \
      --pool 100,1000 --queries "${QUERIES:-0}" --seed "$s" --json "$out/scores-$set-draw$s.json"
  done
done
draws() {  # the set's eval JSONs: the main one, then one per extra draw
  local files=$out/scores-$1.json
  for s in $(draws_of "$1"); do files+=",$out/scores-$1-draw$s.json"; done
  echo "$files"
}
set_args=(); for set in $sets; do set_args+=(--set "$set=$(draws "$set")"); done
$py benchmarks/similarity_seeds.py "${set_args[@]}" \
  --group TF-IDF=tfidf --group "random init + fine-tune=ft-rand-s*" \
  --group "pretrained + fine-tune=ft-pre-s*" \
  --group "TF-IDF, 3 draws=tfidf,tfidf/*" --group "random weights, untrained=random-init*" \
  --group "MLM only=run@*" \
  --compare "pretrained + fine-tune>random init + fine-tune" \
  --compare "pretrained + fine-tune>TF-IDF" --compare "random init + fine-tune>TF-IDF" \
  --compare "TF-IDF, 3 draws>MLM only" --compare "MLM only>random weights, untrained" \
  --cells "gcc-O0↔gcc-O3@100,all@100,gcc-O0↔gcc-O3@1000,all@1000,gcc-O0↔gcc-O3@10000,all@10000" \
  --json "$out/claims.json" --overwrite  # rebuilt on every run (also over an unmarked old one)
