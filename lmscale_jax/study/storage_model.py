"""What training asks of a file system, measured, and N nodes on shared storage vs staging.

**Measured** (:func:`measure_loader`): the real loader (``data.make_batch_loader``, the
per-batch function every Grain worker runs) reads ``batches`` batches; the kernel's own
counters of this process (``/proc/self/io``) give the bytes its ``read`` calls asked for
(``rchar``: what a shared file system's client would be asked for), the read calls
(``syscr``) and the bytes that came from the disk (``read_bytes``, after the page cache);
``/proc/self/fd`` gives the shard files held open. The loader opens each shard it reads once
and keeps the reader (``records.ShardRecords``): opens per loader = shards read (every shard
of the split in the interleaved plan; 1/P of them with ``data.shard_by_process``), and every
Grain worker process is a loader of its own.

**Modelled** (:func:`compare`), per node count N with g GPUs (one process each) per node:

* demand: each process consumes ``batch / step_s`` records/s, so the cluster asks for
  ``N·g·batch/step_s`` records/s and that many times the measured bytes and read calls per
  record; at start-up every loader opens its shards: ``N·g·max(1, workers)·shards`` opens;
* shared storage of aggregate bandwidth ``B``, small-read rate ``R`` (read calls/s) and
  metadata rate ``M`` (opens/s): the input keeps up while the demand is under both
  (``input efficiency = min(1, B/bytes demand, R/read demand)``: the GPUs wait for the rest),
  the opens take ``opens/M`` seconds at start-up; the reads also cross each node's network
  link (``per-node bytes demand / link``), which on converged Ethernet carries the gradients;
* staging: every node copies the dataset once, sequentially, all nodes at once:
  ``dataset / min(stage speed, link, B/N)`` seconds (stage speed: ``lmscale stage``
  measured, its verified copy), then reads only its local disk; it pays for itself after
  ``staging time / (shared step − local step)`` steps when shared storage slows the steps.

Left out: the client page cache (a dataset that fits in RAM is read from the FS only once per
node: then shared storage costs one epoch's reads), Lustre striping and OST imbalance, other
jobs on the same file system, and read-ahead (the loader reads records at random, so it has
none to use).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

from lmscale_jax.errors import UserError


class StorageModelError(UserError, ValueError):
  """A bad input of the storage model: names the value and what was expected."""


def _proc_io() -> dict[str, int]:
  with open("/proc/self/io") as f:
    return {k: int(v) for k, v in (line.split(": ") for line in f)}


def open_files(paths) -> int:
  """How many descriptors of this process are open on any of ``paths`` (``/proc/self/fd``)."""
  wanted = {os.path.realpath(p) for p in paths}
  count = 0
  for fd in os.listdir("/proc/self/fd"):
    try:
      if os.readlink(f"/proc/self/fd/{fd}") in wanted:
        count += 1
    except OSError:  # closed between listdir and readlink
      continue
  return count


def drop_cache(paths) -> None:
  """Evicts the files' clean pages, so ``read_bytes`` counts what a cold read fetches."""
  for path in paths:
    fd = os.open(path, os.O_RDONLY)
    try:
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)


def measure_loader(config, meta, batches: int, *, cold: bool = True) -> dict:
  """Runs the real per-batch loader of process 0 of 1 for ``batches`` batches (in this
  process, no Grain workers: a worker runs exactly this) and returns its file-system demand
  per record, from the kernel's counters."""
  from lmscale_jax.input import grain_pipeline as data

  loader = data.make_batch_loader(config, meta, "train", train=True)
  paths = loader.records.paths
  if cold:
    drop_cache(paths)
  opened_before = open_files(paths)
  io0, t0 = _proc_io(), time.perf_counter()
  for b in range(batches):
    loader(b)
  seconds = time.perf_counter() - t0
  io1 = _proc_io()
  records = batches * loader.local_batch
  delta = {k: io1[k] - io0[k] for k in ("rchar", "syscr", "read_bytes")}
  return {"records": records, "seconds": seconds, "records_per_s": records / seconds,
          "bytes_per_s": delta["rchar"] / seconds,
          "bytes_per_record": delta["rchar"] / records,
          "read_calls_per_record": delta["syscr"] / records,
          "disk_bytes_per_record": delta["read_bytes"] / records,
          "record_payload_bytes": 2 * meta.seq_len, "seq_len": meta.seq_len,
          "shards": len(paths), "shard_opens": open_files(paths) - opened_before,
          "batch": loader.local_batch, "cold_cache": cold}


