"""Search over a function index: where exact numpy search stops being fast enough, and what an
approximate faiss index costs and loses there; and how fast ``lmscale index`` embeds real
binaries.

  python benchmarks/bench_search.py vectors [--sizes 10000,100000,1000000] [--dims 768,64]
      [--out benchmarks/results/DATE-cpu-search.json]
  python benchmarks/bench_search.py index (--workdir RUN | --tiny-run DIR) --elf FILE …
      --out benchmarks/results/DATE-cpu-search-index.json

``vectors``: synthetic L2-normalised float32 vectors shaped like an index of similar functions
(clusters of 100 around random centres, cosine ~0.71 to their centre, ~0.5 to each other; a
query is a new member of a random cluster), and, at 100k × 768, uniform random vectors (no
structure: the worst case for an approximate index). Per size and dim: exact numpy
(``vector_search.exact_top_k``, what ``query.top_k`` runs), faiss ``IndexFlatIP`` (exact),
faiss ``IndexIVFFlat`` (inner product; nprobe swept, the smallest reaching the recall target
kept) and the package's own approximate search, ``vector_search.Searcher`` (an
``IndexHNSWFlat``, METRIC_INNER_PRODUCT, M 32, efSearch calibrated on the index's own rows,
kept on disk and read back; the curve over efSearch recorded too; built only where n × dim <=
--hnsw-max-floats, 1e8: its build is the slow part on 2 cores). Measured: build seconds,
bytes (serialised faiss index, the HNSW files on disk; N × dim × 4 for numpy), latency of
one query at a time (p50/p99 over --single queries, fewer at 1M: see each row's ``queries``)
and of a batch of 256 (seconds per batch, repeated), recall@10 against the exact top 10 of
the same 256 queries.
Peak RSS stays under ~8 GB at 1M × 768: the corpus (3.1 GB) plus one faiss copy at a time.

``index``: ``search.index.build`` of the given ELF files into a fresh index (the model loaded
first, not timed; --tiny-run: the tests' 2 × 64 model, trained once), --repeats times into a
fresh index: functions/s of the first build (JAX compiles) and the median of the others, and
the index's bytes on disk per function × 1e6 (extrapolated from this index).
"""

from __future__ import annotations

import datetime
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import _host  # noqa: E402
from lmscale_jax.cli.args import Parser  # noqa: E402
from lmscale_jax.search import vector_search  # noqa: E402

RECALL_TARGET = vector_search.RECALL_TARGET
K = 10
BATCH = 256
CLUSTER = 100      # vectors per cluster
SPREAD = 1.0       # noise norm / centre norm: cosine to the centre 1/sqrt(1 + SPREAD**2)
NPROBES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def peak_rss_gb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def normalised(x: np.ndarray) -> np.ndarray:
  x /= np.linalg.norm(x, axis=1, keepdims=True)
  return x


def clustered(rng, n: int, dim: int, centres: np.ndarray, chunk: int = 100_000) -> np.ndarray:
  """n vectors, each a random centre plus noise of norm ~SPREAD, L2-normalised."""
  out = np.empty((n, dim), np.float32)
  for start in range(0, n, chunk):
    m = min(chunk, n - start)
    noise = rng.standard_normal((m, dim), dtype=np.float32) * np.float32(SPREAD / dim ** 0.5)
    out[start:start + m] = normalised(centres[rng.integers(0, len(centres), m)] + noise)
  return out


