"""Training-step throughput of lmscale_jax on synthetic batches, and the matmul peak.

  python benchmarks/bench_step.py --config configs/bert120m.py --batch 184 --peak-tflops 790
  python benchmarks/bench_step.py --config configs/bert350m.py --batch 128 --set train.remat=dots
  python benchmarks/bench_step.py --matmul                       # bf16 8192^3 matmul TFLOP/s

The step is the real one (``mlm.build_steps``: the same jitted, donated, sharded function
``train_and_evaluate`` runs) on synthetic batches, so the loader is measured separately
(benchmarks/bench_loader.py, and the input-wait fraction of a real run): random token ids
(no padding, like the peer's all-ones attention mask) with ``P = ceil(0.15 * seq)`` distinct
predicted positions per row. The loop dispatches ``--steps`` steps without fetching anything
(as the training loop does) and blocks once at the end.

Prints one JSON object (and appends it to ``--jsonl``): ``system``, ``model``, ``batch``,
``seq``, ``samples_per_sec``, ``mfu`` (useful FLOPs, lmscale_jax/model/flops.py, over
``--peak-tflops``, else the device table), ``peak_mem_gb`` (the allocator's peak,
``device.memory_stats()``; null where the backend has none, e.g. CPU), ``compiled_peak_gb``
(``memory_analysis()``), ``device``, ``step_s``, ``variant``, the levers, XLA_FLAGS.

``--profile DIR`` records a ``jax.profiler`` trace of 3 more steps and adds ``top_ops``: the
device operations with the most total time, from the trace's Perfetto JSON.
``--xla-flags`` sets XLA_FLAGS (before jax starts) for A/B runs of compiler flags.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import sys
import time
from lmscale_jax.cli import args as cli_args  # one line and exit 1 for a bad argument

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse_args(argv=None):
  ap = cli_args.Parser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--config", default="configs/bert120m.py")
  ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                  help="config override, e.g. train.remat=dots (repeatable)")
  ap.add_argument("--batch", type=int, default=0, help="global batch (default: the config's)")
  ap.add_argument("--seq", type=int, default=512)
  ap.add_argument("--vocab", type=int, default=22016, help="the peer's default vocabulary")
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--peak-tflops", type=float, default=0.0,
                  help="per-device peak for MFU (measured matmul peak); 0 = device table")
  ap.add_argument("--model", help="model label (default: the config's stem)")
  ap.add_argument("--system", default="lmscale_jax")
  ap.add_argument("--variant", default="", help="free-form label of this measurement")
  ap.add_argument("--cudnn-mask", choices=["lengths", "bias"], default="lengths",
                  help="how the cuDNN attention masks padding (model.CUDNN_MASKS)")
  ap.add_argument("--xla-flags", default=None, help="XLA_FLAGS for this process")
  ap.add_argument("--profile", help="write a jax.profiler trace here; report top device ops")
  ap.add_argument("--matmul", action="store_true", help="measure the bf16 matmul peak instead")
  ap.add_argument("--size", type=int, default=8192, help="--matmul: n of the n^3 product")
  ap.add_argument("--peer", choices=["bf16", "fp32", "compile"],
                  help="run the Hugging Face peer (--peer-script) at this config's shape instead")
  ap.add_argument("--peer-script", default=os.path.join(ROOT, ".gpu", "peer_hf_bert.py"))
  ap.add_argument("--peer-device", default="cuda", help="the peer's torch device")
  ap.add_argument("--device-label", default="", help="device field of a peer row "
                  "(default: nvidia-smi's GPU name); the peer process must not start jax")
  ap.add_argument("--summarize", metavar="JSONL",
                  help="print the comparison table of a results file (and --summary-json)")
  ap.add_argument("--summary-json", help="with --summarize: write the table as JSON here")
  ap.add_argument("--jsonl", help="append the JSON object to this file")
  return ap.parse_args(argv)


def device_description(jax) -> str:
  d = jax.devices()[0]
  return f"{jax.default_backend()}: {d.device_kind} x {jax.device_count()}"


def peak_memory_gb(jax):
  stats = jax.devices()[0].memory_stats() or {}
  peak = stats.get("peak_bytes_in_use")
  return None if peak is None else peak / 2**30


def matmul_peak(args) -> dict:
  """bf16 n^3 matmul TFLOP/s: random inputs (never zeros), 3 warm-ups, median of 10 timed
  products, rotating over 3 input pairs so no product reuses a cached operand."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  n = args.size
  keys = jax.random.split(jax.random.key(0), 6)
  xs = [jax.random.normal(k, (n, n), jnp.bfloat16) for k in keys]
  f = jax.jit(lambda a, b: a @ b)
  pairs = [(xs[0], xs[1]), (xs[2], xs[3]), (xs[4], xs[5])]
  for a, b in pairs:
    f(a, b).block_until_ready()
  times = []
  for i in range(10):
    a, b = pairs[i % 3]
    t0 = time.perf_counter()
    f(a, b).block_until_ready()
    times.append(time.perf_counter() - t0)
  t = float(np.median(times))
  return {"system": "matmul_bf16", "n": n, "tflops": 2 * n**3 / t / 1e12, "seconds": t,
          "device": device_description(jax)}


