"""Top-k inner-product search over an index's vectors (L2-normalised: the score is the cosine):
exact numpy up to EXACT_MAX rows, an approximate faiss HNSW graph above it.

Why there (benchmarks/bench_search.py, docs/performance.md "Search: speed and size", 2 busy
cores): exact numpy costs ~38 ms a query and ~1 s for a binary's 256 functions at 100k
functions, ~0.2-0.4 s a query and ~29 s for 256 at 1M (dim 768; at dim 64 the per-row
argpartition keeps 100k at ~16 ms / 0.8 s, so the threshold counts rows). HNSW answers in
0.5 ms at 100k × 768 and 7 ms at 1M × 64 with recall@10 >= 0.99 against the exact top 10.
Why HNSW, not IVF: IVF builds faster, but reaching recall 0.99 at 1M took nprobe 256 of 1,024
lists (81 ms a query at dim 768, recall 0.985); faiss's exact IndexFlatIP was slower than
numpy here, so exact stays numpy (the same results as before, ties included).

The HNSW graph (``IndexHNSWFlat``, METRIC_INNER_PRODUCT, M 32) is kept in the index directory,
``INDEX_DIR/ann/hnsw.faiss`` with ``hnsw.json`` naming the rows it holds (their count and the
sha256 of their vectors): building it is the slow part (70 s at 100k × 768, 575 s at 1M × 64),
reading it back takes about a second. So it is built where it pays, once for many queries
(``build=True``: after ``lmscale index``, at a server's start); a one-off search
(``build=False``) uses a kept graph of exactly the index's rows, or searches exactly (building
costs what 1,800 exact queries do at 100k × 768, 9,800 at 1M × 64). Binaries added to the
index later are rows appended at the end (``index.build`` appends), so a graph whose rows are a
prefix of the index's gets only the new rows added. A graph that is unreadable or of other
rows is rebuilt (it is a cache: nothing is lost); an index directory that cannot be written
keeps the graph in memory. ``efSearch`` is the smallest of EF_SEARCH whose recall@10 reaches
RECALL_TARGET on the index's own rows (:func:`extend`), measured each time rows are added.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from lmscale_jax.store import file_io

# Floats in one [queries, N] score block: 2**26 × 4 bytes = 256 MiB (and argpartition's int64
# indices twice that). At N <= 65,536 that is 1,024 queries per product, as before; at 1M
# functions 67 (1,024 would be 4 GiB of scores and 8 GiB of indices).
SCORES_PER_PRODUCT = 1 << 26
EXACT_MAX = 100_000  # rows up to which search is exact (see above)
RECALL_TARGET = 0.99
EF_SEARCH = (64, 128, 256, 512, 1024)
HNSW_M = 32
CALIBRATION = 256
ANN_DIR = "ann"
GRAPH = "hnsw.faiss"
GRAPH_META = "hnsw.json"


def queries_per_product(n: int) -> int:
  return max(1, min(1024, SCORES_PER_PRODUCT // max(n, 1)))


def exact_top_k(vectors: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
  """(indices [Q, k'], scores [Q, k']) of the k best rows of ``vectors`` per query, best first
  (k' = min(k, N)); numpy, exact."""
  k = min(k, len(vectors))
  step = queries_per_product(len(vectors))
  idx, scores = [], []
  for start in range(0, len(queries), step):
    s = queries[start:start + step] @ vectors.T
    part = np.argpartition(-s, k - 1, axis=1)[:, :k] if k else np.zeros((len(s), 0), int)
    order = np.take_along_axis(s, part, 1).argsort(axis=1, kind="stable")[:, ::-1]
    best = np.take_along_axis(part, order, 1)
    idx.append(best)
    scores.append(np.take_along_axis(s, best, 1))
  if not idx:
    return np.zeros((0, k), np.int64), np.zeros((0, k), np.float32)
  return np.concatenate(idx), np.concatenate(scores)


def rows_digest(vectors: np.ndarray) -> str:
  return hashlib.sha256(np.ascontiguousarray(vectors, np.float32).data).hexdigest()


class Searcher:
  """Search over ``vectors`` [N, dim]: exact where ``exact`` or N <= ``exact_max`` (default
  EXACT_MAX), else through an HNSW graph (read from, or built into, ``cache_dir`` when one is
  given)."""

  def __init__(self, vectors: np.ndarray, exact: bool = False, exact_max: int | None = None,
               cache_dir: str | None = None, recall_target: float = RECALL_TARGET,
               build: bool = True):
    self.vectors = vectors
    self.recall_target = recall_target
    self.graph = None
    self.recall = 1.0  # recall@10 of the search (1.0: exact)
    self.graph_recall = None  # recall@10 the graph reached, used or not
    if not exact and len(vectors) > (EXACT_MAX if exact_max is None else exact_max):
      self.graph = self._load_or_build(cache_dir, build)

  @property
  def approximate(self) -> bool:
    return self.graph is not None

  def top_k(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """As :func:`exact_top_k`; approximate when a graph was built (recall ~ ``recall``)."""
    k = min(k, len(self.vectors))
    if self.graph is None or len(queries) == 0 or k <= 0:
      return exact_top_k(self.vectors, queries, k)
    scores, idx = self.graph.search(np.ascontiguousarray(queries, np.float32), k)
    short = (idx < 0).any(axis=1)  # fewer than k reached: those queries exactly
    if short.any():
      idx[short], scores[short] = exact_top_k(self.vectors, queries[short], k)
    return idx.astype(np.int64), scores

  # ------------------------------------------------------------------------- the graph
  def _load_or_build(self, cache_dir: str | None, build: bool):
    """The kept graph of exactly these rows; else (``build``) it extended or a new one built
    and kept, or (not ``build``) None: exact search. A graph short of the recall target even
    at the largest efSearch is kept (not rebuilt each time) but not used: search is exact
    (measured: uniform random 768-d vectors, no neighbourhoods to follow, 0.66 at 1,024)."""
    where = os.path.join(cache_dir, ANN_DIR) if cache_dir else None
    graph, meta = _read_graph(where, self.vectors)
    if graph is not None and meta["rows"] == len(self.vectors):
      graph.hnsw.efSearch = meta["efSearch"]
      return self._use(graph, meta["recall_at_10"])
    if not build:
      return None
    if graph is None:
      graph = _new_graph(self.vectors.shape[1])
    ef, got = extend(graph, self.vectors, self.recall_target)
    _write_graph(where, graph, {"rows": len(self.vectors), "sha256": rows_digest(self.vectors),
                                "efSearch": ef, "recall_at_10": got, "M": HNSW_M})
    return self._use(graph, got)

  def _use(self, graph, recall: float):
    self.graph_recall = recall
    if recall < self.recall_target:
      return None
    self.recall = recall
    return graph


def _new_graph(dim: int):
  import faiss

  return faiss.IndexHNSWFlat(dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)


def _read_graph(where: str | None, vectors: np.ndarray):
  """(graph, meta) of the kept graph when its rows are ``vectors``' first rows; (None, None)
  otherwise."""
  import faiss

  if where is None:
    return None, None
  try:
    with open(os.path.join(where, GRAPH_META)) as f:
      meta = json.load(f)
    n = int(meta["rows"])
    if not 0 < n <= len(vectors) or meta["sha256"] != rows_digest(vectors[:n]):
      return None, None
    graph = faiss.read_index(os.path.join(where, GRAPH))
  except (TypeError, OSError, ValueError, KeyError, RuntimeError):  # none, unreadable, foreign
    return None, None
  if graph.ntotal != n or graph.d != vectors.shape[1]:
    return None, None
  return graph, meta


def _write_graph(where: str | None, graph, meta: dict) -> None:
  """Graph first, then the JSON naming its rows (a crash between leaves a JSON that does not
  match: rebuilt); a directory that cannot be written keeps the graph in memory only."""
  import faiss

  if where is None:
    return
  path = os.path.join(where, GRAPH)
  try:
    os.makedirs(where, exist_ok=True)
    faiss.write_index(graph, f"{path}.{os.getpid()}.tmp")  # no serialised copy in memory
    os.replace(f"{path}.{os.getpid()}.tmp", path)
    file_io.atomic_write_json(os.path.join(where, GRAPH_META), meta)
  except (OSError, RuntimeError):  # faiss reports a failed write as RuntimeError
    pass


def extend(graph, vectors: np.ndarray, target: float) -> tuple[int, float]:
  """Adds the rows of ``vectors`` the graph lacks; (efSearch, recall@10): the smallest of
  EF_SEARCH whose recall@10 reaches ``target``, else the largest. Measured on the last
  CALIBRATION new rows, searched as queries before they are added: new queries, as a search's
  are (bench_search: 0.993 / 0.994 here, 0.994 / 0.990 on its queries, 100k × 768 / 1M × 64).
  With fewer new rows, on rows already in the graph, each left out of its own neighbours (a
  row in the graph is found more easily than a new query), and one step of EF_SEARCH more."""
  held = len(vectors) - CALIBRATION
  if held - graph.ntotal >= 0 and held >= CALIBRATION:
    graph.add(np.ascontiguousarray(vectors[graph.ntotal:held], np.float32))
    queries = np.ascontiguousarray(vectors[held:], np.float32)
    truth = [list(r) for r in exact_top_k(vectors[:held], queries, 10)[0]]
    ef, got = _smallest_ef(graph, queries, truth, target, lambda found: found)
    graph.add(queries)
    return ef, got
  graph.add(np.ascontiguousarray(vectors[graph.ntotal:], np.float32))
  rows = np.random.default_rng(0).choice(len(vectors), min(CALIBRATION, len(vectors)),
                                         replace=False)
  truth = _others(exact_top_k(vectors, vectors[rows], 11)[0], rows)
  ef, got = _smallest_ef(graph, vectors[rows], truth, target, lambda found: _others(found, rows))
  ef = EF_SEARCH[min(EF_SEARCH.index(ef) + 1, len(EF_SEARCH) - 1)]
  graph.hnsw.efSearch = ef
  return ef, got


def _smallest_ef(graph, queries: np.ndarray, truth: list, target: float, keep) -> tuple[int, float]:
  got = 0.0
  for ef in EF_SEARCH:
    graph.hnsw.efSearch = ef
    found = keep(graph.search(np.ascontiguousarray(queries, np.float32), 11)[1])
    got = float(np.mean([len(set(f[:10]) & set(t)) / max(len(t), 1)
                         for f, t in zip(found, truth)]))
    if got >= target:
      return ef, round(got, 4)
  return EF_SEARCH[-1], round(got, 4)


def _others(idx: np.ndarray, rows: np.ndarray) -> list[list[int]]:
  """Each row's first 10 neighbours other than itself."""
  return [[int(i) for i in found if i != row and i >= 0][:10] for found, row in zip(idx, rows)]
