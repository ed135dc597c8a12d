"""Data-parallel training on a cluster: is a step waiting on the network? Step time and
efficiency per node count, from what one GPU does and the cluster it runs on.

Inputs (:class:`Compute`): one GPU's step time at its per-device batch without communication
(measured: forward, backward, optimizer update), or a line ``t(b) = t0 + b·t1`` fitted to
step times at several batches (:class:`StepCurve`: ``lmscale sweep``/``max-batch`` runs,
``benchmarks/bench_step_profile.py``); the part of a step that does not repeat under
accumulation (``fixed``: optimizer update, launch, host work); the jitter ``σ`` of one
microbatch's time; when gradients become ready during backward
(:mod:`overlap`). The cluster (:class:`Cluster`): a node's network (NICs × rate,
latency, transport efficiency by size: :mod:`links`), GPUs per node and their link,
the all-reduce algorithm (:mod:`collectives`). Measured inputs are read by :mod:`measured`.

**A step** of ``k`` microbatches on ``N`` nodes × ``g`` GPUs::

  micro      = t(b) − fixed                           one microbatch's forward + backward
  step       = fixed + k·micro + exposed + straggler
  exposed    = the all-reduce not hidden behind the last microbatch's backward
               (T_b = ⅔·micro; overlap none / bucketed / backward: overlap.py)
  straggler  = σ·√k · E[max of N·g standard normals]  every step waits for the slowest GPU
               (Blom: E ≈ Φ⁻¹((P − 0.375)/(P + 0.25)); 0 for one GPU; k microbatches' jitter
               adds up as √k)
  efficiency = (fixed + k·micro) / step               against one GPU at the same k, with no
                                                      communication and no one to wait for
  vs 1 node  = (k_N/step_N) / (k_1/step_1)            per-GPU throughput against one node's

Only the last microbatch's backward can hide the reduction (earlier ones only accumulate);
lmscale_jax's own accumulation path reduces after its ``lax.scan``: ``none`` models it. The
accumulation count may differ per node count (``k_by_nodes``). The smallest ``k`` reaching a
target efficiency is searched directly (the exposed reduction does not depend on ``k``).

**Left out**: congestion and oversubscribed switches (every node gets its full rate at once),
the slowdown of compute while NCCL shares the GPU with it, jitter correlated across GPUs
(a shared file system's hiccup hits all of them: less straggling than independent jitter),
and memory limits of a batch (``lmscale max-batch`` says what fits).
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from lmscale_jax.study.cluster_model import collectives as coll
from lmscale_jax.study.cluster_model import overlap as ov
from lmscale_jax.study.cluster_model.links import (NVLINK_BRIDGE, Link, ModelError, Network,
                                                   positive)

GRAD_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_NODES = tuple(2 ** i for i in range(11))  # 1 … 1024
K_MAX = 1024


@dataclasses.dataclass(frozen=True)
class Cluster:
  network: Network
  intra: Link = NVLINK_BRIDGE
  gpus_per_node: int = 2
  algorithm: str = "flat"

  def allreduce_s(self, nbytes: float, nodes: int) -> float:
    return coll.allreduce_s(nbytes, nodes, self.gpus_per_node, self.network, self.intra,
                            self.algorithm)


@dataclasses.dataclass(frozen=True)
class StepCurve:
  """One GPU's step time against its per-device batch: the least-squares line through
  measured ``(batch, seconds)`` points (one point: proportional to the batch)."""
  points: tuple[tuple[int, float], ...]
  source: str = ""

  def line(self) -> tuple[float, float]:
    """(t0, t1) of ``t(b) = t0 + b·t1``."""
    if len({b for b, _ in self.points}) < 2:
      b, t = self.points[0]
      return 0.0, t / b
    slope, intercept = statistics.linear_regression([b for b, _ in self.points],
                                                    [t for _, t in self.points])
    return intercept, slope

  def measured(self) -> tuple[int, int]:
    """The smallest and largest measured batch."""
    return self.points[0][0], self.points[-1][0]

  def extrapolates(self, batch: int) -> bool:
    """Whether the step time at ``batch`` is not between measured batches (one point: any
    other batch, taken as proportional to it)."""
    lo, hi = self.measured()
    return not lo <= batch <= hi or (lo == hi and batch != lo)

  def intercept(self) -> float | None:
    """``t0`` of the line, the step time at batch 0: what does not grow with the batch
    (optimizer update, launch, host work); None with fewer than two distinct batches."""
    return self.line()[0] if len({b for b, _ in self.points}) >= 2 else None

  def at(self, batch: int) -> float:
    t0, t1 = self.line()
    t = t0 + t1 * batch
    if t <= 0:
      raise ModelError(f"step-time curve {self.source or self.points}: predicts {t:.3g} s at "
                       f"batch {batch} (outside the measured range?)")
    return t


def step_curve(points, source: str = "") -> StepCurve:
  pts = tuple(sorted((int(b), positive(f"step time at batch {b}", t)) for b, t in points))
  if not pts or any(b < 1 for b, _ in pts):
    raise ModelError(f"step times {source or list(points)}: expected batch:seconds pairs, "
                     "batch >= 1")
  return StepCurve(pts, source)


@dataclasses.dataclass(frozen=True)
class Compute:
  """What one GPU does in one step at k = 1 with no communication."""
  step_time: float
  fixed: float = 0.0
  jitter: float = 0.0
  profile: ov.GradientProfile = ov.UNIFORM

  @property
  def micro(self) -> float:
    return self.step_time - self.fixed


def compute(step_time: float, fixed: float = 0.0, jitter: float = 0.0,
            profile: ov.GradientProfile = ov.UNIFORM) -> Compute:
  positive("step time (s)", step_time)
  for what, value in (("fixed per-step cost", fixed), ("jitter", jitter)):
    if not (math.isfinite(value) and value >= 0):
      raise ModelError(f"{what} {value!r} s: expected a number >= 0")
  if fixed >= step_time:
    raise ModelError(f"fixed per-step cost {fixed:g} s: must be below the step time "
                     f"{step_time:g} s (it is part of it)")
  return Compute(step_time, fixed, jitter, profile)


# ----------------------------------------------------------------------------- one step
def expected_max_normal(ranks: int) -> float:
  """E[max of ``ranks`` independent standard normals] (Blom's approximation; exact 0 and
  1/√π = 0.564 at 1 and 2 ranks, Blom gives 0 and 0.589)."""
  if ranks <= 1:
    return 0.0
  return statistics.NormalDist().inv_cdf((ranks - 0.375) / (ranks + 0.25))


def straggler_s(c: Compute, ranks: int, k: int) -> float:
  return c.jitter * math.sqrt(k) * expected_max_normal(ranks)


def step_s(c: Compute, exposed: float, k: int, straggler: float = 0.0) -> float:
  """One optimizer step of ``k`` microbatches plus the exposed reduction and the wait."""
  return c.fixed + k * c.micro + exposed + straggler


def efficiency(c: Compute, exposed: float, k: int, straggler: float = 0.0) -> float:
  """Throughput against GPUs that never communicate nor wait, at the same ``k``."""
  return (c.fixed + k * c.micro) / step_s(c, exposed, k, straggler)


def smallest_k(c: Compute, exposed: float, ranks: int, target: float,
               k_max: int = K_MAX) -> int | None:
  """The smallest accumulation count with efficiency ≥ ``target`` (None beyond ``k_max``)."""
  for k in range(1, k_max + 1):
    if efficiency(c, exposed, k, straggler_s(c, ranks, k)) >= target:
      return k
  return None


def reduction(c: Compute, cluster: Cluster, grad_bytes: float, nodes: int, overlap: str,
              bucket_bytes: float) -> tuple[float, float]:
  """(all-reduce seconds issued, seconds exposed) of one step's gradient on ``nodes``."""
  return ov.exposed_s(lambda m: cluster.allreduce_s(m, nodes), grad_bytes,
                      ov.BACKWARD_FRACTION * c.micro, overlap, c.profile, bucket_bytes)


