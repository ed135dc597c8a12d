"""Binary code similarity detection, the jTrans protocol (Wang et al., ISSTA 2022): for each
query function compiled one way (variant A), rank a pool of N functions compiled another way
(variant B): one positive (the same source function) and N−1 negatives drawn at random from
the other functions of B. Recall@1 and MRR per pool size and per variant pair, both directions
(queries from A into B's pools and from B into A's) pooled into one number per pair.

Methods are matrices of vectors, one row per (group, variant) item, compared by cosine. The
pools are drawn once (seeded), so every method ranks exactly the same pools. Ties count
against the positive (a negative scoring within 1e-6 of it ranks above): a method that cannot
tell two functions apart gets no credit for the order it happened to list them in.

The benchmark's file format and its build: :mod:`lmscale_jax.similarity.bench`.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from lmscale_jax.prep import elf_corpus
from lmscale_jax.similarity.bench import BenchError

TIE = 1e-6


@dataclasses.dataclass
class Items:
  """The benchmark flattened: item i is group ``group[i]`` compiled as ``variant[i]``."""
  group: np.ndarray            # int [n]
  variant: list[str]
  text: list[str]
  digest: list[str]
  index: dict                  # (group, variant) → item

  @classmethod
  def from_groups(cls, groups: list[dict]) -> "Items":
    g, v, t, d, index = [], [], [], [], {}
    for gi, group in enumerate(groups):
      for name in sorted(group["variants"]):
        index[gi, name] = len(g)
        item = group["variants"][name]
        g.append(gi), v.append(name), t.append(item["text"]), d.append(item.get("digest", ""))
    return cls(np.asarray(g, np.int64), v, t, d, index)

  def __len__(self) -> int:
    return len(self.text)

  def of_variant(self, variant: str) -> dict[int, int]:
    """group → item, for the groups compiled as ``variant``."""
    return {g: i for (g, v), i in self.index.items() if v == variant}


# --------------------------------------------------------------------------- methods
def tfidf_vectors(texts: list[str]) -> np.ndarray:
  """Bag-of-pretokens TF-IDF, L2-normalised rows (dense: a few thousand distinct pretokens).

  Written out (15 lines) because scikit-learn is not a dependency; it is sklearn's
  ``TfidfVectorizer(token_pattern=r"\\S+", lowercase=False)`` default: raw counts × smoothed
  idf ``ln((1 + n) / (1 + df)) + 1``."""
  vocab: dict[str, int] = {}
  rows = []
  for t in texts:
    counts = collections.Counter(t.split())
    rows.append({vocab.setdefault(w, len(vocab)): c for w, c in counts.items()})
  m = np.zeros((len(texts), len(vocab)), np.float32)
  for i, r in enumerate(rows):
    m[i, list(r)] = list(r.values())
  df = (m > 0).sum(axis=0)
  m *= (np.log((1 + len(texts)) / (1 + df)) + 1).astype(np.float32)
  return normalise(m)


def normalise(m: np.ndarray) -> np.ndarray:
  m = np.asarray(m, np.float32)
  return m / np.maximum(np.linalg.norm(m, axis=1, keepdims=True), 1e-12)


# --------------------------------------------------------------------------- pairs and pools
def default_pairs(variants: list[str]) -> list[tuple[str, str]]:
  """Every two levels of one compiler, and one level across compilers."""
  split = [v.rsplit("-", 1) for v in variants]
  pairs = []
  for i, (cc_a, lv_a) in enumerate(split):
    for cc_b, lv_b in split[i + 1:]:
      if cc_a == cc_b or lv_a == lv_b:
        pairs.append((f"{cc_a}-{lv_a}", f"{cc_b}-{lv_b}"))
  return pairs


def parse_pairs(spec: str, variants: list[str]) -> list[tuple[str, str]]:
  """``gcc-O0:gcc-O3,gcc-O2:gcc-O2`` → pairs, each variant one the benchmark holds."""
  if not spec:
    return default_pairs(variants)
  out = []
  for part in spec.split(","):
    ab = part.split(":")
    if len(ab) != 2 or not all(x in variants for x in ab):
      raise BenchError(f"--pairs {part!r}: expected A:B with A and B among the benchmark's "
                       f"variants {', '.join(variants)}")
    out.append((ab[0], ab[1]))
  return out


@dataclasses.dataclass
class Pools:
  """For one (pair, direction, N): query items [Q] and pool items [Q, N], positive first."""
  queries: np.ndarray
  pool: np.ndarray


def draw_pools(items: Items, a: str, b: str, n: int, rng: np.random.Generator,
               max_queries: int = 0) -> Pools | None:
  """Queries at ``a``, pools at ``b``; None where ``b`` has fewer than ``n`` functions."""
  at_a, at_b = items.of_variant(a), items.of_variant(b)
  shared = sorted(set(at_a) & set(at_b))
  candidates = np.asarray(sorted(at_b), np.int64)
  if len(candidates) < n or not shared:
    return None
  if max_queries and len(shared) > max_queries:
    shared = sorted(rng.choice(shared, max_queries, replace=False).tolist())
  pool = np.empty((len(shared), n), np.int64)
  for row, g in enumerate(shared):
    others = candidates[candidates != g]
    neg = rng.choice(others, n - 1, replace=False)
    pool[row] = [at_b[g], *(at_b[int(x)] for x in neg)]
  return Pools(np.asarray([at_a[g] for g in shared], np.int64), pool)


def ranks(vectors: np.ndarray, pools: Pools) -> np.ndarray:
  """The positive's rank (1 = first) in each pool by cosine; ties against the positive."""
  q = vectors[pools.queries]                           # [Q, d]
  s = np.einsum("qd,qnd->qn", q, vectors[pools.pool])  # [Q, N]; row 0 is the positive
  return 1 + (s[:, 1:] >= s[:, :1] - TIE).sum(axis=1)


