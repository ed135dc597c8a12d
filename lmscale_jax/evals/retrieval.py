"""Binary code similarity detection, the jTrans protocol (Wang et al., ISSTA 2022): for each
query function compiled one way (variant A), rank a pool of N functions compiled another way
(variant B): one positive (the same source function) and N−1 negatives drawn at random from
the other functions of B. Recall@1 and MRR per pool size and per variant pair, both directions
(queries from A into B's pools and from B into A's) pooled into one number per pair.

A direction needs N functions at its pool's side: where only one side of a pair has them, the
pair is scored in the other direction only, and says so (``Result.directions``, ``left_out``,
a † in the table). The "all" number pools only pairs scored in every direction they have
(both; one for A=A), so it never averages a one-direction cell with two-direction ones
silently: a one-direction cell has half the queries, and O3→O0 is not the task O0→O3 is.

Methods are matrices of vectors, one row per (group, variant) item, compared by cosine. The
pools are drawn once (seeded), so every method ranks exactly the same pools. Ties count
against the positive (a negative scoring within 1e-6 of it ranks above): a method that cannot
tell two functions apart gets no credit for the order it happened to list them in.

The benchmark's file format and its build: :mod:`lmscale_jax.similarity.function_groups`.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from lmscale_jax import progress as progress_lib
from lmscale_jax.prep.elf import elf_corpus
from lmscale_jax.similarity.function_groups import FunctionGroupsError

TIE = 1e-6
# The most memory one block of a pool's gathered vectors may take while it is ranked: all
# queries at once took Q × N × d × 4 bytes (1,700 × 1,000 × 128: 0.9 GB for a model, many GB
# for TF-IDF's thousands of pretokens); blocks of queries give bitwise the same scores.
BLOCK_BYTES = 1 << 28
# Pools over this size are ranked by one product per block of queries (ranks): gathering each
# query's pool of 10,000 TF-IDF rows (839 pretokens on eval3) was 34 MB a query, 1.7 TB for
# eval3's 52,000 queries; the pools up to 1,000 (eval, eval2) keep the path they were
# measured with.
PRODUCT_POOL = 1000
ONE_WAY = "†"  # the table's mark of a pair scored in one direction only


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
def tfidf_vectorizer():
  """The TF-IDF baselines' terms and weights (similarity and provenance): scikit-learn's
  ``TfidfVectorizer`` with each whitespace-separated pretoken a term, case kept; raw counts ×
  smoothed idf ``ln((1 + n) / (1 + df)) + 1``, rows L2-normalised."""
  from sklearn.feature_extraction.text import TfidfVectorizer

  return TfidfVectorizer(token_pattern=r"\S+", lowercase=False)


def tfidf_vectors(texts: list[str]) -> np.ndarray:
  """Bag-of-pretokens TF-IDF fitted on ``texts``, dense unit rows (a few thousand distinct
  pretokens)."""
  return normalise(tfidf_vectorizer().fit_transform(texts).toarray())


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
      raise FunctionGroupsError(f"--pairs {part!r}: expected A:B with A and B among the benchmark's "
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
  # int32: every size's pools of every pair are held at once (evaluate); eval3 at pool 10,000
  # over its four pairs, all queries: 113,000 rows × 10,000 items, 9 GB as int64.
  pool = np.empty((len(shared), n), np.int32)
  for row, g in enumerate(shared):
    others = candidates[candidates != g]
    neg = rng.choice(others, n - 1, replace=False)
    pool[row] = [at_b[g], *(at_b[int(x)] for x in neg)]
  return Pools(np.asarray([at_a[g] for g in shared], np.int64), pool)


def direction(a: str, b: str) -> str:
  """The name of queries at ``a`` ranked in pools at ``b``."""
  return f"{a}→{b}"


@dataclasses.dataclass
class PairPools:
  """One pair's pools at one size: those drawn per direction, and why any other was not."""
  label: str                   # "a↔b", or "a=b"
  drawn: dict[str, Pools]      # direction → pools
  missing: dict[str, str]      # direction → why no pool was drawn

  @property
  def both_ways(self) -> bool:
    """Scored in every direction the pair has (two; one for a=b): what "all" pools."""
    return bool(self.drawn) and not self.missing


