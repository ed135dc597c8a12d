"""Will the network hold? Step time and efficiency of data-parallel training on 1…1024 nodes,
from one GPU's measured step time and the gradient, on a described cluster (the model and
every formula: lmscale_jax/study/cluster_model/step_time.py and the modules it names).

  lmscale scaling-model --step-time 0.129 --params 102949632 --network 25gbe
  lmscale scaling-model --config configs/bert350m.py --step-time 0.53 --per-device-batch 20 \\
      --network 25gbe --dtype float32 --nodes 1,2,16,128
  lmscale scaling-model --config configs/bert120m.py --step-times 92:0.07,184:0.129 \\
      --per-device-batch 92,184 --network hdr --nics 8 --gpus-per-node 8 --algorithm best
  lmscale scaling-model --workdir runs/x --calibration \\
      benchmarks/results/2026-12-01-cpu-allreduce.jsonl --gpus-per-node 1 --nodes 1,2

Prints what was given (and where each value came from), then per gradient dtype (and
per-device batch) and node count: the all-reduce time, and per overlap mode (none: reduce
after backward; bucketed: bucket by bucket as backward produces them; backward: the ideal
bound) the step time, the efficiency against one GPU and against one node, and the smallest
accumulation count k that keeps the efficiency >= --target; last the recommended k and dtype.
--json prints the same as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys

from lmscale_jax.cli import args
from lmscale_jax.cli import scaling_inputs as inp
from lmscale_jax.study.cluster_model import links, validation
from lmscale_jax.study.cluster_model import overlap as ov
from lmscale_jax.study.cluster_model import step_time as cm


def parser() -> args.Parser:
  p = args.Parser(prog="lmscale scaling-model",
                  description=__doc__.split("\n\n")[0].replace("\n", " "),
                  formatter_class=argparse.RawDescriptionHelpFormatter,
                  epilog="Presets (line rate per direction of one NIC, one-way latency): "
                  + "; ".join(f"{k}: {v.describe()}" for k, v in links.PRESETS.items())
                  + ". Transports: " + "; ".join(
                      f"{k}: {v.source}" for k, v in links.TRANSPORTS.items())
                  + f". Intra-node default: {links.NVLINK_BRIDGE.describe()}.")
  inp.add_compute_flags(p.add_argument_group("what one GPU does (step time and gradient)"))
  inp.add_cluster_flags(p.add_argument_group("the cluster"))
  run = p.add_argument_group("the run")
  run.add_argument("--dtype", type=inp.csv(str, tuple(cm.GRAD_BYTES), "dtype"),
                   default=["float32", "bfloat16"],
                   help=f"gradient dtypes, any of {','.join(cm.GRAD_BYTES)} (default "
                   "float32,bfloat16)")
  run.add_argument("--overlap", type=inp.csv(str, ov.OVERLAPS, "overlap"),
                   default=list(ov.OVERLAPS),
                   help="none (reduce after backward), bucketed (bucket by bucket during the "
                   "last microbatch's backward), backward (ideal: all of it may start at the "
                   "first backward FLOP)")
  run.add_argument("--bucket-mib", type=inp.positive("bucket size"), default=25.0,
                   help="bucket size for --overlap bucketed, MiB (default 25: PyTorch DDP's "
                   "bucket_cap_mb; Horovod's fusion buffer is 64)")
  run.add_argument("--accum-steps", type=inp.accumulation, default={1: 1},
                   help="k microbatches per step: one k, or per node count, e.g. 1:1,16:2,64:4 "
                   "(each node count takes the k of the largest listed count <= it)")
  run.add_argument("--target", type=inp.positive("target"), default=0.95,
                   help="efficiency the recommended k must keep (default 0.95)")
  run.add_argument("--nodes", type=inp.csv(int, what="node counts"),
                   default=list(cm.DEFAULT_NODES), help="node counts (1,2,4,…,1024)")
  p.add_argument("--validate", metavar="TABLES.json", help="instead: the model against "
                 "published multi-node tables (benchmarks/published/multinode_tables.json), "
                 "predicted vs published with the ratio")
  p.add_argument("--json", action="store_true", help="one JSON object instead of tables")
  return p


def render_validation(result: dict) -> str:
  lines = [f"the model against {result['file']} (given one node's published throughput, it "
           "predicts the other rows; ratio = predicted / published)", "",
           "| source | nodes | GPUs | k | what | published | predicted | ratio | at line rate |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in result["rows"]:
    lines.append(f"| {r['source']} | {r['nodes']} | {r['gpus']} | {r['k']} | {r['what']} | "
                 f"{r['published']:,.4g} | {r['predicted']:,.4g} | {r['ratio']:.3f}"
                 f"{'' if r['within_tolerance'] else ' (!)'} | {r['ratio_at_line_rate']:.3f} |")
  lines += [""] + [f"(!) {r['source']} at {r['nodes']} nodes: {r['stated_error']}"
                   for r in result["rows"] if r["stated_error"]]
  lines += [f"not validated: {s['source']}: {s['why']}" for s in result["skipped"]]
  return "\n".join(lines)


def ms(x: float) -> str:
  return f"{x * 1e3:.1f}" if x < 10 else f"{x * 1e3:.0f}"


def render(result: dict, overlaps) -> str:
  lines = [f"given: {g}" for g in result["given"]]
  for part in result["batches"]:
    lines += table(part, overlaps)
  return "\n".join(lines)


def table(result: dict, overlaps) -> list[str]:
  rows, b = result["rows"], result["per_device_batch"]
  lines = []
  for dtype in dict.fromkeys(r["dtype"] for r in rows):
    mine = [r for r in rows if r["dtype"] == dtype]
    lines += ["", f"{dtype} gradients, {mine[0]['grad_bytes'] / 1e6:,.1f} MB"
              + (f", per-device batch {b}" if b else "")
              + f": step {result['step_time_s'] * 1e3:.1f} ms on one GPU (eff = against one "
              "GPU at the same k; vs node = per-GPU throughput against 1 node)", ""]
    head = "| nodes | GPUs | k | all-reduce ms | wait ms |"
    for o in overlaps:
      head += f" step ms ({o}) | eff ({o}) | vs node ({o}) | k for {result['target']:.0%} ({o}) |"
    lines += [head, "|" + "---|" * (5 + 4 * len(overlaps))]
    for n in dict.fromkeys(r["nodes"] for r in mine):
      cells = {r["overlap"]: r for r in mine if r["nodes"] == n}
      first = cells[overlaps[0]]
      line = (f"| {n} | {first['gpus']} | {first['k']} | {ms(cells.get('none', first)['comm_s'])}"
              f" | {ms(first['straggler_s'])} |")
      for o in overlaps:
        r = cells[o]
        kk = r["k_for_target"] if r["k_for_target"] else f"> {cm.K_MAX}"
        line += (f" {ms(r['step_s'])} | {r['efficiency']:.1%} | {r['efficiency_vs_node']:.1%}"
                 f" | {kk} |")
      lines.append(line)
  return lines + recommendations(result, overlaps)


def recommendations(result: dict, overlaps) -> list[str]:
  lines = ["", f"recommended (smallest k with efficiency >= {result['target']:.0%}; float32 "
           "on a tie):", "", "| nodes |" + "".join(f" {o}: k, dtype |" for o in overlaps),
           "|---|" + "---|" * len(overlaps)]
  rec = result["recommendations"]
  for n in dict.fromkeys(r["nodes"] for r in rec):
    cells = [next(r for r in rec if r["nodes"] == n and r["overlap"] == o) for o in overlaps]
    lines.append(f"| {n} |" + "".join(
        f" {r['k']}, {r['dtype']}{batch(r)} |" if r["k"] else f" none <= {cm.K_MAX} |"
        for r in cells))
  return lines


def batch(rec: dict) -> str:
  return f" (global batch {rec['global_batch']:,})" if rec.get("global_batch") else ""


def run(a) -> dict:
  given = inp.inputs(a)
  cluster, cluster_given = inp.cluster(a)
  parts = []
  for b in a.per_device_batch or [0]:
    c = inp.compute_at(given, b)
    parts.append(cm.predict(c, given["params"], cluster, nodes=a.nodes, dtypes=tuple(a.dtype),
                            overlaps=tuple(a.overlap), k=a.accum_steps, target=a.target,
                            per_device_batch=b, bucket_bytes=a.bucket_mib * 2 ** 20))
  return {"given": given["given"] + cluster_given + inp.run_given(a), "params": given["params"],
          "warnings": inp.batch_warnings(given, a.per_device_batch), "batches": parts}


def main(argv=None) -> int:
  a = parser().parse_args(argv)

  def go() -> int:
    if a.validate:
      result = validation.validate(a.validate)
      print(json.dumps(result, indent=1) if a.json else render_validation(result))
      return 0
    result = run(a)
    for warning in result["warnings"]:
      print(f"warning: {warning}", file=sys.stderr)
    print(json.dumps(result, indent=1) if a.json else render(result, a.overlap))
    return 0

  return args.guarded(go, "nothing was written")


if __name__ == "__main__":
  sys.exit(main())