@dataclasses.dataclass
class Result:
  method: str
  pool: int
  pair: str
  queries: int
  recall_at_1: float | None
  mrr: float | None
  note: str = ""

  def row(self) -> dict:
    return dataclasses.asdict(self)


def evaluate(items: Items, methods: dict[str, np.ndarray], pairs: list[tuple[str, str]],
             pool_sizes: list[int], *, seed: int = 0, max_queries: int = 0) -> list[Result]:
  """Every method × pool size × pair (both directions), plus an "all" row per method and
  pool size (every query of every pair)."""
  out = []
  for n in pool_sizes:
    drawn = []
    for a, b in pairs:
      rng = np.random.default_rng([seed, n, *map(ord, f"{a}:{b}")])
      dirs = [p for p in (draw_pools(items, a, b, n, rng, max_queries),
                          draw_pools(items, b, a, n, rng, max_queries) if a != b else None)
              if p is not None]
      drawn.append((f"{a}↔{b}" if a != b else f"{a}={b}", dirs))
    for method, vec in methods.items():
      every = []
      for label, dirs in drawn:
        r = np.concatenate([ranks(vec, p) for p in dirs]) if dirs else np.zeros(0)
        every.append(r)
        out.append(_result(method, n, label, r))
      out.append(_result(method, n, "all", np.concatenate(every)))
  return out


def _result(method: str, n: int, pair: str, r: np.ndarray) -> Result:
  if not len(r):
    return Result(method, n, pair, 0, None, None,
                  note=f"fewer than {n} functions in the variant: pool not drawn")
  return Result(method, n, pair, int(len(r)), float(np.mean(r == 1)), float(np.mean(1 / r)))


def table(results: list[Result]) -> str:
  """Methods × pairs, one block per pool size: ``R@1 / MRR`` per cell."""
  pairs = list(dict.fromkeys(r.pair for r in results))
  methods = list(dict.fromkeys(r.method for r in results))
  width = max(14, *(len(p) + 1 for p in pairs))
  mw = max(8, *(len(m) for m in methods))
  lines = []
  for n in dict.fromkeys(r.pool for r in results):
    cells = {(r.method, r.pair): r for r in results if r.pool == n}
    chance = f"chance R@1 {1 / n:.3f}, MRR {chance_mrr(n):.3f}"
    lines.append(f"pool {n} (1 positive + {n - 1} negatives; {chance}); cells: R@1 / MRR")
    lines.append(f"{'method':<{mw}} " + "".join(f"{p:>{width}}" for p in pairs))
    for m in methods:
      row = [cells.get((m, p)) for p in pairs]
      lines.append(f"{m:<{mw}} " + "".join(
          f"{'n/a':>{width}}" if c is None or c.recall_at_1 is None
          else f"{c.recall_at_1:.3f} / {c.mrr:.3f}".rjust(width) for c in row))
    queries = {p: cells[methods[0], p].queries for p in pairs if (methods[0], p) in cells}
    lines.append(f"{'queries':<{mw}} " + "".join(f"{queries.get(p, 0):>{width}}" for p in pairs))
    lines.append("")
  return "\n".join(lines).rstrip()


def chance_mrr(n: int) -> float:
  return sum(1 / k for k in range(1, n + 1)) / n


# --------------------------------------------------------------------------- leakage
def training_digests(paths: list[str], max_input_bytes: int = 0) -> tuple[set[str], int]:
  """The normalised-text hashes of every function preparation would take from ``paths``
  (the same file list, cap and text as ``prepare``: ``elf_corpus.list_inputs`` and
  ``iter_functions``) → (digests, files)."""
  files = elf_corpus.list_inputs(paths, max_input_bytes)
  digests = set()
  for c in files:
    res = elf_corpus.FileResult(path=c.path, file_bytes=c.size)
    digests.update(d.hex() for d, _ in elf_corpus.iter_functions(c.path, res))
  return digests, len(files)


def overlap(items: Items, digests: set[str]) -> dict:
  """How much of the benchmark the pretraining corpus holds verbatim (same normalised text)."""
  hit = [i for i, d in enumerate(items.digest) if d in digests]
  per_variant = collections.Counter(items.variant[i] for i in hit)
  return {"functions": len(items), "in_training_corpus": len(hit),
          "groups_touched": len({int(items.group[i]) for i in hit}),
          "per_variant": dict(sorted(per_variant.items())),
          "fraction": round(len(hit) / max(1, len(items)), 6)}

