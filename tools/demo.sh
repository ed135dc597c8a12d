#!/usr/bin/env bash
# Sets everything up, builds a small dataset from this machine's own ELF binaries and pretrains
# configs/tiny.py on the CPU, then prints the loss curve next to the unigram baseline.
#   bash tools/demo.sh            (DEMO_DIR=demo, DEMO_MB=24 of ELF input, DEMO_STEPS=1500)
set -euo pipefail
source "$(dirname "$0")/_no_arguments.sh" "$0" "$@"  # --help, or no arguments at all
cd "$(dirname "$0")/.."
bash tools/setup.sh
dir=${DEMO_DIR:-demo}
steps=${DEMO_STEPS:-1500}
export JAX_PLATFORMS=cpu
if [ ! -f "$dir/data/metadata.json" ]; then
  .venv/bin/python tools/prepare_binary.py --input /usr/lib/x86_64-linux-gnu /usr/bin \
    --output "$dir/data" --seq-len 128 --vocab-size 4096 \
    --max-input-bytes $(( ${DEMO_MB:-24} * 1000000 )) --overwrite
fi
.venv/bin/python tools/inspect_shards.py "$dir/data" --verify
rm -rf "$dir/run"
.venv/bin/python -m lmscale_jax.main --config=configs/tiny.py --workdir="$dir/run" \
  --config.data.path="$dir/data" --config.train.steps="$steps"
.venv/bin/python - "$dir/run/metrics.jsonl" <<'EOF'
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
EOF
