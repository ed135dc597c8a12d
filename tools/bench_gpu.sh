#!/usr/bin/env bash
# Every GPU measurement of docs/performance.md in one invocation (~8 minutes on one H200):
#
#   bash tools/bench_gpu.sh OUTDIR            # on the GPU machine, from the repository root
#   BENCH_SMOKE=1 bash tools/bench_gpu.sh OUT # CPU dry run: tiny shapes, same code paths
#
# 0. lmscale gpu-check (devices, versions, cuDNN vs XLA attention, a 120M step at batch 8 and
# B120): if it FAILs, the script stops there with its reason (no minutes spent on a broken
# install), then the GPU-only tests (OUTDIR/gpu_tests.log: cuDNN/Pallas attention, fine-tuning
# and undertale's variant in bf16); 1. bf16 matmul peak (the MFU denominator); 2. lmscale_jax training steps on synthetic
# batches: 120M batch 184, 350M batch 64 (with a jax.profiler trace), 350M at 128 sequences
# per device (remat=dots, and grad_accum_steps=2); 3. the Hugging Face peer
# (.gpu/peer_hf_bert.py) at the same shapes: bf16 120M b184, bf16 350M b64, fp32 350M b20
# (the paper's recipe); 4. A/B variants while time remains (Hopper XLA flags, the earlier
# cuDNN bias mask, rbg dropout); 5. the loader: a real 120M training run on a generated
# dataset with data.autotune, its input-wait fraction; 6. lmscale max-batch for 350M on the
# GPU; 7. lmscale index's embedding throughput (OUTDIR/index_throughput.json); 8. lmscale
# serve's dynamic batching against lmscale embed (OUTDIR/serve_batching.json).
# Results: OUTDIR/gpu_check.json (the self-check's report),
# OUTDIR/<date>-gpu-bench.jsonl (one object per measurement: system, model, batch, seq,
# samples_per_sec, mfu, peak_mem_gb, device, …, the 350M step's top device ops
# from its jax.profiler trace), OUTDIR/summary.{json,md} (the table, also on stdout),
# OUTDIR/max_batch_gpu.jsonl, OUTDIR/logs.tgz; scratch (dataset, run, trace) in $BENCH_WORK.
#
# The GPU machine has no package index: wheels of what its image lacks (grain, array-record,
# ml-collections, tensorboardX, portpicker) and the peer script come from .gpu/, filled here
# by tools/fetch_gpu_wheels.sh; name .gpu in the device call's carry.
set -uo pipefail
# --help: its usage only; an option is never taken for OUTDIR (that would run every benchmark).
usage() { awk 'NR == 1 { next } /^#( |$)/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; }
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  -*) echo "error: unknown option '$1' (usage: tools/bench_gpu.sh OUTDIR; see --help)" >&2
      exit 1 ;;
  "") echo "error: missing OUTDIR (usage: tools/bench_gpu.sh OUTDIR; see --help)" >&2; exit 1 ;;
