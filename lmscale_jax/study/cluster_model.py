"""A plain α–β model of data-parallel training on a cluster: is a step waiting on the network?

Inputs: the time one accelerator takes for one training step (``step_s``, measured: it holds
forward, backward and the optimizer update at some per-device batch, without communication)
and the gradient it reduces (``params`` scalars in ``dtype``). Outputs, per node count: the
all-reduce time, the step time and the weak-scaling efficiency, and the smallest number of
accumulation steps (and gradient dtype) that keep the efficiency ≥ a target.

**Links.** A link moves ``n`` bytes in ``α + n/β`` (α: latency, β: bytes/s per direction).
Each node has one network link (``inter``) of the preset's line rate, and its GPUs share an
intra-node link (``intra``: NVLink bridge by default, the paper's H100-NVL pairs).

**Collectives** (``p`` ranks, gradient ``G`` bytes), the textbook bandwidth-optimal ring
(reduce-scatter then all-gather: ``2(p−1)`` steps of ``G/p`` bytes on every edge)::

  ring(G, p, α, β)  = 2(p−1)·α + 2(p−1)/p · G/β
  flat(N, g)        = 2(Ng−1)·(α_inter + G/(Ng)/β_inter)     one ring over all N·g GPUs; every
                                                             step waits on its slowest edge,
                                                             a node's network link (N > 1)
  hierarchical(N,g) = reduce_intra + ring(G, N, α_inter, β_inter) + broadcast_intra
                      reduce_intra = broadcast_intra = (g−1)·α_intra + (g−1)/g · G/β_intra

On one node both are the intra-node ring. A ring's per-node traffic, 2(p−1)/p·G, barely grows
with p: the time is almost constant in N, so throughput grows linearly in N even while every
step waits on the network (the paper's finding 4 needs this model to be read).

**Steps.** With ``k`` accumulation steps a step computes ``k`` microbatches (``k·step_s``) and
reduces once. Without overlap ``step = k·step_s + comm``. With overlap the reduction runs
during the backward pass of the last microbatch (earlier microbatches only accumulate):
``step = k·step_s + max(0, comm − f_b·step_s)``, with ``f_b`` = 2/3 the backward share of a
step: a matmul costs 2 FLOPs per multiply-add forward and 4 backward (gradients for inputs and
weights, see ``flops.train_flops_per_sequence``), so backward is 4/6 of the FLOPs. That is the
best case (it assumes the first gradients are ready at the start of backward, and NCCL
streams at full speed beside the compute); lmscale_jax's accumulation path reduces after its
``lax.scan`` (``steps.make_grads_fn``): there ``overlap="none"`` is the right model.
Efficiency = ``k·step_s / step``: throughput against N·g GPUs that never communicate.

**Left out**: stragglers (every step waits for the slowest GPU: real variance lowers the
efficiency further), congestion and oversubscribed switches (the model gives every node its
full line rate at once), NCCL's tree and other algorithms (trees trade bandwidth for
``O(log p)`` latency: they matter for small messages at large p, not for ~100 MB gradients),
multiple NICs per node, the optimizer's share of a step not repeating under accumulation
(``k·step_s`` counts it k times: slightly pessimistic), and the protocol overhead that keeps
real transfers below line rate (the presets are line rates: an upper bound on efficiency).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics

from lmscale_jax.config import legacy
from lmscale_jax.errors import UserError

GRAD_BYTES = {"float32": 4, "bfloat16": 2}
BACKWARD_FRACTION = 2 / 3
SCHEMES = ("flat", "hierarchical")
OVERLAPS = ("none", "backward")
DEFAULT_NODES = tuple(2 ** i for i in range(11))  # 1 … 1024


class ModelError(UserError, ValueError):
  """A bad input of the cluster model: the message names the value and what was expected."""


@dataclasses.dataclass(frozen=True)
class Link:
  """One direction of a link: ``bandwidth`` bytes/s, ``latency`` seconds per message."""
  name: str
  bandwidth: float
  latency: float

  def describe(self) -> str:
    return (f"{self.name} ({self.bandwidth * 8 / 1e9:g} Gb/s = {self.bandwidth / 1e9:g} GB/s, "
            f"{self.latency * 1e6:g} us)")


# Network presets: the line rate per direction of one port (what a node's link can carry at
# most) and a typical one-way small-message latency of the transport NCCL uses on it (TCP
# sockets on plain Ethernet, RDMA on converged Ethernet and InfiniBand).
PRESETS = {
    "10gbe": Link("10 GbE", 10e9 / 8, 30e-6),      # TCP sockets
    "25gbe": Link("25 GbE", 25e9 / 8, 10e-6),      # RoCE (the paper's converged Ethernet)
    "100gbe": Link("100 GbE", 100e9 / 8, 5e-6),    # RoCE
    "hdr": Link("HDR InfiniBand", 200e9 / 8, 2e-6),  # 4x HDR, 200 Gb/s
    "ndr": Link("NDR InfiniBand", 400e9 / 8, 2e-6),  # 4x NDR, 400 Gb/s
}
# The two H100 NVL of a TX-GAIN node share an NVLink bridge: 600 GB/s both ways, 300 each.
NVLINK_BRIDGE = Link("NVLink bridge", 300e9, 2e-6)


def preset(name: str) -> Link:
  try:
    return PRESETS[name.lower()]
  except KeyError:
    raise ModelError(f"unknown network preset {name!r}: expected one of "
                     f"{', '.join(PRESETS)} (or --bandwidth-gbps/--latency-us)") from None


def link(name: str, bandwidth: float, latency: float) -> Link:
  """A link from user values, checked: bandwidth > 0 bytes/s, latency ≥ 0 s."""
  if not (isinstance(bandwidth, (int, float)) and math.isfinite(bandwidth) and bandwidth > 0):
    raise ModelError(f"{name} bandwidth {bandwidth!r}: expected a positive number")
  if not (isinstance(latency, (int, float)) and math.isfinite(latency) and latency >= 0):
    raise ModelError(f"{name} latency {latency!r}: expected a number >= 0")
  return Link(name, float(bandwidth), float(latency))


def positive(what: str, value) -> float:
  if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
    raise ModelError(f"{what} {value!r}: expected a positive number")
  return float(value)


# ----------------------------------------------------------------------------- collectives
def ring_allreduce_s(grad_bytes: float, ranks: int, alpha: float, beta: float) -> float:
  """Ring all-reduce of ``grad_bytes`` over ``ranks`` ranks on links of (α, β)."""
  if ranks <= 1:
    return 0.0
  return 2 * (ranks - 1) * alpha + 2 * (ranks - 1) / ranks * grad_bytes / beta


def _intra_half(grad_bytes: float, gpus: int, intra: Link) -> float:
  """Ring reduce (or broadcast) inside one node: half a ring all-reduce."""
  if gpus <= 1:
    return 0.0
  return (gpus - 1) * intra.latency + (gpus - 1) / gpus * grad_bytes / intra.bandwidth


def allreduce_s(grad_bytes: float, nodes: int, gpus: int, inter: Link, intra: Link,
                scheme: str = "flat") -> float:
  """All-reduce time of ``grad_bytes`` over ``nodes`` × ``gpus`` GPUs (see module docstring)."""
  if scheme not in SCHEMES:
    raise ModelError(f"all-reduce scheme {scheme!r}: expected one of {', '.join(SCHEMES)}")
  if nodes == 1:
    return ring_allreduce_s(grad_bytes, gpus, intra.latency, intra.bandwidth)
  if scheme == "flat":
    ranks = nodes * gpus
    return 2 * (ranks - 1) * (inter.latency + grad_bytes / ranks / inter.bandwidth)
  return (2 * _intra_half(grad_bytes, gpus, intra)
          + ring_allreduce_s(grad_bytes, nodes, inter.latency, inter.bandwidth))


# ----------------------------------------------------------------------------- steps
@dataclasses.dataclass(frozen=True)
class Cluster:
  inter: Link
  intra: Link = NVLINK_BRIDGE
  gpus_per_node: int = 2
  scheme: str = "flat"


def step_s(step_time: float, comm: float, k: int, overlap: str) -> float:
  """One optimizer step of ``k`` microbatches of ``step_time`` each plus the exposed reduction."""
  if overlap not in OVERLAPS:
    raise ModelError(f"overlap {overlap!r}: expected one of {', '.join(OVERLAPS)}")
  hidden = BACKWARD_FRACTION * step_time if overlap == "backward" else 0.0
  return k * step_time + max(0.0, comm - hidden)


def efficiency(step_time: float, comm: float, k: int, overlap: str) -> float:
  return k * step_time / step_s(step_time, comm, k, overlap)


def smallest_k(step_time: float, comm: float, overlap: str, target: float,
               k_max: int = 1024) -> int | None:
  """The smallest accumulation count with efficiency ≥ ``target`` (None beyond ``k_max``)."""
  exposed = step_s(step_time, comm, 1, overlap) - step_time  # the same for every k
  if exposed <= 0:
    return 1
  k = max(1, math.ceil(target / (1 - target) * exposed / step_time - 1e-9))
  while efficiency(step_time, comm, k, overlap) < target:  # float rounding at the boundary
    k += 1
  return k if k <= k_max else None


def predict(step_time: float, params: int, cluster: Cluster, *, nodes=DEFAULT_NODES,
            dtypes=("float32", "bfloat16"), overlaps=OVERLAPS, k: int = 1,
            target: float = 0.95, per_device_batch: int = 0) -> dict:
  """The model's table: one row per (dtype, overlap, node count), plus recommendations."""
  positive("step time (s)", step_time)
  positive("parameter count", params)
  if not 0 < target < 1:
    raise ModelError(f"target efficiency {target!r}: expected a number in (0, 1)")
  rows = []
  for dtype in dtypes:
    grad = params * GRAD_BYTES[dtype]
    for overlap in overlaps:
      for n in nodes:
        comm = allreduce_s(grad, n, cluster.gpus_per_node, cluster.inter, cluster.intra,
                           cluster.scheme)
        kk = smallest_k(step_time, comm, overlap, target)
        rows.append({
            "dtype": dtype, "overlap": overlap, "nodes": n, "gpus": n * cluster.gpus_per_node,
            "grad_bytes": grad, "comm_s": comm, "k": k,
            "step_s": step_s(step_time, comm, k, overlap),
            "efficiency": efficiency(step_time, comm, k, overlap),
            "k_for_target": kk,
            "global_batch_at_k_for_target": (n * cluster.gpus_per_node * per_device_batch * kk
                                             if per_device_batch and kk else None)})
  return {"step_time_s": step_time, "params": params, "target": target,
          "cluster": {"inter": dataclasses.asdict(cluster.inter),
                      "intra": dataclasses.asdict(cluster.intra),
                      "gpus_per_node": cluster.gpus_per_node, "scheme": cluster.scheme},
          "backward_fraction": BACKWARD_FRACTION, "rows": rows,
          "recommendations": recommend(rows, dtypes, overlaps)}