def synthetic_batch(rng, batch: int, seq: int, predictions: int, vocab: int, first_id: int):
  import numpy as np

  ids = rng.integers(first_id, vocab, (batch, seq), dtype=np.int32)
  pos = np.sort(np.argsort(rng.random((batch, seq)), axis=1)[:, :predictions], axis=1)
  labels = np.take_along_axis(ids, pos, axis=1)
  return {"input_ids": ids, "mlm_positions": pos.astype(np.int32),
          "mlm_labels": labels.astype(np.int32),
          "mlm_weights": np.ones((batch, predictions), np.float32)}


def summarize_trace(directory: str, top: int = 15) -> list[dict]:
  """Total time per operation name in the newest Perfetto trace under ``directory``.

  Counts complete events ("ph" == "X") of the device threads when the trace has any
  (process "/device:…" or thread "Stream…"), else of every thread but Python frames (CPU).
  """
  paths = sorted(glob.glob(os.path.join(directory, "**", "*.trace.json.gz"), recursive=True),
                 key=os.path.getmtime)
  if not paths:
    return []
  with gzip.open(paths[-1], "rt") as f:
    trace = json.load(f)
  events = trace.get("traceEvents", trace if isinstance(trace, list) else [])
  names = {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
      names[(e.get("pid"), e.get("tid") if e["name"] == "thread_name" else None)] = (
          e.get("args", {}).get("name", ""))
  def is_device(e):
    pname = names.get((e.get("pid"), None), "")
    tname = names.get((e.get("pid"), e.get("tid")), "")
    return "/device:" in pname or "Stream" in tname
  complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
  device = [e for e in complete if is_device(e)]
  # CPU runs have no device threads: every thread, less the Python tracer's own frames.
  chosen = device or [e for e in complete if not str(e.get("name", "")).startswith("$")]
  totals: dict[str, list] = {}
  for e in chosen:
    t = totals.setdefault(e.get("name", "?"), [0.0, 0])
    t[0] += float(e["dur"])
    t[1] += 1
  all_us = sum(v[0] for v in totals.values()) or 1.0
  ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
  return [{"name": k, "total_ms": v[0] / 1e3, "count": v[1], "share": v[0] / all_us,
           "device_events": bool(device)} for k, v in ranked]


def step_benchmark(args) -> dict:
  import jax
  import numpy as np

  from lmscale_jax.model import bert as model_lib
  from lmscale_jax.model import flops as flops_lib
  from lmscale_jax.store import dataset
  from lmscale_jax.pretrain import mlm
  from lmscale_jax.pretrain import trainer
  from lmscale_jax.config import loader

  config = loader.load(args.config, sets=args.set, root=ROOT)
  config.model.vocab_size = config.model.seq_len = 0  # from the synthetic metadata
  if args.batch:
    config.train.batch_size = args.batch
  meta = dataset.DatasetMeta.synthetic(args.seq, args.vocab)
  s = trainer.build_setup(config, meta)
  s.model_cfg.cudnn_mask = args.cudnn_mask
  st = mlm.build_steps(config, s.model_cfg, s.predictions)
  t = config.train
  rng = np.random.default_rng(0)
  first_id = len(meta.special_ids)
  host = [synthetic_batch(rng, t.batch_size, args.seq, s.predictions, args.vocab, first_id)
          for _ in range(2)]
  batches = [jax.tree.map(lambda x: jax.make_array_from_process_local_data(st.batch_sharding,
                                                                            x), h) for h in host]
  abstract_b = flops_lib.abstract_batch(t.batch_size, args.seq, s.predictions, st.batch_sharding)
  t0 = time.perf_counter()
  compiled = st.train_step.lower(st.abstract_state, abstract_b).compile()
  compile_s = time.perf_counter() - t0
  compiled_peak = flops_lib.peak_bytes(compiled.memory_analysis()) / 2**30
  state = st.init(jax.random.key(t.seed))
  for i in range(args.warmup):
    state, m = compiled(state, batches[i % 2])
  jax.block_until_ready((state, m))
  t0 = time.perf_counter()
  for i in range(args.steps):
    state, m = compiled(state, batches[i % 2])
  jax.block_until_ready((state, m))
  dt = (time.perf_counter() - t0) / args.steps
  loss = float(m["loss"])
  top_ops = None
  if args.profile:
    os.makedirs(args.profile, exist_ok=True)
    with jax.profiler.trace(args.profile, create_perfetto_trace=True):
      for i in range(3):
        state, m = compiled(state, batches[i % 2])
      jax.block_until_ready((state, m))
    top_ops = summarize_trace(args.profile)
  peak = flops_lib.device_peak_flops(jax.devices()[0].device_kind, args.peak_tflops,
                                     dtype=s.model_cfg.dtype)
  achieved = s.flops_per_step / dt
  name = args.model or os.path.splitext(os.path.basename(args.config))[0]
  return {
      "system": args.system, "model": name, "batch": t.batch_size, "seq": args.seq,
      "samples_per_sec": t.batch_size / dt, "mfu": achieved / (peak * jax.device_count())
      if peak else None, "peak_mem_gb": peak_memory_gb(jax), "device": device_description(jax),
      "step_s": dt, "tokens_per_sec": t.batch_size * args.seq / dt,
      "model_tflops": achieved / 1e12, "peak_tflops": peak / 1e12 if peak else None,
      "compiled_peak_gb": compiled_peak, "compile_s": compile_s, "loss": loss,
      "params": s.param_count, "vocab": args.vocab, "predictions": s.predictions,
      "variant": args.variant, "dtype": s.model_cfg.dtype,
      "attention": model_lib.attention_impl(s.model_cfg, deterministic=False),
      "cudnn_mask": args.cudnn_mask, "remat": t.remat, "grad_accum_steps": t.grad_accum_steps,
      "fsdp": bool(t.fsdp), "grad_allreduce_dtype": t.grad_allreduce_dtype,
      "dropout": s.model_cfg.dropout, "dropout_rng": t.dropout_rng,
      "xla_flags": os.environ.get("XLA_FLAGS", ""), "jax": jax.__version__,
      **({"top_ops": top_ops} if top_ops is not None else {}),
  }


def config_shape(args) -> dict:
  """layers/hidden/heads/ffn/batch of ``--config`` + ``--set`` (no jax needed)."""
  from lmscale_jax.config import loader

  c = loader.load(args.config, sets=args.set, root=ROOT)
  m = c.model
  return {"layers": m.layers, "hidden": m.hidden, "heads": m.heads, "ffn": m.ffn,
          "batch": args.batch or c.train.batch_size}


def gpu_name() -> str:
  import subprocess

  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30)
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else "?"
  except (OSError, subprocess.TimeoutExpired):
    return "?"


