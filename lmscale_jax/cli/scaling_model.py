"""Will the network hold? Step time and weak-scaling efficiency of data-parallel training on
1…1024 nodes, from one GPU's measured step time and the gradient size (α–β model:
lmscale_jax/study/cluster_model.py, whose docstring states every formula and what is left out).

  lmscale scaling-model --step-time 0.129 --params 102949632 --network 25gbe
  lmscale scaling-model --config configs/bert350m.py --step-time 0.140 --network hdr
  lmscale scaling-model --workdir runs/x --calibration \\
      benchmarks/results/2026-12-01-cpu-allreduce.jsonl --gpus-per-node 1 --nodes 1,2

Prints the gradient bytes per dtype, then per dtype and node count the all-reduce time, the
step time and efficiency without and with overlap of the reduction with backward compute, and
the smallest accumulation count k that keeps the efficiency >= --target; last the recommended
k and dtype per node count. --json prints the same as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from lmscale_jax.cli import args
from lmscale_jax.study import cluster_model as cm


def positive(what: str, kind=float):
  def parse(text: str):
    try:
      value = kind(text)
    except ValueError:
      value = None
    if value is None or not (math.isfinite(value) and value > 0):
      raise argparse.ArgumentTypeError(f"{what} {text!r}: expected a positive "
                                       f"{'integer' if kind is int else 'number'}")
    return value
  return parse


def non_negative(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    value = -1.0
  if not (math.isfinite(value) and value >= 0):
    raise argparse.ArgumentTypeError(f"latency {text!r}: expected a number >= 0 (microseconds)")
  return value


def network(text: str) -> cm.Link:
  try:
    return cm.preset(text)
  except cm.ModelError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


def csv(kind, allowed=None, what="value"):
  def parse(text: str):
    items = [x.strip() for x in text.split(",") if x.strip()]
    try:
      values = [kind(x) for x in items]
    except ValueError:
      values = []
    bad = [v for v in values if (allowed is not None and v not in allowed)
           or (kind is int and v < 1)]
    if not values or bad:
      expected = f"one or more of {', '.join(allowed)}" if allowed else "positive integers"
      raise argparse.ArgumentTypeError(f"{what} {text!r}: expected comma-separated {expected}")
    return values
  return parse


def parser() -> args.Parser:
  p = args.Parser(prog="lmscale scaling-model",
                  description=__doc__.split("\n\n")[0].replace("\n", " "),
                  formatter_class=argparse.RawDescriptionHelpFormatter,
                  epilog="Presets (line rate per direction, one-way latency): " + "; ".join(
                      f"{k}: {v.describe()}" for k, v in cm.PRESETS.items())
                  + f". Intra-node default: {cm.NVLINK_BRIDGE.describe()}.")
  src = p.add_argument_group("what one GPU does (step time and gradient)")
  src.add_argument("--step-time", type=positive("step time"), metavar="S",
                   help="seconds of one training step on one GPU, no communication")
  src.add_argument("--params", type=positive("parameter count", int), metavar="N",
                   help="gradient elements (the model's parameter count)")
  src.add_argument("--grad-mb", type=positive("gradient size"), metavar="MB",
                   help="float32 gradient size in MB (instead of --params)")
  src.add_argument("--config", metavar="configs/X.py",
                   help="count the parameters of this config's model")
  src.add_argument("--vocab-size", type=positive("vocab size", int), default=8192,
                   help="with --config: the vocabulary (the configs take it from the dataset; "
                   "default 8192, lmscale prepare binary's)")
  src.add_argument("--seq-len", type=positive("seq len", int), default=512,
                   help="with --config, if the config leaves it to the dataset (default 512)")
  src.add_argument("--workdir", metavar="DIR", help="a run's workdir: step time from its "
                   "metrics.jsonl (median after the first window), parameters from config.json")
  src.add_argument("--per-device-batch", type=positive("batch", int), default=0,
                   help="sequences per GPU per microbatch (only to print the global batch)")
  net = p.add_argument_group("the cluster")
  net.add_argument("--network", type=network, default=cm.PRESETS["25gbe"],
                   help=f"preset: {', '.join(cm.PRESETS)} (default 25gbe)")
  net.add_argument("--bandwidth-gbit", type=positive("bandwidth"), metavar="GBIT_S",
                   help="network link, Gbit/s per direction (overrides the preset's)")
  net.add_argument("--latency-us", type=non_negative, metavar="US",
                   help="network latency per message, microseconds (overrides the preset's)")
  net.add_argument("--calibration", metavar="FILE", help="use the α, β fitted by "
                   "benchmarks/bench_allreduce.py as the network link")
  net.add_argument("--calibration-fit", default="all",
                   help="which fit of that file: all (default) or a process count")
  net.add_argument("--gpus-per-node", type=positive("GPUs per node", int), default=2)
  net.add_argument("--intra-gbyte", type=positive("intra-node bandwidth"), metavar="GB_S",
                   default=cm.NVLINK_BRIDGE.bandwidth / 1e9,
                   help="intra-node link, GB/s per direction (default 300: NVLink bridge)")
  net.add_argument("--intra-latency-us", type=non_negative, metavar="US",
                   default=cm.NVLINK_BRIDGE.latency * 1e6)
  net.add_argument("--scheme", choices=cm.SCHEMES, default="flat",
                   help="flat ring over all GPUs, or hierarchical (intra-node reduce, "
                   "inter-node ring, broadcast)")
  run = p.add_argument_group("the run")
  run.add_argument("--dtype", type=csv(str, tuple(cm.GRAD_BYTES), "dtype"),
                   default=["float32", "bfloat16"], help="gradient dtypes (float32,bfloat16)")
  run.add_argument("--overlap", type=csv(str, cm.OVERLAPS, "overlap"), default=list(cm.OVERLAPS),
                   help="none (reduce after backward) and/or backward (during the last "
                   "microbatch's backward pass)")
  run.add_argument("--accum-steps", type=positive("accumulation steps", int), default=1,
                   help="k microbatches per step for the step/efficiency columns")
  run.add_argument("--target", type=positive("target"), default=0.95,
                   help="efficiency the recommended k must keep (default 0.95)")
  run.add_argument("--nodes", type=csv(int, what="node counts"),
                   default=list(cm.DEFAULT_NODES), help="node counts (1,2,4,…,1024)")
  p.add_argument("--json", action="store_true", help="one JSON object instead of tables")
  return p


def inputs(a) -> dict:
  """Step time and parameter count from the flags (each source checked)."""
  sources = [x for x in ("params", "grad_mb", "config", "workdir") if getattr(a, x)]
  if len(sources) != 1:
    raise cm.ModelError("give exactly one of --params, --grad-mb, --config, --workdir "
                        f"(got {', '.join('--' + s.replace('_', '-') for s in sources) or 'none'})")
  if a.workdir:
    out = cm.workdir_step(a.workdir)
    if a.step_time:
      out["step_time_s"] = a.step_time
    out["source"] = f"workdir {a.workdir} ({out['windows']} windows)"
    return out
  if not a.step_time:
    raise cm.ModelError("--step-time is required with --params, --grad-mb or --config (or "
                        "give --workdir)")
  if a.config:
    params = config_params(a.config, a.vocab_size, a.seq_len)
    return {"step_time_s": a.step_time, "params": params, "source": f"config {a.config}"}
  params = a.params or int(round(a.grad_mb * 1e6 / 4))
  return {"step_time_s": a.step_time, "params": params, "source": "flags"}


def config_params(path: str, vocab_size: int, seq_len: int) -> int:
  import importlib.util

  from lmscale_jax.model import flops

  if not os.path.isfile(path):
    raise cm.ModelError(f"--config {path}: no such file")
  spec = importlib.util.spec_from_file_location("_scaling_config", path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
    model = module.get_config().model
  except Exception as e:  # a config file is the user's code: any failure is theirs
    raise cm.ModelError(f"--config {path}: does not load ({type(e).__name__}: {e})") from None
  model.vocab_size = model.vocab_size or vocab_size
  model.seq_len = model.seq_len or seq_len
  return flops.count_params_from_config(model)


def cluster(a) -> cm.Cluster:
  inter = a.network
  if a.calibration:
    inter = cm.load_calibration(a.calibration, a.calibration_fit)
  if a.bandwidth_gbit or a.latency_us is not None:
    inter = cm.link(f"{inter.name}, overridden",
                    a.bandwidth_gbit * 1e9 / 8 if a.bandwidth_gbit else inter.bandwidth,
                    a.latency_us * 1e-6 if a.latency_us is not None else inter.latency)
  intra = cm.link("intra-node", a.intra_gbyte * 1e9, a.intra_latency_us * 1e-6)
  if (intra.bandwidth, intra.latency) == (cm.NVLINK_BRIDGE.bandwidth, cm.NVLINK_BRIDGE.latency):
    intra = cm.NVLINK_BRIDGE
  return cm.Cluster(inter=inter, intra=intra, gpus_per_node=a.gpus_per_node, scheme=a.scheme)


def ms(x: float) -> str:
  return f"{x * 1e3:.1f}" if x < 10 else f"{x * 1e3:.0f}"


def render(result: dict, source: str, overlaps) -> str:
  c = result["cluster"]
  inter, intra = cm.Link(**c["inter"]), cm.Link(**c["intra"])
  rows = result["rows"]
  lines = [f"input: {source}: step {result['step_time_s'] * 1e3:.1f} ms on one GPU, "
           f"{result['params']:,} parameters",
           f"cluster: {c['gpus_per_node']} GPU(s)/node, {c['scheme']} all-reduce; network "
           f"{inter.describe()}; intra-node: {intra.describe()}"]
  k = rows[0]["k"]
  for dtype in dict.fromkeys(r["dtype"] for r in rows):
    mine = [r for r in rows if r["dtype"] == dtype]
    lines += ["", f"{dtype} gradients: {mine[0]['grad_bytes'] / 1e6:,.1f} MB per step "
              f"(k = {k}; efficiency = throughput / (GPUs x one GPU's))", ""]
    head = "| nodes | GPUs | all-reduce ms |"
    for o in overlaps:
      head += f" step ms ({o}) | eff ({o}) | k for {result['target']:.0%} ({o}) |"
    lines += [head, "|" + "---|" * (3 + 3 * len(overlaps))]
    for n in dict.fromkeys(r["nodes"] for r in mine):
      cells = [r for r in mine if r["nodes"] == n]
      line = f"| {n} | {cells[0]['gpus']} | {ms(cells[0]['comm_s'])} |"
      for o in overlaps:
        r = next(x for x in cells if x["overlap"] == o)
        kk = r["k_for_target"] if r["k_for_target"] else "> 1024"
        line += f" {ms(r['step_s'])} | {r['efficiency']:.1%} | {kk} |"
      lines.append(line)
  lines += ["", f"recommended (smallest k with efficiency >= {result['target']:.0%}; "
            "float32 on a tie):", "", "| nodes |" + "".join(f" {o}: k, dtype |" for o in overlaps),
            "|---|" + "---|" * len(overlaps)]
  rec = result["recommendations"]
  for n in dict.fromkeys(r["nodes"] for r in rec):
    cells = [next(r for r in rec if r["nodes"] == n and r["overlap"] == o) for o in overlaps]
    lines.append(f"| {n} |" + "".join(
        f" {r['k']}, {r['dtype']}{batch(r)} |" if r["k"] else " none <= 1024 |"
        for r in cells))
  return "\n".join(lines)


def batch(rec: dict) -> str:
  return f" (global batch {rec['global_batch']:,})" if rec.get("global_batch") else ""


def main(argv=None) -> int:
  a = parser().parse_args(argv)

  def go() -> int:
    given = inputs(a)
    result = cm.predict(given["step_time_s"], given["params"], cluster(a), nodes=a.nodes,
                        dtypes=tuple(a.dtype), overlaps=tuple(a.overlap), k=a.accum_steps,
                        target=a.target, per_device_batch=a.per_device_batch)
    result["source"] = given["source"]
    print(json.dumps(result, indent=1) if a.json else render(result, given["source"],
                                                                a.overlap))
    return 0

  return args.guarded(go, "nothing was written")


if __name__ == "__main__":
  sys.exit(main())
