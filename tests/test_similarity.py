"""The binary-code similarity benchmark end to end: real C sources (tests/data/similarity, four
files of small routines written for this test) compiled by the machine's gcc at -O0 and -O3,
functions extracted as preparation extracts them, then lmscale eval-similarity on a real
Hugging Face directory (random weights, a tokenizer trained on the functions) and TF-IDF.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from lmscale_jax.similarity import function_groups
from tests.helpers import ROOT, lmscale, make_config

SOURCES = os.path.join(ROOT, "tests", "data", "similarity")
pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


def tool(name, *args, timeout=120):
  """The lmscale subcommand ``name`` (its old tools/ name) as a user runs it."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([*lmscale(name), *map(str, args)],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                        stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench") / "bench.jsonl"
  r = tool("build_similarity_bench.py", "--sources", SOURCES, "--output", out,
           "--compilers", "gcc", "--opt", "O0,O3")
  assert r.returncode == 0, r.stderr
  return out


def hf_model(directory, bench_path):
  """A real HF directory: the default config's BERT at 2 × 64, random weights, and a binary
  tokenizer trained on the benchmark's functions (as prepare trains one)."""
  import jax

  from lmscale_jax.inference import model_dir
  from lmscale_jax.model import bert as model_lib
  from lmscale_jax.model import hf_convert
  from lmscale_jax.similarity import function_groups
  from lmscale_jax.store import tokenizer as toklib

  _, groups = function_groups.load(str(bench_path))
  texts = [v["text"] for g in groups for v in g["variants"].values()]
  tok = toklib.train(texts, vocab_size=512, kind="binary")
  os.makedirs(directory)
  toklib.write_hf_files(tok, str(directory), model_max_length=128)
  c = make_config(model=dict(layers=2, hidden=64, heads=2, ffn=128, dtype="float32"))
  shape = {"seq_len": 128, "vocab_size": tok.get_vocab_size(with_added_tokens=True)}
  cfg = model_dir.resolve(c.model, shape, toklib.validate(tok, "test"))
  params = jax.jit(lambda r: model_lib.init_params(cfg, r))(jax.random.key(7))
  hf_convert.save_model(jax.device_get(params), cfg, str(directory))
  return directory


def test_bench_groups_each_source_function_over_levels_and_counts_what_it_drops(bench):
  lines = open(bench).read().splitlines()
  header, groups = json.loads(lines[0]), [json.loads(x) for x in lines[1:]]
  assert header["format"] == "lmscale_jax.similarity/1"
  assert header["variants"] == ["gcc-O0", "gcc-O3"]
  assert header["compilers"]["gcc"].startswith("gcc")
  st = header["stats"]
  assert st["objects_built"] == 8 and st["objects_failed"] == 0
  assert st["groups"] == len(groups) >= 100
  assert st["too_small_dropped"] > 0  # e.g. zigzag_encode at -O3: 3 instructions
  names = {(g["source"], g["name"]) for g in groups}
  assert ("similarity/strings.c", "str_compare") in names
  assert ("similarity/codecs.c", "crc32_bitwise") in names
  for g in groups:
    assert set(g["variants"]) == {"gcc-O0", "gcc-O3"}
    assert all(v["instructions"] >= 8 for v in g["variants"].values())
  # Real optimisation: -O3 code differs from -O0 code for nearly every function.
  same = sum(g["variants"]["gcc-O0"]["text"] == g["variants"]["gcc-O3"]["text"] for g in groups)
  assert same < len(groups) // 10


def test_tfidf_far_above_chance_and_identical_functions_rank_first(bench, tmp_path):
  hf = hf_model(tmp_path / "hf", bench)
  # An ELF of the pretraining corpus: codecs.c built at -O0 as the benchmark builds it.
  leak_so = tmp_path / "corpus" / "libcodecs.so"
  leak_so.parent.mkdir()
  from lmscale_jax.similarity import function_groups
  assert function_groups._compile(
      "gcc", "O0", function_groups.Source(os.path.join(SOURCES, "codecs.c"), "codecs.c"),
      str(leak_so), [f"-I{SOURCES}"]) == ""
  out = tmp_path / "eval.json"
  results = tmp_path / "results.jsonl"
  r = tool("eval_similarity.py", "--bench", bench, "--hf", hf, "--pool", "10,100,1000",
           "--pairs", "gcc-O0:gcc-O3,gcc-O3:gcc-O3", "--json", out, "--results", results,
           "--train-elf", leak_so.parent)
  assert r.returncode == 0, r.stderr[-3000:]
  doc = json.load(open(out))
  got = {(x["method"], x["pool"], x["pair"]): x for x in doc["results"]}
  assert {m for m, _, _ in got} == {"tfidf", "hf", "random-init"}
  hard = got["tfidf", 100, "gcc-O0↔gcc-O3"]
  assert hard["queries"] == 2 * doc["bench_stats"]["groups"]  # both directions
  # chance: 0.01 and 0.052 (measured: 0.149 and 0.271)
  assert hard["recall_at_1"] >= 0.1 and hard["mrr"] >= 0.2
  for method in ("tfidf", "hf", "random-init"):
    assert got[method, 100, "gcc-O3=gcc-O3"]["recall_at_1"] == 1.0  # itself ranks first
  assert got["tfidf", 1000, "all"]["recall_at_1"] is None  # fewer than 1000 functions
  assert "pool not drawn" in got["tfidf", 1000, "all"]["note"]
  assert "gcc-O0↔gcc-O3" in r.stdout and "random-init" in r.stdout
  # Leakage: exactly codecs.c's -O0 functions are in that corpus, found by their text hash.
  groups = [json.loads(x) for x in open(bench).read().splitlines()[1:]]
  codecs = sum(g["source"] == "similarity/codecs.c" for g in groups)
  assert doc["overlap"]["per_variant"] == {"gcc-O0": codecs}
  rows = [json.loads(x) for x in open(results)]
  assert len(rows) == len(doc["results"]) and rows[0]["date"] and rows[0]["device"]