def recommend(rows: list[dict], dtypes, overlaps) -> list[dict]:
  """Per overlap mode and node count: the smallest k reaching the target and its dtype
  (float32 when both need the same k: it reduces exactly what was computed)."""
  out = []
  for overlap in overlaps:
    for n in sorted({r["nodes"] for r in rows}):
      options = [(r["k_for_target"], dtypes.index(r["dtype"]), r) for r in rows
                 if r["overlap"] == overlap and r["nodes"] == n and r["k_for_target"]]
      best = min(options, key=lambda o: o[:2], default=None)
      out.append({"overlap": overlap, "nodes": n, "k": best[0] if best else None,
                  "dtype": best[2]["dtype"] if best else None,
                  "global_batch": best[2]["global_batch_at_k_for_target"] if best else None})
  return out


# ----------------------------------------------------------------------------- calibration
def shared_cores(ranks: int, cores: int | None) -> float:
  """How many times slower each rank's copies run when ``ranks`` processes share ``cores``
  cores (1 when each has a core of its own, or ``cores`` is None: a real network)."""
  return max(1.0, ranks / cores) if cores else 1.0


def calibrated_allreduce_s(grad_bytes: float, ranks: int, alpha: float, beta: float,
                           cores: int | None = None) -> float:
  """The ring model of a loopback all-reduce on one machine: the "link" is the kernel copying
  bytes between processes, CPU work, so its bandwidth is shared when ranks outnumber cores."""
  if ranks <= 1:
    return 0.0
  return (2 * (ranks - 1) * alpha
          + 2 * (ranks - 1) / ranks * grad_bytes * shared_cores(ranks, cores) / beta)