def run_peer(args) -> dict:
  """The peer (``peer_hf_bert.py``) at this config's shape, as a row of our schema. Its MFU
  uses its own FLOP count (the same terms; 0.15·S predictions instead of ceil) over the same
  ``--peak-tflops``."""
  import subprocess

  shape = config_shape(args)
  cmd = [sys.executable, args.peer_script, "--layers", str(shape["layers"]), "--hidden",
         str(shape["hidden"]), "--heads", str(shape["heads"]), "--ffn", str(shape["ffn"]),
         "--batch", str(shape["batch"]), "--seq", str(args.seq), "--vocab", str(args.vocab),
         "--mode", args.peer, "--device", args.peer_device,
         "--steps", str(args.steps), "--warmup", str(args.warmup)]
  r = subprocess.run(cmd, capture_output=True, text=True)
  if r.returncode:
    raise SystemExit(f"peer failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-3000:]}")
  peer = json.loads(r.stdout.strip().splitlines()[-1])
  peak = args.peak_tflops or None
  return {"system": f"hf_{args.peer}", "model": args.model or os.path.splitext(
              os.path.basename(args.config))[0],
          "batch": peer["batch"], "seq": peer["seq"], "samples_per_sec": peer["samples_s"],
          "mfu": peer["model_tflops"] / peak if peak else None,
          "peak_mem_gb": peer.get("peak_mem_gb"),
          "device": args.device_label or (gpu_name() if args.peer_device == "cuda" else
                                          args.peer_device),
          "step_s": peer["step_s"], "model_tflops": peer["model_tflops"], "peak_tflops": peak,
          "variant": args.variant, "peer": peer}


