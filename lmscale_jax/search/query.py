"""Cosine search over a function index: every shard's vectors in one matrix, searched by
:mod:`vector_search` (exact numpy up to its measured size, an approximate HNSW graph above it,
exact at every size when asked). A query is every function of an ELF file, one of them (by name
or address), or pretokenised assembly text."""

from __future__ import annotations

import dataclasses
import difflib
import os

import numpy as np

from lmscale_jax.errors import UserError
from lmscale_jax.inference import model_identity
from lmscale_jax.search import index, index_files, vector_search


@dataclasses.dataclass
class Corpus:
  """The whole index in memory: vectors [N, dim] and, per row, (binary path, name, address).
  ``exact``: search exactly at every size (``lmscale search --exact``); ``index_dir``: where
  the approximate graph is kept (None: in memory only); ``searcher``: made on first use
  (:meth:`prepared`), or given; ``entries``: index.json's binaries, in row order (read once,
  here, so a server does not read index.json again)."""
  vectors: np.ndarray
  binaries: list[str]
  names: list[str]
  addresses: list[int]
  index_dir: str | None = None
  exact: bool = False
  searcher: vector_search.Searcher | None = dataclasses.field(default=None, repr=False)
  entries: list[dict] = dataclasses.field(default_factory=list, repr=False)
  # per row, the digest of its normalised text (index.text_digest); None where the shard was
  # written before digests were kept (its ties are unknown, not absent)
  digests: list[str | None] = dataclasses.field(default_factory=list, repr=False)

  def prepared(self, build: bool = False) -> vector_search.Searcher:
    """The searcher, made once. Above the exact size: the kept HNSW graph of these rows, else
    (``build``: at a server's start, after ``lmscale index``) the graph extended or built and
    kept, or (not ``build``: a one-off search) exact search."""
    if self.searcher is None or (build and not self.searcher.approximate and not self.exact):
      self.searcher = vector_search.Searcher(self.vectors, self.exact, cache_dir=self.index_dir,
                                             build=build)
    return self.searcher


def load(index_dir: str, model) -> Corpus:
  doc = index_files.read(index_dir)
  if doc is None:
    raise UserError(f"{index_dir}: no {index_files.INDEX} (build the index with lmscale index)")
  index.check_model(doc, model_identity.identity(model), index_dir)
  parts, binaries, names, addresses, digests = [], [], [], [], []
  for b in doc["binaries"]:
    vectors, rows = index_files.read_shard(index_dir, b, doc["dim"])
    parts.append(vectors)
    binaries += [b["path"]] * len(rows)
    names += [r["name"] for r in rows]
    addresses += [int(r["address"]) for r in rows]
    digests += [r.get(index_files.TEXT_DIGEST) for r in rows]
  vectors = np.concatenate(parts) if parts else np.zeros((0, doc["dim"]), np.float32)
  return Corpus(vectors, binaries, names, addresses, index_dir=index_dir,
                entries=doc["binaries"], digests=digests)


