"""All-reduce time of one message over ``N`` nodes × ``g`` GPUs: ring (flat or hierarchical),
tree, and in-network reduction. Pure arithmetic on :mod:`links`.

``m`` bytes, ``p = N·g`` ranks, a node's network moving ``B(m) = nics·β·e(m)`` per direction,
latency α per message; the intra-node link (α_i, β_i)::

  ring(m, p, α, β)   = 2(p−1)·α + 2(p−1)/p · m/β       textbook bandwidth-optimal ring
  flat               = 2(p−1)·α + 2(p−1)/p · m/B(m)     one ring over all GPUs; each of its
                                                        2(p−1) steps waits on the slowest
                                                        edge, the network (N > 1)
  hierarchical       = 2·half_i + ring(m, N, α, B(m))   reduce inside the node, ring between
                                                        nodes, broadcast inside the node
  tree               = 2·half_i + 2⌈log₂N⌉·α + 2·m/B(m) NCCL's double binary tree between
                                                        nodes (each node sends and receives
                                                        the message twice), chain inside
  in-network         = 2·half_i + 2·α + m/B(m)          the switch reduces (SHARP-style): each
                                                        node sends the message up and gets the
                                                        sum back once, both directions at once
  half_i             = (g−1)·α_i + (g−1)/g · m/β_i      half a ring inside a node
  best               = min(flat, tree) per message      what NCCL's tuner chooses between

On one node every algorithm is the intra-node ring: no network term. The ring's network
traffic per node, 2(p−1)/p·m, barely grows with p, so its time is almost constant in N while
its latency grows linearly; the tree's latency grows as log N for ~the same bytes: trees win
for small messages at large N, rings for large ones.
"""

from __future__ import annotations

import math

from lmscale_jax.study.cluster_model.links import Link, ModelError, Network

ALGORITHMS = ("flat", "hierarchical", "tree", "in-network", "best")


def ring_allreduce_s(grad_bytes: float, ranks: int, alpha: float, beta: float) -> float:
  """Ring all-reduce of ``grad_bytes`` over ``ranks`` ranks on links of (α, β)."""
  if ranks <= 1:
    return 0.0
  return 2 * (ranks - 1) * alpha + 2 * (ranks - 1) / ranks * grad_bytes / beta


def intra_half_s(nbytes: float, gpus: int, intra: Link) -> float:
  """Ring reduce (or broadcast) inside one node: half a ring all-reduce."""
  if gpus <= 1:
    return 0.0
  return (gpus - 1) * intra.latency + (gpus - 1) / gpus * nbytes / intra.bandwidth


def _flat(m: float, nodes: int, gpus: int, net: Network) -> float:
  return ring_allreduce_s(m, nodes * gpus, net.latency, net.bandwidth(m))


def _hierarchical(m: float, nodes: int, gpus: int, net: Network, intra: Link) -> float:
  return 2 * intra_half_s(m, gpus, intra) + ring_allreduce_s(m, nodes, net.latency,
                                                             net.bandwidth(m))


def _tree(m: float, nodes: int, gpus: int, net: Network, intra: Link) -> float:
  depth = math.ceil(math.log2(nodes))
  return (2 * intra_half_s(m, gpus, intra) + 2 * depth * net.latency
          + 2 * m / net.bandwidth(m))


def _in_network(m: float, nodes: int, gpus: int, net: Network, intra: Link) -> float:
  return 2 * intra_half_s(m, gpus, intra) + 2 * net.latency + m / net.bandwidth(m)


def allreduce_s(nbytes: float, nodes: int, gpus: int, net: Network, intra: Link,
                algorithm: str = "flat") -> float:
  """All-reduce time of one ``nbytes`` message over ``nodes`` × ``gpus`` GPUs."""
  if algorithm not in ALGORITHMS:
    raise ModelError(f"all-reduce algorithm {algorithm!r}: expected one of "
                     f"{', '.join(ALGORITHMS)}")
  if nodes == 1:
    return ring_allreduce_s(nbytes, gpus, intra.latency, intra.bandwidth)
  if algorithm == "flat":
    return _flat(nbytes, nodes, gpus, net)
  if algorithm == "best":
    return min(_flat(nbytes, nodes, gpus, net), _tree(nbytes, nodes, gpus, net, intra))
  return {"hierarchical": _hierarchical, "tree": _tree, "in-network": _in_network}[algorithm](
      nbytes, nodes, gpus, net, intra)


def network_s(nbytes: float, nodes: int, gpus: int, net: Network, intra: Link,
              algorithm: str = "flat") -> float:
  """The part of :func:`allreduce_s` spent on the network (0 on one node)."""
  if nodes == 1:
    return 0.0
  intra_part = 0.0 if algorithm == "flat" else 2 * intra_half_s(nbytes, gpus, intra)
  if algorithm == "best":
    tree = _tree(nbytes, nodes, gpus, net, intra)
    if tree < _flat(nbytes, nodes, gpus, net):
      return tree - 2 * intra_half_s(nbytes, gpus, intra)
    return _flat(nbytes, nodes, gpus, net)
  return allreduce_s(nbytes, nodes, gpus, net, intra, algorithm) - intra_part