esac
if [ $# -gt 1 ]; then
  echo "error: one argument expected, got $# (usage: tools/bench_gpu.sh OUTDIR)" >&2; exit 1
fi
cd "$(dirname "$0")/.."
OUT=$1
# Without -e a failed cd would leave OUT empty and every result would go to /.
if ! mkdir -p "$OUT/logs" 2>/dev/null || ! OUT=$(cd "$OUT" && pwd); then
  echo "error: cannot create OUTDIR '$1' (a writable directory)" >&2; exit 1
fi
START=$SECONDS
BUDGET=${BENCH_BUDGET_S:-470}   # optional steps start only while this many seconds remain
PY=${PYTHON:-python3}
if [ -n "${BENCH_SMOKE:-}" ] && [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then
  PY=.venv/bin/python  # the dry run uses this checkout's environment (tools/setup.sh)
fi
RESULTS="$OUT/$(date +%Y-%m-%d)-gpu-bench.jsonl"
# Bulky scratch (dataset, training run with its checkpoint, profiler trace) stays out of OUTDIR:
# a device call brings back only a few small files.
WORK=${BENCH_WORK:-/tmp/lmscale_bench}
rm -rf "$WORK" && mkdir -p "$WORK"
: >"$RESULTS"
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
# Compiled programs shared between the benchmark step and the training run of the same shape.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/lmscale_jax_cache}
HOPPER_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_triton_gemm=false"

log() { printf '[%4ds] %s\n' $((SECONDS - START)) "$*"; }
left() { echo $((BUDGET - (SECONDS - START))); }

# --- environment ------------------------------------------------------------------------
if ! "$PY" -c "import grain, array_record, ml_collections, tensorboardX" 2>/dev/null; then
  if ls .gpu/wheels/*.whl >/dev/null 2>&1; then
    log "installing $(ls .gpu/wheels/*.whl | wc -l) carried wheels into /tmp/lmscale_site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/lmscale_site .gpu/wheels/*.whl || log "wheel install failed"
    export PYTHONPATH=/tmp/lmscale_site${PYTHONPATH:+:$PYTHONPATH}
  else
    log "grain/array-record/ml-collections/tensorboardX missing and no .gpu/wheels: run" \
        "tools/fetch_gpu_wheels.sh and carry .gpu"
  fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PEER=${PEER_SCRIPT:-.gpu/peer_hf_bert.py}
[ -f "$PEER" ] || PEER=../shared/bench/peer_hf_bert.py

if [ -n "${BENCH_SMOKE:-}" ]; then  # CPU dry run: tiny shapes through the same commands
  export JAX_PLATFORMS=cpu
  GPU="cpu (smoke)"
  SHAPE120=(--set model.layers=2 --set model.hidden=64 --set model.heads=2 --set model.ffn=128)
  SHAPE350=(--set model.layers=2 --set model.hidden=64 --set model.heads=2 --set model.ffn=256)
  TRAIN120=(--config.model.layers=2 --config.model.hidden=64 --config.model.heads=2
            --config.model.ffn=128)
  B120=8 B350=8 B350MAX=16 BFP32=4 SEQ=64 VOCAB=512 STEPS=3 MATMUL=512 PEER_DEV=cpu
  TRAIN_STEPS=6 MAXB_BUDGET=0.05
else
  GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm \
    --format=csv 2>&1 | tee "$OUT/logs/nvidia-smi.txt"
  SHAPE120=() SHAPE350=() TRAIN120=()
  B120=184 B350=64 B350MAX=128 BFP32=20 SEQ=512 VOCAB=22016 STEPS=20 MATMUL=8192
  PEER_DEV=cuda TRAIN_STEPS=120 MAXB_BUDGET=80
fi
"$PY" - <<'EOF' 2>&1 | tee "$OUT/logs/versions.txt"
import jax, sys
print("python", sys.version.split()[0], "| jax", jax.__version__, "|", jax.devices())
try:
  import torch, transformers
  print("torch", torch.__version__, "| transformers", transformers.__version__)
except ImportError as e:
  print("peer unavailable:", e)
EOF

# run NAME TIMEOUT_S CMD...: one measurement; its JSON line (if any) goes to RESULTS.
run() {
  local name=$1 limit=$2; shift 2
  log "$name"
  timeout "$limit" "$@" >"$OUT/logs/$name.log" 2>&1
  local rc=$?
  if [ $rc -ne 0 ]; then
    log "  $name failed (exit $rc): $(tail -n 3 "$OUT/logs/$name.log" | tr '\n' ' ' | cut -c1-300)"
    printf '{"system": "failed", "name": "%s", "exit": %d}\n' "$name" $rc >>"$OUT/failures.jsonl"
  else
    tail -n 1 "$OUT/logs/$name.log" | cut -c1-400
  fi
  return 0
}
step() {  # step NAME CONFIG BATCH [extra bench_step args…]
  local name=$1 config=$2 batch=$3; shift 3
  local shape=("${SHAPE120[@]}")
  [[ $config == *350m* ]] && shape=("${SHAPE350[@]}")
  # BERT's one position table, as the peer computes (the default, auto, is undertale's
  # instruction positions on binary code; a later --set model.positions=… overrides this).
  run "$name" 300 "$PY" benchmarks/bench_step.py --config "$config" --batch "$batch" \
    --seq $SEQ --vocab $VOCAB --steps $STEPS --peak-tflops "$PEAK" --jsonl "$RESULTS" \
    --set model.positions=segment ${shape[@]+"${shape[@]}"} "$@"
}
peer() {  # peer NAME MODE CONFIG BATCH
  local name=$1 mode=$2 config=$3 batch=$4
  local shape=("${SHAPE120[@]}")
  [[ $config == *350m* ]] && shape=("${SHAPE350[@]}")
  if ! "$PY" -c "import torch, transformers" 2>/dev/null; then
    log "$name skipped: no torch/transformers"; return 0
  fi
  run "$name" 240 "$PY" benchmarks/bench_step.py --peer "$mode" --peer-script "$PEER" \
    --peer-device $PEER_DEV --device-label "$GPU" --config "$config" --batch "$batch" \
    --seq $SEQ --vocab $VOCAB --steps 15 --peak-tflops "$PEAK" --jsonl "$RESULTS" \
    ${shape[@]+"${shape[@]}"}
}

# --- 0. the self-check: stop early if the install cannot run our GPU path ---------------------
# (It also compares cuDNN attention with XLA attention, output and gradients, at the model's
# shapes.) Smoke: --allow-cpu at the tiny shapes.
CHECK=(--config configs/bert120m.py --seq $SEQ --vocab $VOCAB --batch $B120)
[ -n "${BENCH_SMOKE:-}" ] && CHECK+=(--allow-cpu --small-batch 2 "${SHAPE120[@]}")
log "gpu_check"
timeout 300 "$PY" -m lmscale_jax.cli.lmscale gpu-check "${CHECK[@]}" --json "$OUT/gpu_check.json" \
  >"$OUT/logs/gpu_check.log" 2>&1
rc=$?
sed -n '/^devices:/,$p' "$OUT/logs/gpu_check.log"
if [ $rc -ne 0 ]; then
  why=$(grep -E '^(FAIL|error):' "$OUT/logs/gpu_check.log" | tail -n 1)
  log "stopping: gpu_check failed (exit $rc): ${why:-$(tail -n 3 "$OUT/logs/gpu_check.log" \
    | tr '\n' ' ' | cut -c1-400)}"
  tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
  exit 1
fi

# --- 0b. the GPU-only tests: what the CPU suite skips (cuDNN/Pallas attention against XLA,
# fine-tuning's bf16 path with GradCache accumulation, remat and a bf16 reduction, undertale's
# variant — instruction positions, pre-LN — in bf16 with cuDNN attention) ---------------------
# JAX_PLATFORMS=cuda: tests/conftest.py makes the CPU the default backend, so without it every
# one of these would skip ("needs a GPU") on the GPU itself.
if [ -z "${BENCH_SMOKE:-}" ]; then
  run gpu_tests 240 env JAX_PLATFORMS=cuda "$PY" -m pytest -q -p no:cacheprovider -rs \
    tests/test_model.py::test_cudnn_attention_matches_xla \
    tests/test_model.py::test_gpu_segment_attention_matches_xla tests/test_finetune_gpu.py \
    tests/test_model_variants_gpu.py
  cp "$OUT/logs/gpu_tests.log" "$OUT/gpu_tests.log" 2>/dev/null
  # lmscale serve on the GPU: the batcher's buckets and the naming model's padded batches give
  # the commands' answers (embed, fill-mask, search by upload, names), server and CLI both on it.
  run gpu_serve 300 env JAX_PLATFORMS=cuda "$PY" -m pytest -q -p no:cacheprovider -rs \
    tests/test_serve_api.py tests/test_serve_name.py \
    -k "embed_equals or fill_mask_equals or search_by_upload or names_equal"
  cp "$OUT/logs/gpu_serve.log" "$OUT/gpu_serve.log" 2>/dev/null
fi

# --- 1. matmul peak ---------------------------------------------------------------------
run matmul 120 "$PY" benchmarks/bench_step.py --matmul --size $MATMUL --jsonl "$RESULTS"
PEAK=$("$PY" -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1]) if 'tflops' in l and 'matmul' in l]; print(round(r[-1]['tflops'],3) if r else 0)" "$RESULTS")
log "matmul peak: $PEAK TFLOP/s (the MFU denominator below; 0 = device table)"

# --- 2./3. the comparison at the issue's shapes -----------------------------------------
step jax_120m_b$B120 configs/bert120m.py $B120 --model bert120m
peer hf_bf16_120m_b$B120 bf16 configs/bert120m.py $B120
step jax_350m_b$B350 configs/bert350m.py $B350 --model bert350m --profile "$WORK/trace_350m"
peer hf_bf16_350m_b$B350 bf16 configs/bert350m.py $B350
peer hf_fp32_350m_b$BFP32 fp32 configs/bert350m.py $BFP32
step jax_350m_b${B350MAX}_dots configs/bert350m.py $B350MAX --model bert350m \
  --set train.remat=dots --variant "remat=dots"
step jax_350m_b${B350MAX}_accum2 configs/bert350m.py $B350MAX --model bert350m \
  --set train.grad_accum_steps=2 --variant "grad_accum_steps=2"

# --- 4. A/B variants, while time remains -------------------------------------------------
if [ "$(left)" -gt 150 ]; then
  step jax_350m_b${B350}_hopperflags configs/bert350m.py $B350 --model bert350m \
    --xla-flags "$HOPPER_FLAGS" --variant "XLA_FLAGS=$HOPPER_FLAGS"
fi
if [ "$(left)" -gt 130 ]; then
  step jax_350m_b${B350}_rbg configs/bert350m.py $B350 --model bert350m \
    --set train.dropout_rng=rbg --variant "dropout_rng=rbg"
fi
if [ "$(left)" -gt 110 ]; then
  step jax_350m_b${B350}_biasmask configs/bert350m.py $B350 --model bert350m \
    --cudnn-mask bias --variant "cudnn mask as [B,1,S,S] bias (before)"
fi
if [ "$(left)" -gt 95 ]; then  # the manual path's one-buffer reduction (auto picks it on CPU)
  step jax_120m_b${B120}_flat configs/bert120m.py $B120 --model bert120m \
    --set train.grad_allreduce=flat --variant "grad_allreduce=flat"
fi

# --- 5. loader: input wait of a real run with data.autotune -------------------------------
if [ "$(left)" -gt 90 ]; then
  log "loader: generating a seq-$SEQ dataset and training 120M b$B120 with data.autotune"
  run loader_data 120 "$PY" - "$WORK/data" $SEQ $VOCAB <<'EOF'
import sys
from lmscale_jax.store.synthetic_dataset import write_synthetic_dataset
d, seq, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
write_synthetic_dataset(d, seq_len=seq, vocab_size=vocab, n_train=20000, n_val=512, shards=8)
print("dataset", d)
EOF
  run loader_train 240 "$PY" -m lmscale_jax.main --config=configs/bert120m.py \
    --workdir="$WORK/run_120m" --config.data.path="$WORK/data" --config.model.seq_len=0 \
    --config.train.batch_size=$B120 --config.train.steps=$TRAIN_STEPS \
    --config.train.log_every=$((TRAIN_STEPS / 3)) --config.train.eval_every=100000 \
    --config.train.eval_batches=1 \
    --config.train.warmup_steps=10 --config.checkpoint.every=100000 \
    --config.data.autotune=True --config.metrics.peak_tflops="$PEAK" \
    ${TRAIN120[@]+"${TRAIN120[@]}"}
  cp "$WORK"/run_120m/{metrics.jsonl,loader_autotune.json} "$OUT/logs/" 2>/dev/null
  [ -f "$WORK/run_120m/metrics.jsonl" ] && "$PY" - "$WORK/run_120m" "$RESULTS" "$GPU" $B120 $SEQ <<'EOF' || true
import json, os, sys
w, results, gpu, batch, seq = sys.argv[1:6]
rows = [json.loads(l) for l in open(os.path.join(w, "metrics.jsonl")) if '"loss"' in l]
tune = json.load(open(os.path.join(w, "loader_autotune.json")))
last = rows[-1]  # the first window includes compilation
row = {"system": "lmscale_jax_loader", "model": "bert120m", "batch": int(batch),
       "seq": int(seq), "samples_per_sec": last["samples_per_sec"], "mfu": last["mfu"],
       "peak_mem_gb": None, "device": gpu, "step_s": last["step_time"],
       "input_wait_frac": last["input_wait_frac"], "workers": tune["workers"],
       "autotune": tune, "variant": "real data, data.autotune"}
open(results, "a").write(json.dumps(row) + "\n")
print(f"loader: {tune['workers']} workers, input wait {100 * last['input_wait_frac']:.2f}% of "
      f"step time, {last['samples_per_sec']:.0f} samples/s")
EOF
fi

# --- 6. max batch on the GPU ---------------------------------------------------------------
if [ "$(left)" -gt 60 ]; then
  run max_batch_350m $(( $(left) > 200 ? 200 : $(left) )) "$PY" -m lmscale_jax.cli.lmscale \
    max-batch --config configs/bert350m.py --name bert350m --levers plain,remat_dots \
    --budget-gb $MAXB_BUDGET --seq $SEQ --vocab $VOCAB --json "$OUT/max_batch_gpu.jsonl" \
    ${SHAPE350[@]+"${SHAPE350[@]}"}
  sed -n '/^| model/,$p' "$OUT/logs/max_batch_350m.log"
fi

# --- 7. lmscale index on the GPU: the data-parallel embedding (function_vectors, NamedSharding
# over the local devices) of real system libraries, functions/s with the tests' tiny model, the
# same command as the CPU row of docs/performance.md "Search: speed and size" -------------------
if [ "$(left)" -gt 60 ]; then
  ELFS=$(ls /usr/lib/x86_64-linux-gnu/{libz.so.1,libbz2.so.1.0,libexpat.so.1,liblzma.so.5,libzstd.so.1,libsqlite3.so.0} 2>/dev/null || true)
  if [ -n "$ELFS" ]; then
    # shellcheck disable=SC2086  # one ELF path a word
    run index_throughput 150 "$PY" benchmarks/bench_search.py index --tiny-run "$WORK/tiny_run" \
      --elf $ELFS --out "$OUT/index_throughput.json"
  fi
fi

# --- 8. lmscale serve on the GPU: issue 56's batching goals, which a CPU cannot show (there a
# pass of 32 rows costs more a row than one of 8, so batching saves nothing at half load, and
# the model shares its core with HTTP): POST /api/embed of 1 and 8 texts, 50 clients and half
# load, beside lmscale embed's throughput on the same functions (OUTDIR/serve_batching.json);
# the tests' tiny model of step 7, an index of libz by it -------------------------------------
LIBZ=/usr/lib/x86_64-linux-gnu/libz.so.1
if [ "$(left)" -gt 120 ] && [ -d "$WORK/tiny_run/run" ] && [ -f "$LIBZ" ]; then
  run serve_index 90 "$PY" -m lmscale_jax.cli.lmscale index --workdir "$WORK/tiny_run/run" \
    --elf "$LIBZ" --output "$WORK/serve_index"
  run serve_batching 240 "$PY" benchmarks/bench_serve.py --workdir "$WORK/tiny_run/run" \
    --index "$WORK/serve_index" --elf "$LIBZ" --requests 0 --batch-texts 1 8 \
    --batch-functions 2000 --out "$OUT/serve_batching.json"
fi

# --- table --------------------------------------------------------------------------------
"$PY" benchmarks/bench_step.py --summarize "$RESULTS" --summary-json "$OUT/summary.json" \
  | tee "$OUT/summary.md"
# Few files come back from a device call: logs go into one archive.
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
log "done in $((SECONDS - START)) s; results: $RESULTS; logs: $OUT/logs.tgz"
