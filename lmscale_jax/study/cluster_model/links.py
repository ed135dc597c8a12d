"""The cluster model's links: a node's network (NICs × line rate, latency, the transport's
efficiency by message size) and the intra-node link, each with a label of exactly what was given.

A link moves ``n`` bytes in ``α + n/β`` (α: one-way latency per message, β: bytes/s per
direction). A node has ``nics`` network ports of one rate; NCCL spreads its rings/trees over
all of them (one channel per NIC, rail-aligned), so the node's network bandwidth is
``nics · β_nic``. What a transport really moves is below line rate and depends on the message:
:class:`TransportCurve` ``e(m)`` multiplies the bandwidth for a collective of ``m`` bytes
(log-linear between measured points, flat beyond them). It applies to the bandwidth term
only; the latency stays ``α`` per algorithm step.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math

from lmscale_jax.errors import UserError
from lmscale_jax.store import file_io


class ModelError(UserError, ValueError):
  """A bad input of the cluster model: the message names the value and what was expected."""


def positive(what: str, value) -> float:
  if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
    raise ModelError(f"{what} {value!r}: expected a positive number")
  return float(value)


@dataclasses.dataclass(frozen=True)
class Link:
  """One direction of one port: ``bandwidth`` bytes/s, ``latency`` seconds per message."""
  name: str
  bandwidth: float
  latency: float

  def describe(self) -> str:
    return (f"{self.name} ({self.bandwidth * 8 / 1e9:g} Gb/s = {self.bandwidth / 1e9:g} GB/s, "
            f"{self.latency * 1e6:g} us)")


def link(name: str, bandwidth: float, latency: float) -> Link:
  """A link from user values, checked: bandwidth > 0 bytes/s, latency ≥ 0 s."""
  positive(f"{name} bandwidth", bandwidth)
  if not (isinstance(latency, (int, float)) and math.isfinite(latency) and latency >= 0):
    raise ModelError(f"{name} latency {latency!r}: expected a number >= 0")
  return Link(name, float(bandwidth), float(latency))


# Network presets: the line rate per direction of one port and a typical one-way small-message
# latency of the transport NCCL uses on it (TCP sockets on plain Ethernet, RDMA on converged
# Ethernet and InfiniBand).
PRESETS = {
    "10gbe": Link("10 GbE", 10e9 / 8, 30e-6),      # TCP sockets
    "25gbe": Link("25 GbE", 25e9 / 8, 10e-6),      # RoCE (the paper's converged Ethernet)
    "100gbe": Link("100 GbE", 100e9 / 8, 5e-6),    # RoCE
    "edr": Link("EDR InfiniBand", 100e9 / 8, 2e-6),  # 4x EDR, 100 Gb/s
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
                     f"{', '.join(PRESETS)} (or --bandwidth-gbit/--latency-us)") from None


# ----------------------------------------------------------------------------- transport
@dataclasses.dataclass(frozen=True)
class TransportCurve:
  """``e(m)``: the share of line rate a collective of ``m`` bytes reaches (bandwidth term)."""
  name: str
  points: tuple[tuple[float, float], ...]  # (bytes, efficiency), bytes ascending
  source: str = ""

  def at(self, nbytes: float) -> float:
    """Log-linear in bytes between the points; the end points' values beyond them."""
    sizes = [b for b, _ in self.points]
    if nbytes <= sizes[0]:
      return self.points[0][1]
    if nbytes >= sizes[-1]:
      return self.points[-1][1]
    i = bisect.bisect_right(sizes, nbytes)
    (b0, e0), (b1, e1) = self.points[i - 1], self.points[i]
    w = math.log(nbytes / b0) / math.log(b1 / b0)
    return e0 + w * (e1 - e0)


def transport_curve(name: str, points, source: str = "") -> TransportCurve:
  """A curve from ``[(bytes, efficiency), …]``, checked: sizes > 0 and distinct, 0 < e ≤ 1.5."""
  try:
    pts = sorted((float(b), float(e)) for b, e in points)
  except (TypeError, ValueError):
    raise ModelError(f"transport curve {name}: expected [bytes, efficiency] pairs") from None
  bad = [p for p in pts if not (p[0] > 0 and 0 < p[1] <= 1.5)]
  if not pts or bad or len({b for b, _ in pts}) != len(pts):
    raise ModelError(f"transport curve {name}: points {bad or pts} must have bytes > 0, "
                     "distinct, and 0 < efficiency <= 1.5")
  return TransportCurve(name, tuple(pts), source)


LINE_RATE = TransportCurve("line rate", ((1.0, 1.0),), "no transport loss (an upper bound)")