def test_missing_compiler_and_broken_source_are_one_line_each_and_the_rest_builds(tmp_path):
  src = tmp_path / "src"
  src.mkdir()
  shutil.copy(os.path.join(SOURCES, "numeric.c"), src / "numeric.c")
  (src / "broken.c").write_text("int broken(int x) { return x +; }\n")
  out = tmp_path / "b.jsonl"
  r = tool("build_similarity_bench.py", "--sources", src, "--output", out,
           "--compilers", "gcc,no-such-cc", "--opt", "O0,O1")
  assert r.returncode == 0, r.stderr
  err = r.stderr.strip().splitlines()
  assert err[0].startswith("compiler no-such-cc: not found")
  assert [e.split(":")[0] for e in err[1:]] == ["src/broken.c", "src/broken.c"]
  assert all("gcc -O" in e and "failed" in e for e in err[1:])
  header = json.loads(open(out).readline())
  assert header["stats"]["objects_failed"] == 2 and header["stats"]["groups"] > 20


def test_bad_inputs_are_one_line_and_write_nothing(tmp_path):
  not_bench = tmp_path / "x.jsonl"
  not_bench.write_text('{"format": "something else"}\n')
  r = tool("eval_similarity.py", "--bench", not_bench, "--hf", tmp_path)
  assert r.returncode == 1 and r.stderr.count("\n") == 1
  assert "not a similarity benchmark" in r.stderr
  r = tool("build_similarity_bench.py", "--sources", tmp_path / "none", "--output",
           tmp_path / "o.jsonl")
  assert r.returncode == 1 and "no such file or directory" in r.stderr
  r = tool("build_similarity_bench.py", "--sources", tmp_path, "--output", tmp_path / "o.jsonl",
           "--opt", "O9")
  assert r.returncode == 1 and "--opt O9" in r.stderr and not (tmp_path / "o.jsonl").exists()


def test_a_fifo_among_the_sources_is_left_out(tmp_path):
  """gcc reading a FIFO named like a source waits forever: only regular .c files are sources
  (as preparation takes only regular files)."""
  src = tmp_path / "src"
  src.mkdir()
  shutil.copy(os.path.join(SOURCES, "numeric.c"), src / "numeric.c")
  os.mkfifo(src / "pipe.c")
  assert [s.ident for s in function_groups.find_sources([str(src)])] == ["src/numeric.c"]


# ----------------------------------------------------------------------------- issue 41
@pytest.fixture(scope="module")
def one_side_short(tmp_path_factory):
  """A real benchmark at -O0/-O1/-O3 where 30 functions are gone at -O3 (as if inlined away),
  so gcc-O3 has 71 functions and the others 101: at pool 80 a pair with gcc-O3 can only be
  scored with its queries at gcc-O3 (pools at gcc-O0 or gcc-O1)."""
  work = tmp_path_factory.mktemp("short")
  full = work / "full.jsonl"
  r = tool("build_similarity_bench.py", "--sources", SOURCES, "--output", full,
           "--compilers", "gcc", "--opt", "O0,O1,O3")
  assert r.returncode == 0, r.stderr
  lines = open(full).read().splitlines()
  header, groups = json.loads(lines[0]), [json.loads(x) for x in lines[1:]]
  for g in groups[:30]:
    del g["variants"]["gcc-O3"]
  header["stats"]["per_variant"]["gcc-O3"] -= 30
  out = work / "short.jsonl"
  out.write_text("\n".join(json.dumps(x) for x in [header, *groups]) + "\n")
  return out, hf_model(work / "hf", out)