# ----------------------------------------------------------------------------- the table
def k_for(k_by_nodes: dict[int, int], nodes: int) -> int:
  """The accumulation count at ``nodes``: that of the largest listed node count ≤ ``nodes``
  (the smallest listed one below all of them)."""
  listed = sorted(k_by_nodes)
  below = [n for n in listed if n <= nodes]
  return k_by_nodes[below[-1] if below else listed[0]]


def predict(c: Compute | float, params: int, cluster: Cluster, *, nodes=DEFAULT_NODES,
            dtypes=("float32", "bfloat16"), overlaps=ov.OVERLAPS, k: int | dict = 1,
            target: float = 0.95, per_device_batch: int = 0,
            bucket_bytes: float = ov.DDP_BUCKET_BYTES) -> dict:
  """The model's table: one row per (dtype, overlap, node count), plus recommendations."""
  c = c if isinstance(c, Compute) else compute(c)
  positive("parameter count", params)
  if not 0 < target < 1:
    raise ModelError(f"target efficiency {target!r}: expected a number in (0, 1)")
  k_by_nodes = k if isinstance(k, dict) else {1: k}
  rows = [row(c, cluster, params, dtype, overlap, n, k_for(k_by_nodes, n), target,
              per_device_batch, bucket_bytes)
          for dtype in dtypes for overlap in overlaps for n in nodes]
  # 1 node, whether or not --nodes lists it: what "vs node" compares every row against.
  one_node = {(dtype, overlap): row(c, cluster, params, dtype, overlap, 1, k_for(k_by_nodes, 1),
                                    target, per_device_batch, bucket_bytes)
              for dtype in dtypes for overlap in overlaps}
  per_node_reference(rows, one_node)
  return {"step_time_s": c.step_time, "fixed_s": c.fixed, "jitter_s": c.jitter,
          "gradient_profile": c.profile.name, "params": params, "target": target,
          "per_device_batch": per_device_batch or None, "bucket_bytes": bucket_bytes,
          "cluster": describe_cluster(cluster),
          "backward_fraction": ov.BACKWARD_FRACTION, "rows": rows,
          "recommendations": recommend(rows, dtypes, overlaps)}


