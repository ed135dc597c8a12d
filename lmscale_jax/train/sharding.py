"""The device mesh and where every array lives on it: batch rows split over the ``data`` axis;
parameters and optimizer moments replicated, or split over it under FSDP (ZeRO-3)."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXIS = "data"
# Leaves with fewer elements stay replicated under FSDP: sharding a bias or a LayerNorm scale
# saves nothing worth a collective.
FSDP_MIN_SIZE = 4096


def data_mesh(devices=None) -> Mesh:
  """A 1-D mesh over every global device (or ``devices``): pure data parallelism."""
  return Mesh(np.asarray(jax.devices() if devices is None else devices), (AXIS,))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batch rows split over the ``data`` axis."""
  return NamedSharding(mesh, PartitionSpec(AXIS))


def fsdp_spec(shape, devices: int) -> PartitionSpec:
  """ZeRO-3/FSDP placement of one parameter / optimizer-moment leaf over ``devices``.

  Split along the largest dimension divisible by the device count (the first such on ties);
  replicated when none divides, or the leaf is small. A parameter and its Adam moments have
  the same shape, hence the same placement.
  """
  if devices <= 1 or math.prod(shape) < FSDP_MIN_SIZE:
    return PartitionSpec()
  dims = [i for i, d in enumerate(shape) if d % devices == 0]
  if not dims:
    return PartitionSpec()
  best = max(dims, key=lambda i: (shape[i], -i))
  return PartitionSpec(*[AXIS if i == best else None for i in range(len(shape))])


def state_specs(abstract_state, devices: int, fsdp: bool):
  """PartitionSpec of every leaf of the train state (all replicated unless ``fsdp``)."""
  return jax.tree.map(lambda a: fsdp_spec(a.shape, devices) if fsdp else PartitionSpec(),
                      abstract_state)


def is_sharded(specs) -> bool:
  """Whether any leaf of a PartitionSpec tree is split over a mesh axis."""
  return any(s != PartitionSpec() for s in jax.tree.leaves(
      specs, is_leaf=lambda x: isinstance(x, PartitionSpec)))