@pytest.fixture(scope="module")
def short_runs(one_side_short, tmp_path_factory):
  """eval_similarity.py on that benchmark at pools 10 and 80, with --progress and by default
  (stderr a pipe, so no bars):
  {"shown"/"hidden": (the run, its --json, its --results rows)}."""
  path, hf = one_side_short
  runs = {}
  for name, extra in (("hidden", []), ("shown", ["--progress"])):  # stderr: a pipe
    out = tmp_path_factory.mktemp(name)
    r = tool("eval_similarity.py", "--bench", path, "--hf", hf, "--pool", "10,80",
             "--json", out / "eval.json", "--results", out / "results.jsonl", *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    runs[name] = (r, json.load(open(out / "eval.json")),
                  [json.loads(x) for x in open(out / "results.jsonl")])
  return runs


def test_a_pair_short_on_one_side_is_scored_one_way_says_so_and_stays_out_of_all(short_runs):
  r, doc, rows = short_runs["hidden"]
  got = {(x["method"], x["pool"], x["pair"]): x for x in doc["results"]}
  both = {"gcc-O0→gcc-O1": 101, "gcc-O1→gcc-O0": 101}
  for method in ("tfidf", "hf", "random-init"):
    # Pool 10: every side has 10 functions, every pair both ways, all of them in "all".
    assert got[method, 10, "gcc-O0↔gcc-O3"]["directions"] == {"gcc-O0→gcc-O3": 71,
                                                              "gcc-O3→gcc-O0": 71}
    assert got[method, 10, "all"]["queries"] == 202 + 142 + 142
    assert got[method, 10, "all"]["left_out"] == {}
    # Pool 80: no pool of 80 at gcc-O3, so those pairs are scored from gcc-O3 only...
    for other in ("gcc-O0", "gcc-O1"):
      cell = got[method, 80, f"{other}↔gcc-O3"]
      assert cell["directions"] == {f"gcc-O3→{other}": 71} and cell["queries"] == 71
      assert cell["left_out"] == {
          f"{other}→gcc-O3": "gcc-O3 has 71 functions, fewer than the pool's 80"}
      assert "one direction only" in cell["note"] and cell["recall_at_1"] is not None
    assert got[method, 80, "gcc-O0↔gcc-O1"]["directions"] == both
    # ...and "all" is the one pair scored both ways, exactly: nothing one-way mixed in.
    every, pair = got[method, 80, "all"], got[method, 80, "gcc-O0↔gcc-O1"]
    assert every["directions"] == both and every["queries"] == 202
    assert (every["recall_at_1"], every["mrr"]) == (pair["recall_at_1"], pair["mrr"])
    assert set(every["left_out"]) == {"gcc-O0→gcc-O3", "gcc-O3→gcc-O0", "gcc-O1→gcc-O3",
                                      "gcc-O3→gcc-O1"}
  # The table marks the one-way cells and their query counts, and names the direction.
  block = r.stdout.split("pool 80 ")[1]
  tfidf_row = next(x for x in block.splitlines() if x.startswith("tfidf"))
  queries_row = next(x for x in block.splitlines() if x.startswith("queries"))
  assert tfidf_row.count("†") == 2 and queries_row.split() == ["queries", "202", "71†", "71†",
                                                               "202"]
  assert "† gcc-O0↔gcc-O3: gcc-O3→gcc-O0 only (71 queries; gcc-O0→gcc-O3: gcc-O3 has 71 " \
         "functions, fewer than the pool's 80); not in all" in block
  assert "all: 1 of 3 pairs, those scored in both directions; left out: gcc-O0↔gcc-O3 " \
         "(one direction only), gcc-O1↔gcc-O3 (one direction only)" in block
  assert "†" not in r.stdout.split("pool 80 ")[0]
  # The results file carries the same facts, a line per number.
  assert {(x["pair"], x["pool"]): x["directions"] for x in rows if x["method"] == "tfidf"}[
      "gcc-O0↔gcc-O3", 80] == {"gcc-O3→gcc-O0": 71}


def test_progress_bars_go_to_stderr_and_leave_stdout_the_tables(short_runs):
  (shown, doc_shown, _), (hidden, doc_hidden, _) = short_runs["shown"], short_runs["hidden"]
  assert shown.stdout == hidden.stdout and doc_shown["results"] == doc_hidden["results"]
  for step in ("embed hf", "embed random-init", "score tfidf, pool 10", "score hf, pool 80",
               "score random-init, pool 80"):
    assert f"{step}: 100%" in shown.stderr, step
  assert re.search(r"\[\d\d:\d\d<\d\d:\d\d, ", shown.stderr)  # elapsed<ETA
  assert "%|" not in shown.stdout and "\r" not in shown.stdout
  assert "%|" not in hidden.stderr and "embed" not in hidden.stderr


def test_ranks_scored_in_blocks_are_bitwise_those_of_one_block():
  import numpy as np

  from lmscale_jax.evals import retrieval

  rng = np.random.default_rng(0)
  vectors = retrieval.normalise(rng.standard_normal((500, 48)))
  vectors[1] = vectors[0]  # a tie: counted against the positive in any block
  pools = retrieval.Pools(rng.integers(0, 500, 97), rng.integers(0, 500, (97, 60)))
  pools.pool[:, :2] = [0, 1]
  one = retrieval.ranks(vectors, pools, block_bytes=1 << 40)
  for block_bytes in (1, 60 * 48 * 4 * 7, 60 * 48 * 4 * 96):  # 1, 7 and 96 queries a block
    assert np.array_equal(retrieval.ranks(vectors, pools, block_bytes=block_bytes), one)
  assert (one >= 2).all()  # the tie with item 1 ranks every positive second or lower


def test_tfidf_only_scores_the_baseline_without_a_model(bench, tmp_path):
  out = tmp_path / "tfidf.json"
  r = tool("eval_similarity.py", "--bench", bench, "--tfidf-only", "--pool", "10,100",
           "--pairs", "gcc-O0:gcc-O3", "--json", out, "--no-progress")
  assert r.returncode == 0, r.stderr[-3000:]
  doc = json.load(open(out))
  assert {x["method"] for x in doc["results"]} == {"tfidf"}
  assert {x["pool"] for x in doc["results"]} == {10, 100} and "tfidf" in r.stdout
  r = tool("eval_similarity.py", "--bench", bench, "--tfidf-only", "--hf", tmp_path)
  assert r.returncode == 1 and r.stderr.startswith("error: --tfidf-only scores no model")


def test_a_pool_of_thousands_is_ranked_by_one_product_as_by_gathering_each_pool():
  """Pool 10,000 (eval3): one query's pool over the block limit switches to scoring blocks of
  queries against every item of the pools' side at once; the same ranks, ties included."""
  import numpy as np

  from lmscale_jax.evals import retrieval

  rng = np.random.default_rng(1)
  vectors = retrieval.normalise(rng.standard_normal((12_000, 16)))
  vectors[1] = vectors[0]
  side = rng.permutation(np.arange(2, 12_000))[:10_500]
  pools = retrieval.Pools(rng.integers(0, 12_000, 40),
                          np.stack([rng.permutation(side)[:10_000] for _ in range(40)]))
  pools.pool[:, :2] = [0, 1]
  gathered = retrieval.ranks(vectors, pools, by_product=False)
  assert np.array_equal(retrieval.ranks(vectors, pools, by_product=True), gathered)
  assert np.array_equal(retrieval.ranks(vectors, pools), gathered)  # over PRODUCT_POOL
  small = retrieval.Pools(pools.queries, pools.pool[:, :retrieval.PRODUCT_POOL])
  one = retrieval.ranks(vectors, small, block_bytes=retrieval.PRODUCT_POOL * 16 * 4 - 1)
  assert np.array_equal(one, retrieval.ranks(vectors, small, by_product=False))  # one over
  assert (gathered >= 2).all()


def test_tfidf_is_pretoken_counts_times_smoothed_idf_in_unit_rows():
  """The similarity baseline's TF-IDF (scikit-learn's, one pretoken a term, case kept) against
  the formula written out on three functions: count × (ln((1 + n) / (1 + df)) + 1), L2 rows."""
  import numpy as np

  from lmscale_jax.evals import retrieval

  texts = ["push rbp [NEXT] mov rbp rsp [NEXT] ret", "xor eax eax [NEXT] ret",
           "push rbp [NEXT] push RBP [NEXT] ret"]
  got = retrieval.tfidf_vectors(texts)
  terms = sorted({w for t in texts for w in t.split()})
  counts = np.array([[t.split().count(w) for w in terms] for t in texts], np.float64)
  weights = counts * (np.log(4 / (1 + (counts > 0).sum(axis=0))) + 1)
  want = weights / np.linalg.norm(weights, axis=1, keepdims=True)
  assert got.dtype == np.float32 and got.shape == (3, len(terms)) and "RBP" in terms
  assert np.allclose(got, want, atol=1e-6)  # columns: the terms in sorted order


def test_bench_embed_with_a_missing_benchmark_is_one_line(tmp_path):
  r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_embed.py"),
                      "--workdir", str(tmp_path), "--bench", str(tmp_path / "none.jsonl")],
                     capture_output=True, text=True, timeout=120,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert r.returncode == 1 and r.stderr.strip().splitlines() == [
      f"error: --bench {tmp_path / 'none.jsonl'}: no such file (build one with lmscale "
      "similarity-build)"], r.stderr