def data(kind: str, n: int, dim: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """(corpus [n, dim], queries [BATCH, dim])."""
  rng = np.random.default_rng(seed)
  if kind == "uniform":
    return (normalised(rng.standard_normal((n, dim), dtype=np.float32)),
            normalised(rng.standard_normal((BATCH, dim), dtype=np.float32)))
  centres = normalised(rng.standard_normal((max(n // CLUSTER, 1), dim), dtype=np.float32))
  return clustered(rng, n, dim, centres), clustered(rng, BATCH, dim, centres)


def recall(found: np.ndarray, truth: np.ndarray) -> float:
  return float(np.mean([len(set(f) & set(t)) / len(t) for f, t in zip(found, truth)]))


def latencies(search, queries: np.ndarray, count: int) -> dict:
  """p50/p99 milliseconds of ``count`` queries one at a time."""
  times = []
  for q in queries[:count]:
    t = time.perf_counter()
    search(q[None])
    times.append((time.perf_counter() - t) * 1e3)
  times.sort()
  return {"queries": len(times), "p50_ms": round(statistics.median(times), 3),
          "p99_ms": round(times[min(len(times) - 1, int(0.99 * len(times)))], 3)}


def batch_seconds(search, queries: np.ndarray, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    search(queries)
    times.append(time.perf_counter() - t)
  return round(statistics.median(times), 4)


def faiss_bytes(index) -> int:
  import faiss

  return int(faiss.serialize_index(index).size)


def sweep(index, set_param, values, queries, truth) -> tuple[list, int]:
  """recall@10 per value; the smallest value reaching RECALL_TARGET (else the largest)."""
  curve = []
  for v in values:
    set_param(v)
    _, found = index.search(queries, K)
    curve.append({"value": v, "recall_at_10": round(recall(found, truth), 4)})
  chosen = next((c["value"] for c in curve if c["recall_at_10"] >= RECALL_TARGET), values[-1])
  set_param(chosen)
  return curve, chosen


def row(base: dict, method: str, build_s: float, nbytes: int, single: dict, batch_s: float,
        **extra) -> dict:
  n = base["n"]
  out = {**base, "method": method, "build_s": round(build_s, 3), "bytes": nbytes,
         "bytes_per_million": int(nbytes / n * 1e6), **single, "batch256_s": batch_s,
         "batch256_ms_per_query": round(batch_s / BATCH * 1e3, 4), **extra,
         "peak_rss_gb": round(peak_rss_gb(), 2), "load": os.getloadavg()[0]}
  print(json.dumps(out), flush=True)
  return out


def run_exact(base, corpus, queries, single, repeats):
  def search(q):
    return vector_search.exact_top_k(corpus, q, K)

  truth = search(queries)[0]
  return truth, row(base, "numpy exact", 0.0, corpus.nbytes, latencies(search, queries, single),
                    batch_seconds(search, queries, repeats))


def run_flat(base, corpus, queries, single, repeats, truth):
  import faiss

  t = time.perf_counter()
  index = faiss.IndexFlatIP(corpus.shape[1])
  index.add(corpus)
  build = time.perf_counter() - t
  found = index.search(queries, K)[1]
  return row(base, "faiss IndexFlatIP", build, corpus.nbytes,
             latencies(lambda q: index.search(q, K), queries, single),
             batch_seconds(lambda q: index.search(q, K), queries, repeats),
             recall_at_10=round(recall(found, truth), 4))


def ivf_lists(n: int) -> int:
  """~sqrt(n) lists (faiss's guideline is 4-16 × sqrt(n); fewer keeps k-means and the
  assignment of 1M vectors within minutes on 2 cores)."""
  return int(2 ** round(np.log2(max(n, 16) ** 0.5)))


def run_ivf(base, corpus, queries, single, repeats, truth):
  import faiss

  n, dim = corpus.shape
  nlist = ivf_lists(n)
  t = time.perf_counter()
  index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
  sample = corpus[np.random.default_rng(1).choice(n, min(n, 64 * nlist), replace=False)]
  index.train(sample)
  index.add(corpus)
  build = time.perf_counter() - t
  curve, nprobe = sweep(index, lambda v: setattr(index, "nprobe", v),
                        [p for p in NPROBES if p <= nlist], queries, truth)
  return row(base, "faiss IndexIVFFlat", build, faiss_bytes(index),
             latencies(lambda q: index.search(q, K), queries, single),
             batch_seconds(lambda q: index.search(q, K), queries, repeats),
             nlist=nlist, nprobe=nprobe, recall_curve=curve,
             recall_at_10=next(c["recall_at_10"] for c in curve if c["value"] == nprobe))


def unused_graph(kept: str):
  import faiss

  graph = faiss.read_index(os.path.join(kept, vector_search.GRAPH))
  with open(os.path.join(kept, vector_search.GRAPH_META)) as f:
    graph.hnsw.efSearch = json.load(f)["efSearch"]
  return graph


def run_hnsw(base, corpus, queries, single, repeats, truth):
  """What the package builds above its threshold: ``vector_search.Searcher`` (the graph, its
  efSearch calibrated on the index's own rows, kept in a directory), then read back."""
  where = tempfile.mkdtemp(prefix="bench-hnsw-")
  try:
    t = time.perf_counter()
    searcher = vector_search.Searcher(corpus, exact_max=0, cache_dir=where)
    build = time.perf_counter() - t
    t = time.perf_counter()
    del vector_search.Searcher(corpus, exact_max=0, cache_dir=where).graph
    reread = time.perf_counter() - t
    kept = os.path.join(where, vector_search.ANN_DIR)
    disk = sum(os.path.getsize(os.path.join(kept, f)) for f in os.listdir(kept))
    graph = searcher.graph or unused_graph(kept)  # short of the target: measured all the same
  finally:
    shutil.rmtree(where)
  ef = graph.hnsw.efSearch
  curve, _ = sweep(graph, lambda v: setattr(graph.hnsw, "efSearch", v),
                   (16, 32) + vector_search.EF_SEARCH, queries, truth)
  graph.hnsw.efSearch = ef
  return row(base, "faiss IndexHNSWFlat", build, disk,
             latencies(lambda q: graph.search(q, K), queries, single),
             batch_seconds(lambda q: graph.search(q, K), queries, repeats),
             M=vector_search.HNSW_M, efConstruction=graph.hnsw.efConstruction, efSearch=ef,
             calibrated_recall_at_10=searcher.graph_recall, used=searcher.approximate,
             reread_s=round(reread, 3), recall_curve=curve,
             recall_at_10=round(recall(graph.search(queries, K)[1], truth), 4))


def one_setting(kind: str, n: int, dim: int, a) -> list[dict]:
  corpus, queries = data(kind, n, dim)
  big = n >= 1_000_000
  single, repeats = (a.single // 10, 1) if big else (a.single, 3)
  base = {"data": kind, "n": n, "dim": dim}
  truth, exact = run_exact(base, corpus, queries, single, repeats)
  rows = [exact, run_flat(base, corpus, queries, single, repeats, truth),
          run_ivf(base, corpus, queries, a.single, repeats, truth)]
  if n * dim <= a.hnsw_max_floats:
    rows.append(run_hnsw(base, corpus, queries, a.single, repeats, truth))
  return rows


def versions() -> dict:
  import faiss

  return {"numpy": np.__version__, "faiss": faiss.__version__, "python": sys.version.split()[0],
          "code": _host.code_version()}


def threads() -> dict:
  import faiss
  import threadpoolctl

  blas = [p.get("num_threads") for p in threadpoolctl.threadpool_info()]
  return {"faiss_omp": faiss.omp_get_max_threads(), "blas": blas}


def uptime() -> str:
  return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def header(what: str) -> dict:
  return {"benchmark": f"bench_search {what}", "date": datetime.date.today().isoformat(),
          "device": _host.cpu_name(), "versions": versions(), "threads": threads(),
          "uptime_before": uptime()}


def vectors_main(a) -> dict:
  doc = {**header("vectors"), "recall_target": RECALL_TARGET, "k": K, "batch": BATCH,
         "rows": []}
  for dim in a.dims:
    for n in a.sizes:
      doc["rows"] += one_setting("clustered", n, dim, a)
  if 100_000 in a.sizes and 768 in a.dims:
    doc["rows"] += one_setting("uniform", 100_000, 768, a)
  return doc


def tiny_config(data: str):
  """The shipped CPU config (``--config tiny``) shrunk to the tests' model: 2 × 64, ffn 128,
  6 steps of batch 8 (tests/helpers.py's ``small_train_config``: the same parameters)."""
  from lmscale_jax.config import loader

  config = loader.load("tiny", sets=[f"data.path={data}", "model.hidden=64", "model.ffn=128",
                                     "train.batch_size=8", "train.steps=6",
                                     "train.warmup_steps=2", "train.log_every=1",
                                     "train.eval_every=3", "train.eval_batches=2",
                                     "checkpoint.every=3"], flag="bench_search")
  return config


def tiny_run(where: str) -> str:
  """The tests' model (tests/test_hf_tools.py's ``run``: 2 × 64, seq 64, 6 steps on libz and
  libbz2), made once under ``where``."""
  from lmscale_jax.prep import prepare
  from lmscale_jax.pretrain import trainer

  data, workdir = os.path.join(where, "ds"), os.path.join(where, "run")
  if not os.path.exists(os.path.join(workdir, "run_state.json")):
    prepare.prepare(prepare.PrepareOptions(
        kind="binary", inputs=["/usr/lib/x86_64-linux-gnu/libz.so.1",
                               "/usr/lib/x86_64-linux-gnu/libbz2.so.1.0"],
        output=data, seq_len=64, vocab_size=400, val_fraction=0.1, workers=1, progress=False))
    trainer.train_and_evaluate(tiny_config(data), workdir)
  return workdir


def index_main(a) -> dict:
  from lmscale_jax.inference import trained_model
  import jax

  from lmscale_jax.search import index

  a.workdir = a.workdir or tiny_run(a.tiny_run)
  model = trained_model.load(workdir=a.workdir)
  head = header("index")
  times = []
  for _ in range(a.repeats):  # the first pays JAX's compilations (a cache may hold them)
    where = tempfile.mkdtemp(prefix="bench-index-")
    try:
      t = time.perf_counter()
      done = index.build(model, a.elf, where, say=lambda _: None)
      times.append(round(time.perf_counter() - t, 2))
      disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(where) for f in fs)
    finally:
      shutil.rmtree(where)
  n, seconds = done["functions"], round(statistics.median(times[1:] or times), 2)
  return {**head, "workdir": a.workdir, "elf": a.elf, "binaries": len(done["added"]),
          "functions": n, "seconds_each": times, "seconds": seconds,
          "functions_per_s_first": round(n / times[0], 1),
          "functions_per_s": round(n / seconds, 1),
          "dim": int(model.cfg.hidden), "seq_len": int(model.cfg.seq_len),
          "index_bytes": disk, "bytes_per_function": round(disk / n, 1),
          "bytes_per_million_functions_extrapolated": int(disk / n * 1e6),
          "peak_rss_gb": round(peak_rss_gb(), 2),
          # the embedding runs data-parallel over these (function_vectors): per device = / len
          "jax_devices": [str(d) for d in jax.local_devices()]}


def main() -> None:
  p = Parser(description=__doc__.splitlines()[0])  # a bad argument: one line, exit 1
  sub = p.add_subparsers(dest="what", required=True, parser_class=Parser)
  v = sub.add_parser("vectors")
  v.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                 default=[10_000, 100_000, 1_000_000])
  v.add_argument("--dims", type=lambda s: [int(x) for x in s.split(",")], default=[768, 64])
  v.add_argument("--single", type=int, default=200, help="one-at-a-time queries (1M: a tenth)")
  v.add_argument("--hnsw-max-floats", type=float, default=1e8,
                 help="build HNSW only where n × dim is at most this (100k × 768, 1M × 64)")
  i = sub.add_parser("index")
  run = i.add_mutually_exclusive_group(required=True)
  run.add_argument("--workdir", help="a trained run")
  run.add_argument("--tiny-run", metavar="DIR", help="make (once) and use the tests' model")
  i.add_argument("--repeats", type=int, default=3, help="builds, each into a fresh index")
  i.add_argument("--elf", nargs="+", required=True)
  for s in (v, i):
    s.add_argument("--out", required=True)
  a = p.parse_args()
  t = time.time()
  doc = vectors_main(a) if a.what == "vectors" else index_main(a)
  doc["seconds_total"] = round(time.time() - t, 1)
  doc["uptime_after"] = uptime()
  with open(a.out + ".tmp", "w") as f:
    json.dump(doc, f, indent=1)
  os.replace(a.out + ".tmp", a.out)


if __name__ == "__main__":
  main()
