"""Where a single-node preparation's decisions fall, computed from line lengths alone, so the
cluster stages (``cluster_stages``) reproduce its output byte for byte without its serial pass.

Single-node pass 1 appends the kept lines to corpus chunks and closes a chunk after a whole input
file once it holds ``chunk_mb`` (``corpus_extract.extract``); pass 2 samples every k-th line
(``corpus_extract.iter_texts``); pass 3 cuts each chunk into pieces ending at line ends
(``shard_writer.pieces``). Each is a function of the kept lines' byte lengths in input order;
these are the same functions over a numpy array of those lengths.
"""

from __future__ import annotations

import numpy as np


def balanced_ranges(weights: list[float], n: int) -> list[tuple[int, int]]:
  """``n`` contiguous index ranges of ``weights`` of about equal weight (none empty when
  ``n <= len(weights)``)."""
  n = max(1, min(n, len(weights)))
  cum = np.cumsum(np.asarray(weights, np.float64))
  total = cum[-1] if len(cum) else 0.0
  bounds = [0]
  for k in range(1, n):
    at = int(np.searchsorted(cum, total * k / n, side="left")) + 1
    bounds.append(min(max(at, bounds[-1] + 1), len(weights) - (n - k)))
  bounds.append(len(weights))
  return [(bounds[k], bounds[k + 1]) for k in range(n)]


def chunk_lines(file_lines: np.ndarray, file_bytes: np.ndarray,
                chunk_bytes: float) -> list[tuple[int, int]]:
  """The chunks as kept-line ranges: after each input file (its kept ``file_lines`` lines of
  ``file_bytes`` bytes) the chunk closes once it holds ``chunk_bytes``, except after the last
  file (that chunk closes at the end, however small)."""
  out, start, line, size = [], 0, 0, 0
  last = len(file_lines) - 1
  for i, (n, b) in enumerate(zip(file_lines.tolist(), file_bytes.tolist())):
    line += n
    size += b
    if size >= chunk_bytes and i < last:
      out.append((start, line))
      start, size = line, 0
  out.append((start, line))
  return out


def piece_lines(line_ends: np.ndarray, piece_bytes: int) -> list[int]:
  """One chunk's pieces as the line counts at which they end: a piece ends at the end of the
  line holding byte ``start + piece_bytes`` (``line_ends``: each line's end offset in the
  chunk, ascending)."""
  size = int(line_ends[-1]) if len(line_ends) else 0
  out, start = [], 0
  while start < size:
    q = min(start + piece_bytes, size)
    line = len(line_ends) if q == size else int(np.searchsorted(line_ends, q, side="right")) + 1
    out.append(line)
    start = int(line_ends[line - 1])
  return out


def sample_stride(total_bytes: int, limit_bytes: int) -> int:
  """Every how many lines the tokenizer sample takes one (``corpus_extract.iter_texts``)."""
  return max(1, -(-total_bytes // max(1, limit_bytes)))