# NCCL's all-reduce bus bandwidth against line rate, from published nccl-tests numbers
# (benchmarks/published/multinode_tables.json, "transport"; none was measured here):
# * IB plateau 0.96: 192 GB/s on a DGX A100's 8 x 200 Gb/s (NVIDIA/nccl#1576), "24 GB/s per 200G
#   NIC (12 GB/s for 100G)" (NVIDIA/nccl-tests#119, NVIDIA/nccl#307);
# * its fall below ~32 MB: a 2-node sweep on 4 NICs (NVIDIA/nccl-tests#232, IB verbs with
#   GID index 3, so probably RoCE): 18.5, 27.2, 36.2, 39.9, 41.3 GB/s at 2, 4, 8, 16, 32 MiB,
#   scaled to the plateau. Below 2 MiB the curve stays at its 2 MiB value: the α terms carry
#   the rest (an optimistic bound for tiny buckets);
# * RoCE is NCCL's IB verbs transport over Ethernet: the same curve (no sweep at <= 100 Gb/s
#   was found);
# * TCP sockets: 4-6 GB/s at 8-128 MB on 100 Gb/s (NVIDIA/nccl#450: 0.32-0.48 of line rate).
#   Slower links reach more of theirs: 0.97 of 32 Gb/s with one GPU per node, 0.45-0.72 with
#   eight (NVIDIA/nccl#209); this curve is the pessimistic end.
_IB_SHAPE = ((2 ** 21, 18.53), (2 ** 22, 27.16), (2 ** 23, 36.24), (2 ** 24, 39.90),
             (2 ** 25, 41.31))
_IB = tuple((b, round(0.96 * v / 41.31, 4)) for b, v in _IB_SHAPE)
TRANSPORTS = {
    "line-rate": LINE_RATE,
    "nccl-ib": TransportCurve("NCCL over InfiniBand", _IB, "NVIDIA/nccl#1576, nccl-tests#119 "
                              "and #232: 0.96 of line rate from 32 MiB, 0.43 at 2 MiB"),
    "nccl-roce": TransportCurve("NCCL over RoCE", _IB, "as nccl-ib (IB verbs over Ethernet; "
                                "nccl-tests#232)"),
    "nccl-socket": TransportCurve("NCCL over TCP sockets", ((8e6, 0.32), (1.28e8, 0.48)),
                                  "NVIDIA/nccl#450: 4-6 GB/s at 8-128 MB on 100 Gb/s TCP"),
}


def default_transport(nic: Link) -> TransportCurve:
  """The transport NCCL reaches on this kind of NIC (line rate for a link it has no curve for)."""
  return TRANSPORTS.get(DEFAULT_TRANSPORT.get(nic.name, "line-rate"), LINE_RATE)


# preset -> the transport NCCL uses on it (presets' latencies assume the same)
DEFAULT_TRANSPORT = {"10 GbE": "nccl-socket", "25 GbE": "nccl-roce", "100 GbE": "nccl-roce",
                     "EDR InfiniBand": "nccl-ib", "HDR InfiniBand": "nccl-ib",
                     "NDR InfiniBand": "nccl-ib"}


def load_transport(path: str) -> TransportCurve:
  """The last ``transport-curve`` row of a ``benchmarks/bench_allreduce.py`` output (heap=keep
  runs), i.e. the transport efficiency this machine's loopback all-reduce reached per size."""
  rows = read_jsonl(path, "--transport")
  curves = [r for r in rows if r.get("kind") == "transport-curve"
            and r.get("heap", "keep") == "keep"]
  if not curves:
    raise ModelError(f"--transport {path}: no transport-curve row of a heap=keep run (expected "
                     "the output of benchmarks/bench_allreduce.py)")
  return transport_curve(f"measured ({path.rsplit('/', 1)[-1]})", curves[-1]["points"],
                         f"{path}, {curves[-1].get('date', 'undated')}")


def read_jsonl(path: str, flag: str) -> list[dict]:
  """Every row of a JSON-lines results file given by ``flag`` (``store.file_io.read_jsonl``)."""
  return file_io.read_jsonl(path, f"the results file of {flag}", ModelError)


# ----------------------------------------------------------------------------- a node's network
@dataclasses.dataclass(frozen=True)
class Network:
  """A node's network: ``nics`` ports of ``nic``, the transport's curve, and what was given."""
  nic: Link
  nics: int = 1
  transport: TransportCurve = LINE_RATE
  given: tuple[str, ...] = ()  # how each value was set, for the label

  @property
  def latency(self) -> float:
    return self.nic.latency

  def bandwidth(self, nbytes: float) -> float:
    """Bytes/s per direction the node moves in a collective of ``nbytes``."""
    return self.nics * self.nic.bandwidth * self.transport.at(nbytes)

  def describe(self) -> str:
    rate = self.nic.bandwidth * 8 / 1e9
    head = (f"{self.nics} x {rate:g} Gb/s = {self.nics * rate:g} Gb/s per node"
            if self.nics > 1 else f"{rate:g} Gb/s per node")
    return (f"{head}, {self.nic.latency * 1e6:g} us; transport {self.transport.name}"
            + (f" [{'; '.join(self.given)}]" if self.given else ""))


def network(nic: Link, nics: int = 1, transport: TransportCurve = LINE_RATE,
            given=()) -> Network:
  if not (isinstance(nics, int) and nics >= 1):
    raise ModelError(f"NICs per node {nics!r}: expected an integer >= 1")
  return Network(nic, nics, transport, tuple(given))