def row(c: Compute, cluster: Cluster, params: int, dtype: str, overlap: str, n: int, k: int,
        target: float, per_device_batch: int, bucket_bytes: float) -> dict:
  grad = params * GRAD_BYTES[dtype]
  ranks = n * cluster.gpus_per_node
  comm, exposed = reduction(c, cluster, grad, n, overlap, bucket_bytes)
  wait = straggler_s(c, ranks, k)
  kk = smallest_k(c, exposed, ranks, target)
  return {"dtype": dtype, "overlap": overlap, "nodes": n, "gpus": ranks, "grad_bytes": grad,
          "k": k, "comm_s": comm, "network_s": coll.network_s(
              grad, n, cluster.gpus_per_node, cluster.network, cluster.intra,
              cluster.algorithm),
          "exposed_s": exposed, "straggler_s": wait, "step_s": step_s(c, exposed, k, wait),
          "efficiency": efficiency(c, exposed, k, wait), "k_for_target": kk,
          "global_batch": ranks * per_device_batch * k if per_device_batch else None,
          "global_batch_at_k_for_target": (ranks * per_device_batch * kk
                                           if per_device_batch and kk else None)}


def per_node_reference(rows: list[dict], one_node: dict) -> None:
  """Adds ``efficiency_vs_node``: per-GPU throughput against the same dtype/overlap on 1 node
  (``one_node``: its rows, computed even where the table does not list 1 node; it was the
  table's smallest node count, which --nodes 16,128 made 16)."""
  for r in rows:
    base = one_node[r["dtype"], r["overlap"]]
    r["efficiency_vs_node"] = (r["k"] / r["step_s"]) / (base["k"] / base["step_s"])
    r["reference_nodes"] = 1


def describe_cluster(cluster: Cluster) -> dict:
  return {"network": cluster.network.describe(), "nic": dataclasses.asdict(cluster.network.nic),
          "nics_per_node": cluster.network.nics, "transport": cluster.network.transport.name,
          "transport_source": cluster.network.transport.source,
          "intra": dataclasses.asdict(cluster.intra), "gpus_per_node": cluster.gpus_per_node,
          "algorithm": cluster.algorithm}


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