def summarize(path: str) -> tuple[str, dict]:
  """Markdown table of a results file + speed-ups of lmscale_jax over the peers at the same
  (model, batch) and over the paper's recipe (hf_fp32, any batch) per model."""
  rows = [json.loads(l) for l in open(path) if l.strip()]
  steps = [r for r in rows if "samples_per_sec" in r]
  peak = next((r for r in rows if r.get("system") == "matmul_bf16"), None)
  lines = []
  if peak:
    lines.append(f"bf16 matmul peak: {peak['tflops']:.0f} TFLOP/s ({peak['device']})")
  lines += ["| system | model | batch | variant | samples/s | MFU | peak mem GB | step ms |",
            "|---|---|---|---|---|---|---|---|"]
  fmt = lambda v, f: "-" if v is None else format(v, f)
  for r in steps:
    lines.append(f"| {r['system']} | {r['model']} | {r['batch']} | {r.get('variant') or ''} | "
                 f"{r['samples_per_sec']:.1f} | {fmt(r.get('mfu'), '.1%')} | "
                 f"{fmt(r.get('peak_mem_gb'), '.1f')} | {1e3 * r['step_s']:.1f} |")
  ratios = []
  ours = [r for r in steps if r["system"] == "lmscale_jax" and not r.get("variant")]
  for r in ours:
    for peer in steps:
      if peer["system"].startswith("hf_") and peer["model"] == r["model"] and (
          peer["batch"] == r["batch"] or peer["system"] == "hf_fp32"):
        ratios.append({"model": r["model"], "batch": r["batch"], "vs": peer["system"],
                       "vs_batch": peer["batch"],
                       "speedup": r["samples_per_sec"] / peer["samples_per_sec"]})
  if ratios:
    lines += ["", "| model | lmscale_jax batch | vs | their batch | speed-up |",
              "|---|---|---|---|---|"]
    lines += [f"| {x['model']} | {x['batch']} | {x['vs']} | {x['vs_batch']} | "
              f"{x['speedup']:.2f}x |" for x in ratios]
  return "\n".join(lines), {"matmul_peak": peak, "rows": steps, "speedups": ratios}


def main(argv=None):
  args = parse_args(argv)
  if args.xla_flags is not None:
    os.environ["XLA_FLAGS"] = args.xla_flags  # before jax initialises its backend
  if args.summarize:
    text, summary = summarize(args.summarize)
    print(text)
    if args.summary_json:
      with open(args.summary_json, "w") as f:
        json.dump(summary, f, indent=2)
    return
  if args.peer:
    result = run_peer(args)
  else:
    result = matmul_peak(args) if args.matmul else step_benchmark(args)
  line = json.dumps(result)
  print(line, flush=True)
  if args.jsonl:
    with open(args.jsonl, "a") as f:
      f.write(line + "\n")


if __name__ == "__main__":
  main()