def top_k(corpus: Corpus, queries: np.ndarray, k: int,
          exact: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
  """(indices [Q, k'], scores [Q, k']) of the k most similar rows, best first (k' = min(k, N)):
  exact up to ``vector_search.EXACT_MAX`` rows or when ``exact`` (default: the corpus's
  choice), else through the kept HNSW graph when there is one (recall@10 >=
  ``vector_search.RECALL_TARGET`` on the index's own rows; :meth:`Corpus.prepared`)."""
  if corpus.exact if exact is None else exact:
    return vector_search.exact_top_k(corpus.vectors, queries, k)
  return corpus.prepared().top_k(queries, k)


def pick(fns: list, path: str, name: str | None, address: int | None) -> list:
  """All of ``fns``, or the one named ``name`` / at ``address``; none such is one line naming
  the closest."""
  if name is not None:
    found = [f for f in fns if f.name == name]
    near = difflib.get_close_matches(name, sorted({f.name for f in fns}), n=3, cutoff=0.0)
    if not found:
      raise UserError(f"{path} has no function named {name!r} (closest: {', '.join(near)})")
    return found[:1]
  if address is not None:
    found = [f for f in fns if f.address == address]
    if not found:
      near = sorted(fns, key=lambda f: abs(f.address - address))[:3]
      raise UserError(f"{path} has no function at {address:#x} (closest: "
                      + ", ".join(f"{f.address:#x} {f.name}" for f in near) + ")")
    return found
  return fns


def elf_queries(path: str, name: str | None = None,
                address: int | None = None) -> list[tuple[str, int | None, str]]:
  """(name, address, text) of the query functions of an ELF file."""
  fns = pick(index.elf_functions_of(path), path, name, address)
  return [(f.name, f.address, f.text) for f in fns]


def search(model, corpus: Corpus, queries: list[tuple[str, int | None, str]], k: int) -> list:
  """Per query: {"query", "address", "tokens", "cut", "results": [{"score", "binary",
  "function", "address"}]}."""
  vectors, encoded = index.embed_texts(model, [(q[0], q[2]) for q in queries])
  return ranked(corpus, queries, vectors, encoded, k)


def ranked(corpus: Corpus, queries: list[tuple[str, int | None, str]], vectors: np.ndarray,
           encoded: list, k: int) -> list:
  """:func:`search`'s answers from the queries' vectors (``index.embed_texts``'s normalised
  vectors and (ids, cut) per query): the server embeds its requests' queries together, in
  shared batches, and ranks each request's here. Each result says which texts it shares
  (:func:`mark_same_text`)."""
  idx, scores = top_k(corpus, vectors, k)
  out = []
  for (qname, qaddr, text), (ids, cut), row, score in zip(queries, encoded, idx, scores):
    results = [{"score": float(s), "binary": corpus.binaries[i], "function": corpus.names[i],
                "address": corpus.addresses[i]} for i, s in zip(row, score)]
    digests = [corpus.digests[i] if corpus.digests else None for i in row]
    out.append({"query": qname, "address": qaddr, "tokens": len(ids) - 2, "cut": bool(cut),
                "results": mark_same_text(results, digests, index.text_digest(text))})
  return out


def mark_same_text(results: list[dict], digests: list, query_digest: str) -> list[dict]:
  """Each result with ``same_text_as``: the 1-based rank of the first result above it whose
  normalised text is the same (identical texts embed to the same vector and score the same:
  thunks, aliases such as gzopen/gzopen64; which of them ranks first is arbitrary), else None;
  and ``same_text_as_query``: its text is the query's. A row of an index written before text
  digests were kept (``digests`` None there) is unknown: None in both."""
  first: dict[str, int] = {}
  for rank, (r, digest) in enumerate(zip(results, digests), 1):
    r["same_text_as"] = first.get(digest) if digest else None
    r["same_text_as_query"] = digest == query_digest if digest else None
    if digest:
      first.setdefault(digest, rank)
  return results


def similarity_warning(model) -> str | None:
  """One line for whoever reads a search's scores where the encoder was not trained for
  similarity (no projection head: MLM pretraining only, a classification fine-tune or an
  export of either), else None. Its mean-pooled vectors share one dominant direction: the
  cosine of unrelated functions comes out near 1 (random pairs of 8,125 indexed functions:
  median 0.968 with demo/run's 50-step model; 0.98-0.99 for the 2nd hits of issue 56's
  model), so only the order of the answers says anything."""
  if model.head is not None:  # a contrastive fine-tune (lmscale finetune), or its export
    return None
  return (f"{model.source} is not fine-tuned for similarity (an encoder with no projection "
          "head): its scores put unrelated functions near 1 too, so read the ranks, not the "
          "scores; for scores that separate, fine-tune it contrastively (lmscale finetune: "
          "docs/finetune.md, docs/similarity.md) and index with that model")
