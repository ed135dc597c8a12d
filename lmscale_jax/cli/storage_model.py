"""Shared file system or node-local staging? What N training nodes ask of shared storage, from
the real loader's measured reads, against staging the dataset to every node once (model and
its assumptions: lmscale_jax/study/storage_model.py).

  lmscale storage-model --measure data/bin  # measure the loader, then the model
  lmscale storage-model --step-time 0.129 --per-gpu-batch 184 --fs-gbyte 20

--measure DATASET reads --batches batches through
lmscale_jax.input.grain_pipeline.make_batch_loader, counts bytes, read calls and opens with the
kernel's counters (/proc/self/io, /proc/self/fd) and appends one line to
benchmarks/results/<date>-cpu-loader-io.jsonl. Without it the model uses the last line of
--io-file. Defaults: the H200 BERT-base anchor (0.129 s/step at 184
sequences per GPU), 2 GPUs per node and 25 GbE (the paper's TX-GAIN nodes), a 25 GB dataset
in 64 MB shards (the paper's preprocessed size), and an assumed mid-size Lustre (20 GB/s
aggregate, 200,000 small reads/s, 20,000 opens/s): give your file system's numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys

from lmscale_jax.cli import args
from lmscale_jax.cli.scaling_inputs import csv, positive
from lmscale_jax.cli.scaling_inputs import network_preset as network
from lmscale_jax.study.cluster_model import links
from lmscale_jax.study import storage_model as sm

# The checkout (benchmarks/results is there): lmscale_jax/cli/ is two levels below it.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
IO_FILE = os.path.join(RESULTS, "2026-12-01-cpu-loader-io.jsonl")
STAGE_FILE = os.path.join(RESULTS, "2026-11-30-cpu-stage.jsonl")


def parser() -> args.Parser:
  p = args.Parser(prog="lmscale storage-model",
                  description=__doc__.split("\n\n")[0].replace("\n", " "),
                  formatter_class=argparse.RawDescriptionHelpFormatter)
  m = p.add_argument_group("measurement")
  m.add_argument("--measure", metavar="DATASET", help="measure the loader on this dataset")
  m.add_argument("--batches", type=positive("batches", int), default=200)
  m.add_argument("--batch", type=positive("batch", int), default=32,
                 help="sequences per measured batch")
  m.add_argument("--io-file", default=IO_FILE, help="measurement to model with (its last "
                 "loader-io line; default the committed one)")
  t = p.add_argument_group("training")
  t.add_argument("--step-time", type=positive("step time"), default=0.129)
  t.add_argument("--per-gpu-batch", type=positive("batch", int), default=184)
  t.add_argument("--gpus-per-node", type=positive("GPUs per node", int), default=2)
  t.add_argument("--loader-workers", type=positive("loader workers", int), default=4,
                 help="Grain worker processes per GPU process (each opens every shard it "
                 "reads; default 4, configs/bert*.py)")
  t.add_argument("--nodes", type=csv(int, what="node counts"),
                 default=[1, 2, 4, 8, 16, 32, 64, 128])
  d = p.add_argument_group("dataset and storage")
  d.add_argument("--dataset-gb", type=positive("dataset size"), default=25.0)
  d.add_argument("--shard-mb", type=positive("shard size"), default=64.0)
  d.add_argument("--by-shard", action="store_true", help="data.shard_by_process: each "
                 "process opens only its 1/P of the shards (and stages only those)")
  d.add_argument("--fs-gbyte", type=positive("storage bandwidth"), default=20.0,
                 help="shared storage aggregate GB/s (default 20, assumed)")
  d.add_argument("--fs-read-ops", type=positive("storage read ops"), default=200_000.0,
                 help="small random reads/s the shared storage serves (default 200,000)")
  d.add_argument("--fs-metadata-ops", type=positive("storage metadata ops"), default=20_000.0,
                 help="opens/s of its metadata server (default 20,000)")
  d.add_argument("--network", type=network, default=links.PRESETS["25gbe"],
                 help=f"each node's link: {', '.join(links.PRESETS)} (default 25gbe)")
  d.add_argument("--stage-mbyte", type=positive("staging speed"),
                 help="lmscale stage MB/s per node (default: 'stage workers=8' of --stage-file)")
  d.add_argument("--stage-file", default=STAGE_FILE)
  p.add_argument("--json", action="store_true")
  return p


def measure(a) -> dict:
  from lmscale_jax.config import defaults as config_defaults
  from lmscale_jax.store import dataset
  from lmscale_jax.study.host import host_description

  meta = dataset.DatasetMeta.load(a.measure)  # DatasetError (one line) for a bad directory
  config = config_defaults.get_base_config()
  config.data.path = a.measure
  config.train.batch_size = a.batch
  row = sm.measure_loader(config, meta, a.batches)
  now = datetime.datetime.now()
  row = {"date": now.date().isoformat(), "device": host_description(a.measure),
         "time": now.isoformat(timespec="seconds"), "bench": "loader-io",
         "dataset": os.path.abspath(a.measure), **row}
  out = os.path.join(RESULTS, f"{row['date']}-cpu-loader-io.jsonl")
  with open(out, "a") as f:  # one line per measurement, appended
    f.write(json.dumps(row) + "\n")
  print(f"measured: {row['records_per_s']:,.0f} records/s, {row['bytes_per_s'] / 1e6:.1f} MB/s "
        f"read calls, {row['bytes_per_record']:.0f} B and {row['read_calls_per_record']:.2f} "
        f"reads per {row['record_payload_bytes']} B record, {row['shard_opens']} opens for "
        f"{row['shards']} shards (appended to {out})", file=sys.stderr)
  return row


def model(a, io: dict) -> dict:
  shards = max(1, math.ceil(a.dataset_gb * 1000 / a.shard_mb))
  procs_max = max(a.nodes) * a.gpus_per_node
  opens = (math.ceil(shards / procs_max) if a.by_shard else shards) * a.loader_workers
  demand = sm.Demand(records_per_s=a.per_gpu_batch / a.step_time,
                     bytes_per_record=io["bytes_per_record"],
                     read_calls_per_record=io["read_calls_per_record"], opens=opens)
  storage = sm.Storage(a.fs_gbyte * 1e9, a.fs_read_ops, a.fs_metadata_ops)
  stage = (a.stage_mbyte * 1e6 if a.stage_mbyte else
           sm.load_stage_speed(a.stage_file, "stage workers=8"))
  dataset_bytes = a.dataset_gb * 1e9 / (procs_max / a.gpus_per_node if a.by_shard else 1)
  rows = sm.compare(a.nodes, a.gpus_per_node, demand, storage, link_bytes=a.network.bandwidth,
                    dataset_bytes=dataset_bytes, stage_bytes_per_s=stage, step_s=a.step_time)
  return {"measurement": io, "shards": shards, "opens_per_process": opens,
          "stage_bytes_per_s": stage, "link": a.network.describe(),
          "storage": dataclasses.asdict(storage), "demand_per_process": dataclasses.asdict(demand),
          "rows": rows}


def render(a, result: dict) -> str:
  io, d = result["measurement"], result["demand_per_process"]
  lines = [
      f"loader (measured {io['date']}, seq {io['seq_len']}): {io['bytes_per_record']:.0f} bytes "
      f"and {io['read_calls_per_record']:.2f} read calls per {io['record_payload_bytes']}-byte "
      f"record; one loader reads {io['records_per_s']:,.0f} records/s",
      f"per GPU process: {d['records_per_s']:,.0f} records/s ({a.per_gpu_batch} / "
      f"{a.step_time} s), {result['opens_per_process']} opens at start-up "
      f"({a.loader_workers} loader(s) x {result['opens_per_process'] // a.loader_workers} shards)",
      f"shared storage: {a.fs_gbyte:g} GB/s, {a.fs_read_ops:,.0f} reads/s, "
      f"{a.fs_metadata_ops:,.0f} opens/s; node link {result['link']}; staging "
      f"{result['stage_bytes_per_s'] / 1e6:.0f} MB/s per node; dataset {a.dataset_gb:g} GB", "",
      "| nodes | read GB/s | reads/s | FS bandwidth use | FS read-op use | link use | input "
      "efficiency (shared) | start-up opens (s) | staging s | staging pays after steps |",
      "|" + "---|" * 10]
  for r in result["rows"]:
    pays = f"{r['stage_pays_after_steps']:,.0f}" if r["stage_pays_after_steps"] else "never"
    lines.append(
        f"| {r['nodes']} | {r['bytes_per_s'] / 1e9:.2f} | {r['read_calls_per_s']:,.0f} | "
        f"{r['fs_bandwidth_use']:.0%} | {r['fs_read_ops_use']:.0%} | {r['link_use']:.1%} | "
        f"{r['input_efficiency']:.0%} | {r['startup_opens']:,} ({r['startup_open_s']:.1f}) | "
        f"{r['stage_s']:.0f} | {pays} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  a = parser().parse_args(argv)

  def go() -> int:
    io = measure(a) if a.measure else sm.load_measurement(a.io_file)
    result = model(a, io)
    print(json.dumps(result, indent=1) if a.json else render(a, result))
    return 0

  return args.guarded(go, "nothing was written")


if __name__ == "__main__":
  sys.exit(main())