def fit_alpha_beta(points, cores: int | None = None) -> tuple[float, float]:
  """(α, β) of the ring model ``t = 2(p−1)·α + 2(p−1)/p·n·s/β`` fitted to ``(p, n, t)``
  points, ``s = shared_cores(p, cores)`` (1 unless ``cores`` is given and p exceeds it).

  Least squares in *relative* error (each point weighted by 1/t), so a 1 MB point counts as
  much as a 256 MB one; linear in (α, 1/β), solved in closed form. α is clamped at 0 (a
  negative latency is noise: refitted with α = 0).
  """
  rows = [(2 * (p - 1) / t, 2 * (p - 1) / p * n * shared_cores(p, cores) / t)
          for p, n, t in points]
  if len(rows) < 2:
    raise ModelError("an α–β fit needs at least two measured points")
  saa = sum(a * a for a, _ in rows)
  sbb = sum(b * b for _, b in rows)
  sab = sum(a * b for a, b in rows)
  sa, sb = sum(a for a, _ in rows), sum(b for _, b in rows)  # targets are all 1
  det = saa * sbb - sab * sab
  alpha, inv_beta = ((sbb * sa - sab * sb) / det, (saa * sb - sab * sa) / det) if det else (
      0.0, 0.0)
  if alpha < 0 or not det:
    alpha, inv_beta = 0.0, sb / sbb
  if inv_beta <= 0:
    raise ModelError("the all-reduce timings do not grow with size: no bandwidth to fit")
  return alpha, 1 / inv_beta


