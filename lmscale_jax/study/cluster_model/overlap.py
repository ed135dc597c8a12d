"""How much of the gradient reduction a step can hide behind its backward pass, bucket by
bucket (DDP/Horovod-style buckets; XLA's async collectives behave alike), from the order in
which backward produces the gradients and the FLOPs between them.

**When gradients are ready.** Backward runs the layers in reverse: the MLM head first, then
encoder layers L … 1, then the embeddings. A segment's gradients are complete when its
backward FLOPs are done (``flops.train_flops_per_sequence``'s terms, backward = 4 of every 6
FLOPs): the head after its share, each encoder layer after ``4·S·(4H² + 2HF) + 8·S²·H``. The
embedding tables cost no matmul FLOPs but finish *last*: the word table is tied to the MLM
decoder, so its gradient is complete only when the input embedding's is. Without a model
config the gradient is taken as produced uniformly over the backward pass (said in the label).

**Buckets.** The gradient is cut, in production order, into buckets of ``b`` bytes; a bucket's
all-reduce may start when its last byte is ready; the network runs one all-reduce at a time::

  end_j = max(ready_j, end_{j−1}) + allreduce(bucket_j)      exposed = max(0, end_last − T_b)

``T_b`` is the backward time of the (last) microbatch. Each bucket is its own message, so its
latency terms and its transport efficiency are those of its size: small buckets hide more but
pay more per byte. ``b ≥`` the gradient is one message after backward (no overlap); the old
"backward" mode (everything may start at the first backward FLOP) is the ideal bound.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Callable

from lmscale_jax.study.cluster_model.links import ModelError, positive

BACKWARD_FRACTION = 2 / 3  # 4 of the 6 FLOPs per multiply-add of a training step
OVERLAPS = ("none", "bucketed", "backward")
DDP_BUCKET_BYTES = 25 * 2 ** 20  # torch DistributedDataParallel's default bucket_cap_mb=25


@dataclasses.dataclass(frozen=True)
class GradientProfile:
  """Gradient segments in the order backward completes them: (parameters, backward FLOPs)."""
  segments: tuple[tuple[int, float], ...]
  name: str

  def ready_fractions(self) -> tuple[list[float], list[float]]:
    """Cumulative (share of the gradient's bytes, share of backward time) at each segment end."""
    total_p = sum(p for p, _ in self.segments)
    total_f = sum(f for _, f in self.segments) or 1.0
    sizes, times, cp, cf = [], [], 0, 0.0
    for p, f in self.segments:
      cp, cf = cp + p, cf + f
      sizes.append(cp / total_p)
      times.append(cf / total_f)
    return sizes, times

  def ready_at(self, byte_fraction: float) -> float:
    """Share of the backward pass after which the gradient's first ``byte_fraction`` is ready."""
    sizes, times = self.ready_fractions()
    i = bisect.bisect_left(sizes, byte_fraction - 1e-12)
    return times[min(i, len(times) - 1)]


UNIFORM = GradientProfile(tuple((1, 1.0) for _ in range(1000)),
                          "gradient ready uniformly over backward (no model config)")


def bert_profile(cfg, seq_len: int, predictions: int) -> GradientProfile:
  """The MLM encoder's profile (``cfg``: a resolved model config, as ``flops`` takes)."""
  h, f, v, s = cfg.hidden, cfg.ffn, cfg.vocab_size, seq_len
  ln = 2 * h
  layer = 4 * (h * h + h) + (h * f + f) + (f * h + h) + 2 * ln
  layer_flops = 4 * s * (4 * h * h + 2 * h * f) + 2 * (2 * 2 * s * s * h)
  head = (h * h + h) + ln + v + (ln if cfg.get("norm", "post") == "pre" else 0)
  tables = 2 if cfg.get("positions", "absolute") == "instruction" else 1
  embeddings = (v + tables * seq_len + cfg.type_vocab_size) * h + ln
  segments = ((head, 4.0 * predictions * (h * h + h * v)),
              *((layer, float(layer_flops)) for _ in range(cfg.layers)),
              (embeddings, 0.0))
  return GradientProfile(segments, f"per layer, {cfg.layers} x {h} model, seq {seq_len}, "
                         "embeddings (tied decoder) last")


def bucket_sizes(grad_bytes: float, bucket_bytes: float) -> list[float]:
  full, rest = divmod(grad_bytes, bucket_bytes)
  return [bucket_bytes] * int(full) + ([rest] if rest > 1e-9 * grad_bytes else [])


def exposed_s(comm: Callable[[float], float], grad_bytes: float, backward_s: float,
              overlap: str, profile: GradientProfile = UNIFORM,
              bucket_bytes: float = DDP_BUCKET_BYTES) -> tuple[float, float]:
  """(all-reduce seconds issued, seconds of them not hidden behind the last backward pass).

  ``comm(m)``: the all-reduce time of one ``m``-byte message on this cluster.
  """
  if overlap not in OVERLAPS:
    raise ModelError(f"overlap {overlap!r}: expected one of {', '.join(OVERLAPS)}")
  if overlap != "bucketed":
    total = comm(grad_bytes)
    hidden = backward_s if overlap == "backward" else 0.0
    return total, max(0.0, total - hidden)
  positive("bucket size (bytes)", bucket_bytes)
  end, issued, done = 0.0, 0.0, 0.0
  for size in bucket_sizes(grad_bytes, bucket_bytes):
    done += size
    ready = backward_s * profile.ready_at(done / grad_bytes)
    c = comm(size)
    end, issued = max(ready, end) + c, issued + c
  return issued, max(0.0, end - backward_s)
