"""Exact and approximate top-k (lmscale_jax/search/vector_search.py) on synthetic L2-normalised
vectors, the approximate side switched on by a lowered size threshold (``exact_max``)."""

from __future__ import annotations

import json
import os

import numpy as np

from lmscale_jax.search import query, vector_search

DIM = 32


def unit(x: np.ndarray) -> np.ndarray:
  return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def clustered(n: int, seed: int = 0, spread: float = 0.3) -> np.ndarray:
  """n vectors around n // 50 random centres (cosine ~0.96 to their centre)."""
  rng = np.random.default_rng(seed)
  centres = unit(rng.standard_normal((max(n // 50, 1), DIM)))
  noise = rng.standard_normal((n, DIM)) * spread / DIM ** 0.5
  return unit(centres[rng.integers(0, len(centres), n)] + noise)


def corpus(vectors: np.ndarray, **searcher) -> query.Corpus:
  n = len(vectors)
  return query.Corpus(vectors, ["b"] * n, [f"f{i}" for i in range(n)], list(range(n)),
                      searcher=vector_search.Searcher(vectors, **searcher) if searcher else None)


def before(vectors: np.ndarray, queries: np.ndarray, k: int):
  """query.top_k as it was before vector_search (one [1024, N] product per query batch)."""
  k = min(k, len(vectors))
  s = queries @ vectors.T
  part = np.argpartition(-s, k - 1, axis=1)[:, :k]
  order = np.take_along_axis(s, part, 1).argsort(axis=1, kind="stable")[:, ::-1]
  best = np.take_along_axis(part, order, 1)
  return best, np.take_along_axis(s, best, 1)


def recall_at_10(found: np.ndarray, truth: np.ndarray) -> float:
  return float(np.mean([len(set(f) & set(t)) / 10 for f, t in zip(found[:, :10], truth)]))


def test_below_the_threshold_search_is_exact_and_as_before():
  vectors = clustered(3000)
  queries = clustered(40, seed=1)
  c = corpus(vectors)
  assert len(vectors) <= vector_search.EXACT_MAX and not c.prepared().approximate
  for k in (1, 10, 3000, 5000):  # k past N: all N rows, best first
    idx, scores = query.top_k(c, queries, k)
    want_idx, want_scores = before(vectors, queries, k)
    np.testing.assert_array_equal(idx, want_idx)
    np.testing.assert_array_equal(scores, want_scores)
    assert idx.shape == (40, min(k, 3000)) and (np.diff(scores, axis=1) <= 0).all()


def test_ties_keep_the_order_they_had():
  vectors = unit(np.repeat(np.eye(4, DIM), 3, axis=0))  # each direction three times
  queries = vectors[[0, 4, 11]]
  for k in (2, 3, 7):
    np.testing.assert_array_equal(query.top_k(corpus(vectors), queries, k)[0],
                                  before(vectors, queries, k)[0])


def test_many_queries_against_a_large_index_go_in_bounded_blocks():
  assert vector_search.queries_per_product(65_536) == 1024  # as before up to 64k rows
  assert vector_search.queries_per_product(1_000_000) == 67  # 256 MiB of scores per block
  vectors = clustered(2000)
  queries = clustered(300, seed=2)
  old = vector_search.SCORES_PER_PRODUCT
  try:
    vector_search.SCORES_PER_PRODUCT = 2000 * 7  # 7 queries per product
    got = vector_search.exact_top_k(vectors, queries, 5)
  finally:
    vector_search.SCORES_PER_PRODUCT = old
  np.testing.assert_array_equal(got[0], before(vectors, queries, 5)[0])


def test_exact_and_approximate_agree_on_the_best_of_well_separated_vectors():
  vectors = clustered(4000, spread=0.05)
  queries = unit(vectors[::37] + np.random.default_rng(3).standard_normal((109, DIM)) * 1e-3)
  approx = corpus(vectors, exact_max=1000)
  assert approx.prepared().approximate
  exact_best = query.top_k(approx, queries, 1, exact=True)[0][:, 0]
  np.testing.assert_array_equal(exact_best, np.arange(0, 4000, 37))
  np.testing.assert_array_equal(query.top_k(approx, queries, 1)[0][:, 0], exact_best)


def test_approximate_recall_at_10_reaches_the_target_above_the_threshold():
  both = clustered(6200, spread=1.0)  # queries: new members of the index's clusters
  vectors, queries = both[:6000], both[6000:]
  s = vector_search.Searcher(vectors, exact_max=1000)
  assert s.approximate and s.recall >= vector_search.RECALL_TARGET
  truth = vector_search.exact_top_k(vectors, queries, 10)[0]
  idx, scores = s.top_k(queries, 10)
  assert recall_at_10(idx, truth) >= vector_search.RECALL_TARGET
  assert (np.diff(scores, axis=1) <= 1e-6).all()  # best first
  np.testing.assert_allclose(scores, np.take_along_axis(queries @ vectors.T, idx, 1), atol=1e-5)
  idx, scores = s.top_k(queries[:3], 7000)  # k past N: every row once
  assert idx.shape == (3, 6000) and all(sorted(r) == list(range(6000)) for r in idx)


def test_exact_can_be_forced_above_the_threshold():
  vectors = clustered(3000)
  queries = clustered(20, seed=5)
  assert not vector_search.Searcher(vectors, exact=True, exact_max=1000).approximate
  c = query.Corpus(vectors, ["b"] * 3000, ["f"] * 3000, list(range(3000)), exact=True)
  np.testing.assert_array_equal(query.top_k(c, queries, 10)[0], before(vectors, queries, 10)[0])


# --------------------------------------------------------------------------- the kept graph
def test_the_graph_is_kept_reused_extended_and_rebuilt_when_damaged(tmp_path):
  vectors = clustered(3000)
  queries = clustered(50, seed=6)
  first = vector_search.Searcher(vectors[:2000], exact_max=1000, cache_dir=str(tmp_path))
  graph = tmp_path / "ann" / "hnsw.faiss"
  meta = json.loads((tmp_path / "ann" / "hnsw.json").read_text())
  assert meta["rows"] == 2000 and meta["recall_at_10"] == first.recall
  mtime = os.stat(graph).st_mtime_ns
  again = vector_search.Searcher(vectors[:2000], exact_max=1000, cache_dir=str(tmp_path))
  assert os.stat(graph).st_mtime_ns == mtime  # read back, not rebuilt
  np.testing.assert_array_equal(again.top_k(queries, 10)[0], first.top_k(queries, 10)[0])
  grown = vector_search.Searcher(vectors, exact_max=1000, cache_dir=str(tmp_path))
  assert grown.graph.ntotal == 3000  # the 1,000 new rows added to the kept graph
  assert json.loads((tmp_path / "ann" / "hnsw.json").read_text())["rows"] == 3000
  truth = vector_search.exact_top_k(vectors, queries, 10)[0]
  assert recall_at_10(grown.top_k(queries, 10)[0], truth) >= vector_search.RECALL_TARGET
  graph.write_bytes(b"not a faiss index")
  rebuilt = vector_search.Searcher(vectors, exact_max=1000, cache_dir=str(tmp_path))
  assert rebuilt.graph.ntotal == 3000 and graph.read_bytes() != b"not a faiss index"
  other = clustered(3000, seed=9)  # other rows: not reused
  assert vector_search.Searcher(other, exact_max=1000, cache_dir=str(tmp_path)).top_k(
      other[:1], 1)[0][0, 0] == 0


def test_an_index_directory_that_cannot_be_written_keeps_the_graph_in_memory(tmp_path):
  (tmp_path / "file").write_text("")  # a path under a file: no directory can be made there
  s = vector_search.Searcher(clustered(2000), exact_max=1000, cache_dir=str(tmp_path / "file"))
  assert s.approximate and s.top_k(s.vectors[:1], 1)[0][0, 0] == 0


def test_a_one_off_search_uses_a_kept_graph_and_never_builds_one(tmp_path):
  vectors = clustered(3000)
  once = dict(exact_max=1000, cache_dir=str(tmp_path), build=False)
  assert not vector_search.Searcher(vectors, **once).approximate
  assert not os.path.exists(tmp_path / "ann")  # exact, nothing built
  vector_search.Searcher(vectors, exact_max=1000, cache_dir=str(tmp_path))  # built and kept
  assert vector_search.Searcher(vectors, **once).approximate
  grown = np.concatenate([vectors, clustered(10, seed=7)])  # rows appended since: exact
  assert not vector_search.Searcher(grown, **once).approximate


def test_a_graph_short_of_the_recall_target_is_kept_but_search_stays_exact(tmp_path):
  """A target no graph reaches (1.01) stands for one a graph misses at every efSearch (as on
  uniform random 768-d vectors, measured 0.66): kept, so not rebuilt, and not used."""
  vectors = unit(np.random.default_rng(8).standard_normal((4000, DIM)))
  s = vector_search.Searcher(vectors, exact_max=1000, cache_dir=str(tmp_path), recall_target=1.01)
  assert not s.approximate and s.recall == 1.0 and s.graph_recall < 1.01
  assert (tmp_path / "ann" / "hnsw.json").exists()
  again = vector_search.Searcher(vectors, exact_max=1000, cache_dir=str(tmp_path), build=False,
                                 recall_target=1.01)
  assert not again.approximate and again.graph_recall == s.graph_recall
  queries = vectors[:5]
  np.testing.assert_array_equal(s.top_k(queries, 3)[0], before(vectors, queries, 3)[0])