# ----------------------------------------------------------------------------- model
@dataclasses.dataclass(frozen=True)
class Storage:
  """A shared file system: aggregate bytes/s, small read calls/s, metadata (open) ops/s."""
  bandwidth: float
  read_ops: float
  metadata_ops: float


@dataclasses.dataclass(frozen=True)
class Demand:
  """What one training process asks for: ``records_per_s`` and, per record, the bytes and
  read calls measured from the loader; ``opens`` at start-up (shards × loaders)."""
  records_per_s: float
  bytes_per_record: float
  read_calls_per_record: float
  opens: int


def check_positive(what: str, value) -> float:
  if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
    raise StorageModelError(f"{what} {value!r}: expected a positive number")
  return float(value)


def compare(nodes, gpus_per_node: int, demand: Demand, storage: Storage, *, link_bytes: float,
            dataset_bytes: float, stage_bytes_per_s: float, step_s: float) -> list[dict]:
  """One row per node count: shared-storage demand and input efficiency vs staging time."""
  for what, v in (("storage bandwidth", storage.bandwidth), ("storage read ops/s",
                  storage.read_ops), ("storage metadata ops/s", storage.metadata_ops),
                  ("link bandwidth", link_bytes), ("dataset bytes", dataset_bytes),
                  ("staging speed", stage_bytes_per_s), ("step time", step_s),
                  ("records/s", demand.records_per_s)):
    check_positive(what, v)
  rows = []
  for n in nodes:
    procs = n * gpus_per_node
    records = procs * demand.records_per_s
    bytes_s = records * demand.bytes_per_record
    reads_s = records * demand.read_calls_per_record
    node_bytes_s = gpus_per_node * demand.records_per_s * demand.bytes_per_record
    eff = min(1.0, storage.bandwidth / bytes_s, storage.read_ops / max(reads_s, 1e-30),
              link_bytes / node_bytes_s)
    opens = procs * demand.opens
    stage_speed = min(stage_bytes_per_s, link_bytes, storage.bandwidth / n)
    stage_s = dataset_bytes / stage_speed  # every node copies the whole dataset, all at once
    shared_step = step_s / eff
    rows.append({
        "nodes": n, "processes": procs, "records_per_s": records, "bytes_per_s": bytes_s,
        "read_calls_per_s": reads_s, "fs_bandwidth_use": bytes_s / storage.bandwidth,
        "fs_read_ops_use": reads_s / storage.read_ops,
        "link_use": node_bytes_s / link_bytes, "input_efficiency": eff,
        "startup_opens": opens, "startup_open_s": opens / storage.metadata_ops,
        "stage_s": stage_s, "stage_bytes_per_s_per_node": stage_speed,
        "shared_step_s": shared_step,
        "stage_pays_after_steps": (stage_s / (shared_step - step_s)
                                   if shared_step > step_s * (1 + 1e-12) else None)})
  return rows


def load_measurement(path: str) -> dict:
  """The last ``loader-io`` row of a results file written by ``lmscale storage-model``."""
  try:
    with open(path) as f:
      rows = [json.loads(line) for line in f if line.strip()]
  except OSError as e:
    raise StorageModelError(f"--io-file {path}: cannot read it ({e.strerror}); run "
                            "lmscale storage-model --measure DATASET first") from None
  except ValueError:
    raise StorageModelError(f"--io-file {path}: not JSON lines") from None
  rows = [r for r in rows if r.get("bench") == "loader-io"]
  if not rows:
    raise StorageModelError(f"--io-file {path}: no loader-io row (expected the output of "
                            "lmscale storage-model --measure)")
  return rows[-1]


def load_stage_speed(path: str, method: str) -> float:
  """Bytes/s of ``method`` (e.g. "stage workers=8") in a bench_stage results file (last row)."""
  try:
    with open(path) as f:
      rows = [json.loads(line) for line in f if line.strip()]
  except (OSError, ValueError) as e:
    raise StorageModelError(f"--stage-file {path}: cannot read its JSON lines ({e})") from None
  rows = [r for r in rows if r.get("bench") == "stage" and r.get("method") == method]
  if not rows:
    raise StorageModelError(f"--stage-file {path}: no row with method {method!r}")
  return rows[-1]["bytes"] / rows[-1]["median_s"]