def calibration_fit(path: str, fit_of: str = "all") -> dict:
  """The last ``fit`` line of ``fit_of`` ("all" = every process count at once, or "2", "4",
  …) that ``benchmarks/bench_allreduce.py`` wrote to ``path``, from a run that kept freed
  memory in the heap (``heap: keep``: the transport's time, not page faults)."""
  try:
    with open(path) as f:
      lines = f.read().splitlines()
  except OSError as e:
    raise ModelError(f"--calibration {path}: cannot read it ({e.strerror})") from None
  fits = []
  for i, line in enumerate(lines, 1):
    try:
      row = json.loads(line)
    except ValueError:
      raise ModelError(f"--calibration {path}: line {i} is not JSON") from None
    if (row.get("kind") == "fit" and row.get("fit_of") == fit_of
        and row.get("heap", "keep") == "keep"):
      fits.append(row)
  if not fits:
    raise ModelError(f"--calibration {path}: no fit line with fit_of={fit_of!r} of a "
                     "heap=keep run (expected the output of benchmarks/bench_allreduce.py)")
  return fits[-1]


def load_calibration(path: str, fit_of: str = "all") -> Link:
  """The link of :func:`calibration_fit` (α, β; its ``cores`` only matter on that machine)."""
  fit = calibration_fit(path, fit_of)
  return link(f"calibrated ({os.path.basename(path)}, fit of {fit_of})",
              fit["beta_bytes_per_s"], fit["alpha_s"])


# ----------------------------------------------------------------------------- workdirs
def workdir_step(workdir: str, skip_windows: int = 1) -> dict:
  """A finished or running workdir's measured microbatch step time and parameter count.

  ``step_time`` is the median of ``metrics.jsonl``'s windows after the first ``skip_windows``
  (compilation and warm-up), divided by ``train.grad_accum_steps``; the parameters are counted
  from ``config.json``'s resolved model (``flops.count_params_from_config``).
  """
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  config_path = os.path.join(workdir, "config.json")
  if not os.path.isdir(workdir):
    raise ModelError(f"--workdir {workdir}: not a directory")
  times = []
  if os.path.exists(metrics_path):
    with open(metrics_path) as f:
      for line in f:
        try:
          row = json.loads(line)
        except ValueError:
          continue  # a torn last line of a run still writing
        if isinstance(row.get("step_time"), (int, float)):
          times.append(row["step_time"])
  if len(times) <= skip_windows:
    raise ModelError(f"--workdir {workdir}: {metrics_path} has {len(times)} step_time rows; "
                     f"need more than {skip_windows} (the first window is warm-up): train "
                     "longer, or give --step-time")
  try:
    with open(config_path) as f:
      cfg = json.load(f)
    shape, train = cfg["model"], legacy.complete(cfg["config"])["train"]
  except (OSError, ValueError, KeyError) as e:
    raise ModelError(f"--workdir {workdir}: {config_path} is missing or not a run's config "
                     f"({type(e).__name__}: {e})") from None
  import ml_collections

  from lmscale_jax.model import flops

  params = flops.count_params_from_config(ml_collections.ConfigDict(shape))
  k = int(train["grad_accum_steps"])
  return {"step_time_s": statistics.median(times[skip_windows:]) / k, "params": params,
          "windows": len(times) - skip_windows, "grad_accum_steps": k,
          "grad_dtype": train["grad_allreduce_dtype"],
          "batch_size": int(train["batch_size"])}