def draw_pair(items: Items, a: str, b: str, n: int, seed: int,
              max_queries: int = 0) -> PairPools:
  """a→b, then b→a, from one generator seeded by the seed, pair and size: the pools earlier
  versions drew (and so their numbers), a missing direction drawing nothing."""
  rng = np.random.default_rng([seed, n, *map(ord, f"{a}:{b}")])
  ways = [(a, b), (b, a)] if a != b else [(a, b)]
  drawn, missing = {}, {}
  for q, p in ways:
    pools = draw_pools(items, q, p, n, rng, max_queries)
    if pools is None:
      missing[direction(q, p)] = not_drawn(items, q, p, n)
    else:
      drawn[direction(q, p)] = pools
  return PairPools(f"{a}↔{b}" if a != b else f"{a}={b}", drawn, missing)


def not_drawn(items: Items, a: str, b: str, n: int) -> str:
  """Why :func:`draw_pools` drew nothing for queries at ``a`` in pools at ``b``."""
  at_b = len(items.of_variant(b))
  if at_b < n:
    return f"{b} has {at_b} functions, fewer than the pool's {n}"
  return f"no function is compiled as both {a} and {b}"


def ranks(vectors: np.ndarray, pools: Pools, bar=None, block_bytes: int = BLOCK_BYTES,
          by_product: bool | None = None) -> np.ndarray:
  """The positive's rank (1 = first) in each pool by cosine; ties against the positive.
  Scored in blocks of queries of at most ``block_bytes`` of gathered vectors (at least one
  query), each counted on ``bar``. Where the pool is over ``PRODUCT_POOL`` or one query's
  pool alone is over ``block_bytes`` (``by_product`` None), or ``by_product``: each block of
  queries is scored against every item the pools hold at once, a matrix product
  (:func:`_ranks_by_product`)."""
  n, d = pools.pool.shape[1], vectors.shape[1]
  big = n > PRODUCT_POOL or n * d * vectors.itemsize > block_bytes
  if by_product or (by_product is None and big):
    return _ranks_by_product(vectors, pools, bar, block_bytes)
  rows = max(1, block_bytes // (n * d * vectors.itemsize))
  out = []
  for start in range(0, len(pools.queries), rows):
    q = vectors[pools.queries[start:start + rows]]                           # [q, d]
    s = np.einsum("qd,qnd->qn", q, vectors[pools.pool[start:start + rows]])  # [q, N]; 0: positive
    out.append(1 + (s[:, 1:] >= s[:, :1] - TIE).sum(axis=1))
    if bar is not None:
      bar.update(len(q))
  return np.concatenate(out) if out else np.zeros(0, np.int64)


def _ranks_by_product(vectors: np.ndarray, pools: Pools, bar, block_bytes: int) -> np.ndarray:
  """:func:`ranks` for pools of thousands: gathering each query's pool took N × d floats a
  query (pool 10,000 of TF-IDF's tens of thousands of pretokens: about 1 GB, then a second a
  query), while the pools of one direction draw from one variant's M items: a block of
  queries × those M by one product, each pool's scores then picked from it. The same
  cosines up to float rounding (another summation order; ties are within ``TIE``)."""
  items, where = np.unique(pools.pool, return_inverse=True)
  where = where.reshape(pools.pool.shape)
  side = vectors[items]                                                       # [M, d]
  rows = max(1, block_bytes // (len(items) * vectors.itemsize))
  out = []
  for start in range(0, len(pools.queries), rows):
    s = vectors[pools.queries[start:start + rows]] @ side.T                   # [q, M]
    s = np.take_along_axis(s, where[start:start + rows], axis=1)              # [q, N]
    out.append(1 + (s[:, 1:] >= s[:, :1] - TIE).sum(axis=1))
    if bar is not None:
      bar.update(len(s))
  return np.concatenate(out) if out else np.zeros(0, np.int64)


def rank_among(scores, positive: int) -> int:
  """The rank (1 = first) of ``scores[positive]`` among one query's scores, ties against it as
  :func:`ranks` counts them: lmscale search's answer over a whole index, scored as a pool."""
  s = np.asarray(scores, np.float32)
  return 1 + int((np.delete(s, positive) >= s[positive] - TIE).sum())


@dataclasses.dataclass
class Result:
  method: str
  pool: int
  pair: str
  queries: int
  recall_at_1: float | None
  mrr: float | None
  note: str = ""
  # direction ("a→b": queries at a, pools at b) → its queries, for each direction in this
  # number; and → why, for each left out ("all": every direction of a pair not scored both ways).
  directions: dict = dataclasses.field(default_factory=dict)
  left_out: dict = dataclasses.field(default_factory=dict)

  def row(self) -> dict:
    return dataclasses.asdict(self)

  @property
  def one_way(self) -> bool:
    return self.pair != "all" and bool(self.directions) and bool(self.left_out)


def evaluate(items: Items, methods: dict[str, np.ndarray], pairs: list[tuple[str, str]],
             pool_sizes: list[int], *, seed: int = 0, max_queries: int = 0,
             progress: bool = False) -> list[Result]:
  """Every method × pool size × pair (both directions where both sides have ``n``
  functions, else the one that has), plus an "all" row per method and pool size: every query
  of the pairs scored both ways. ``progress``: a bar per method and pool size (stderr)."""
  out = []
  for n in pool_sizes:
    drawn = [draw_pair(items, a, b, n, seed, max_queries) for a, b in pairs]
    queries = sum(len(p.queries) for pp in drawn for p in pp.drawn.values())
    for method, vec in methods.items():
      bar = progress_lib.bar(progress and queries > 0, total=queries, unit="query",
                             desc=f"score {method}, pool {n}")
      cells = [_cell(method, n, pp, {d: ranks(vec, p, bar) for d, p in pp.drawn.items()})
               for pp in drawn]
      bar.close()
      out += [c for c, _ in cells]
      out.append(_all(method, n, drawn, [r for _, r in cells]))
  return out


def _cell(method: str, n: int, pp: PairPools, scored: dict) -> tuple[Result, np.ndarray]:
  """One pair's result and its ranks (every direction drawn)."""
  r = np.concatenate(list(scored.values())) if scored else np.zeros(0, np.int64)
  res = _result(method, n, pp.label, r, {d: len(x) for d, x in scored.items()}, pp.missing)
  if not scored:
    res.note = "pool not drawn: " + "; ".join(f"{d}: {why}" for d, why in pp.missing.items())
  elif pp.missing:
    res.note = (f"one direction only ({', '.join(scored)}): " +
                "; ".join(f"{d} not scored, {why}" for d, why in pp.missing.items()) +
                "; not in the all-pairs number")
  return res, r


def _all(method: str, n: int, drawn: list[PairPools], ranked: list[np.ndarray]) -> Result:
  """The pairs scored in every direction, pooled; every direction of the others left out."""
  keep = [r for pp, r in zip(drawn, ranked) if pp.both_ways]
  counted = {d: len(p.queries) for pp in drawn if pp.both_ways for d, p in pp.drawn.items()}
  left = {}
  for pp in drawn:
    if not pp.both_ways:
      why = (f"{pp.label} is scored in one direction only" if pp.drawn
             else f"{pp.label}: pool not drawn")
      left.update({d: why for d in [*pp.drawn, *pp.missing]})
  res = _result(method, n, "all", np.concatenate(keep) if keep else np.zeros(0, np.int64),
                counted, left)
  one_way = [pp.label for pp in drawn if pp.drawn and not pp.both_ways]
  if not keep:
    res.note = ("no pair scored in both directions" +
                (f" (one direction only: {', '.join(one_way)}; not pooled)" if one_way
                 else f": pool not drawn, fewer than {n} functions in the variants"))
  elif left:
    res.note = (f"{len(keep)} of {len(drawn)} pairs, those scored in both directions; left out: " +
                ", ".join(f"{pp.label} ({'one direction only' if pp.drawn else 'not drawn'})"
                          for pp in drawn if not pp.both_ways))
  return res


def _result(method: str, n: int, pair: str, r: np.ndarray, directions: dict,
            left_out: dict) -> Result:
  if not len(r):
    return Result(method, n, pair, 0, None, None, directions=directions, left_out=left_out)
  return Result(method, n, pair, int(len(r)), float(np.mean(r == 1)), float(np.mean(1 / r)),
                directions=directions, left_out=dict(left_out))


def table(results: list[Result]) -> str:
  """Methods × pairs, one block per pool size: ``R@1 / MRR`` per cell, the queries of each
  column, † on a pair scored in one direction only, and a footnote naming the direction and
  what "all" pools."""
  pairs = list(dict.fromkeys(r.pair for r in results))
  methods = list(dict.fromkeys(r.method for r in results))
  width = max(15, *(len(p) + 2 for p in pairs))  # a column's last character: † or a space
  mw = max(8, *(len(m) for m in methods))
  lines = []
  for n in dict.fromkeys(r.pool for r in results):
    cells = {(r.method, r.pair): r for r in results if r.pool == n}
    first = {p: cells.get((methods[0], p)) for p in pairs}  # every method ranks the same pools
    mark = {p: ONE_WAY if c is not None and c.one_way else " " for p, c in first.items()}
    chance = f"chance R@1 {1 / n:.3f}, MRR {chance_mrr(n):.3f}"
    lines.append(f"pool {n} (1 positive + {n - 1} negatives; {chance}); cells: R@1 / MRR")
    lines.append(f"{'method':<{mw}} " + "".join(f"{p + ' ':>{width}}" for p in pairs))
    for m in methods:
      row = [(p, cells.get((m, p))) for p in pairs]
      lines.append(f"{m:<{mw}} " + "".join(
          f"{'n/a ':>{width}}" if c is None or c.recall_at_1 is None
          else f"{c.recall_at_1:.3f} / {c.mrr:.3f}{mark[p]}".rjust(width) for p, c in row))
    lines.append(f"{'queries':<{mw}} " + "".join(
        f"{(c.queries if c else 0)}{mark[p]}".rjust(width) for p, c in first.items()))
    lines += footnotes(list(first.values()))
    lines.append("")
  return "\n".join(lines).rstrip()


def footnotes(cells: list[Result | None]) -> list[str]:
  """The lines under a pool's block: each pair scored one way, and what "all" left out."""
  lines = []
  for c in cells:
    if c is not None and c.one_way:
      (way, q), = c.directions.items()
      why = "; ".join(f"{d}: {reason}" for d, reason in c.left_out.items())
      lines.append(f"{ONE_WAY} {c.pair}: {way} only ({q} queries; {why}); not in all")
  every = next((c for c in cells if c is not None and c.pair == "all"), None)
  if every is not None and every.note:
    lines.append(f"all: {every.note}")
  return lines


def chance_mrr(n: int) -> float:
  return sum(1 / k for k in range(1, n + 1)) / n


# --------------------------------------------------------------------------- leakage
def training_digests(paths: list[str], max_input_bytes: int = 0,
                     progress: bool = False) -> tuple[set[str], int]:
  """The normalised-text hashes of every function preparation would take from ``paths``
  (the same file list, cap and text as ``prepare``: ``elf_corpus.list_inputs`` and
  ``iter_functions``) → (digests, files). ``progress``: a bar in bytes on stderr (15 MB/s on
  a 2-core VM: 1.6 s for the demo's 24 MB of ELF input, minutes for some GB uncapped)."""
  files = elf_corpus.list_inputs(paths, max_input_bytes)
  digests = set()
  bar = progress_lib.bar(progress, total=sum(c.size for c in files), unit="B", unit_scale=True,
                         desc="leakage: read the pretraining inputs")
  for c in files:
    res = elf_corpus.FileResult(path=c.path, file_bytes=c.size)
    digests.update(d.hex() for d, _ in elf_corpus.iter_functions(c.path, res))
    bar.update(c.size)
  bar.close()
  return digests, len(files)


def overlap(items: Items, digests: set[str]) -> dict:
  """How much of the benchmark the pretraining corpus holds verbatim (same normalised text)."""
  hit = [i for i, d in enumerate(items.digest) if d in digests]
  per_variant = collections.Counter(items.variant[i] for i in hit)
  return {"functions": len(items), "in_training_corpus": len(hit),
          "groups_touched": len({int(items.group[i]) for i in hit}),
          "per_variant": dict(sorted(per_variant.items())),
          "fraction": round(len(hit) / max(1, len(items)), 6)}

