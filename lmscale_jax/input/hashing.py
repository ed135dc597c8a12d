"""Counter-based randomness for the loader: keyed 64/32-bit hashes and a keyed permutation.

Everything here is a pure function of ``(seed, stream, counter)``: no generator state, so a
value depends neither on how many were drawn before nor on the batch size or worker count,
and a restored loader reproduces the same batches bit for bit. :mod:`lmscale_jax.input.masking`
draws its masks from :func:`row_keys`; :mod:`lmscale_jax.input.grain_pipeline` shuffles records
with :func:`feistel_permute`. The ``STREAM_*`` constants are the independent key streams, kept
here together so that no two uses share one.
"""

from __future__ import annotations

import numpy as np

U64 = np.uint64
GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
# Hash streams: independent keys for the shuffle and for the two masking draws.
STREAM_SHUFFLE, STREAM_SELECT, STREAM_ACTION = 0x5348, 0x5345, 0x4143
_FEISTEL_ROUNDS = 4


def mix64_int(z: int) -> int:
  """splitmix64 finaliser on a Python int (for scalar keys: no numpy overflow warnings)."""
  z &= _MASK64
  z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
  z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
  return z ^ (z >> 31)


def mix64(z: np.ndarray) -> np.ndarray:
  """splitmix64 finaliser, vectorised; modifies and returns ``z`` (uint64, wraps mod 2**64)."""
  z ^= z >> U64(30)
  z *= U64(0xBF58476D1CE4E5B9)
  z ^= z >> U64(27)
  z *= U64(0x94D049BB133111EB)
  z ^= z >> U64(31)
  return z


def fmix32(h: np.ndarray) -> np.ndarray:
  """murmur3 32-bit finaliser (a bijection of uint32), in place."""
  h ^= h >> np.uint32(16)
  h *= np.uint32(0x85EBCA6B)
  h ^= h >> np.uint32(13)
  h *= np.uint32(0xC2B2AE35)
  h ^= h >> np.uint32(16)
  return h


def stream_key(seed: int, stream: int) -> int:
  """The 64-bit key of hash stream ``stream`` (a ``STREAM_*``) under ``seed``."""
  return mix64_int(mix64_int(seed) ^ mix64_int(stream + GOLDEN))


def row_keys(key: int, positions: np.ndarray) -> np.ndarray:
  """One 64-bit key per global stream position."""
  return mix64(positions.astype(np.uint64) * U64(GOLDEN) + U64(key))


def _identity(value):
  return value


def _wrap64(value: int) -> int:
  return value & _MASK64


# Kept rather than grain.experimental.index_shuffle (also a Feistel network with
# cycle-walking) because it is faster for the loader. benchmarks/bench_loader.py
# --compare-shuffle, one run, seq 512, batch 184, in-process, 2-core AMD EPYC, 6 alternating
# 2 s rounds each: the loader's batch function 100.0k samples/s with feistel_permute, 75.9k
# with index_shuffle (-24%); the permutation alone 134 vs 693 us per batch. index_shuffle
# takes one index per (pybind) call, ~3.8 us each, this is vectorised over the batch.
def feistel_permute(index: np.ndarray, n: int, seed: int, epoch: np.ndarray) -> np.ndarray:
  """``perm_{seed,epoch}(index)``: a pseudo-random permutation of ``[0, n)``, vectorised.

  A Feistel network on ``bits = bit_length(n - 1)`` bits (halves of alternating width) is a
  bijection of ``[0, 2**bits)``; cycle-walking (re-applying it while the value is ``>= n``)
  restricts it to a bijection of ``[0, n)``. Since ``2**bits < 2n`` a walk takes < 2 steps on
  average. ``epoch`` (same shape as ``index``) selects the round keys, so elements of two
  epochs can be permuted in one call. Stateless and O(len(index)): no per-epoch permutation
  table, so it costs the same for any dataset size.
  """
  index = np.asarray(index, np.int64)
  if n <= 1:
    return np.zeros_like(index)
  bits = max(2, (n - 1).bit_length())
  base = stream_key(seed, STREAM_SHUFFLE)
  epochs = np.asarray(epoch, np.int64).astype(np.uint64)
  round_keys = [mix64(epochs * U64(GOLDEN) + U64((base + r * 0x632BE59BD9B4E019) & _MASK64))
                for r in range(_FEISTEL_ROUNDS)]
  value = _feistel(index.astype(np.uint64), round_keys, bits, U64, _identity)
  outside = np.nonzero(value >= U64(n))[0]
  # Cycle-walk: vectorised while many elements remain; the last few (the geometric tail of
  # walk lengths) in Python ints, where a walk costs ~2 us instead of ~50 us of numpy calls.
  while outside.size > 8:
    value[outside] = _feistel(value[outside], [rk[outside] for rk in round_keys], bits, U64,
                              _identity)
    outside = outside[value[outside] >= U64(n)]
  for element in outside.tolist():
    keys, walked = [int(rk[element]) for rk in round_keys], int(value[element])
    while walked >= n:
      walked = _feistel(walked, keys, bits, int, _wrap64)
    value[element] = walked
  return value.astype(np.int64)


def _feistel(x, round_keys, bits: int, u, wrap):
  """Feistel network on ``bits``-bit values: uint64 arrays (``u=np.uint64``, no ``wrap``: numpy
  wraps) or Python ints (``u=int``, ``wrap`` masks to 64 bits); constants are converted with
  ``u`` because numpy ops with Python-int operands are 2-4x slower.

  State (hi, lo) -> (lo, hi ^ F(lo)) is invertible whatever F is; the halves' widths swap
  each round, so odd ``bits`` works. F: multiplicative hash of ``lo ^ key``, top bits.
  """
  m1, m2, s32 = u(0xBF58476D1CE4E5B9), u(0x94D049BB133111EB), u(32)
  lo_bits = bits // 2
  hi, lo = x >> u(lo_bits), x & u((1 << lo_bits) - 1)
  for rk in round_keys:
    hi_bits = bits - lo_bits
    z = wrap((lo ^ rk) * m1)
    z ^= z >> s32
    z = wrap(z * m2)
    hi, lo = lo, hi ^ (z >> u(64 - hi_bits))
    lo_bits = hi_bits
  return (hi << u(lo_bits)) | lo
