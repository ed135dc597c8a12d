"""lmscale search scored as lmscale eval-similarity scores: the same functions (small C files
compiled by the machine's gcc at -O0, -O1 and -O2, the flags lmscale similarity-build uses),
the same model (tests/test_hf_tools.py's short real run), the same cosine ranking; and the
search command's bad input, each one line through the installed command (a subprocess)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess

import numpy as np
import pytest
from tokenizers import Tokenizer

from lmscale_jax.cli import search as search_cli
from lmscale_jax.evals import retrieval
from lmscale_jax.prep.elf import elf_functions
from lmscale_jax.similarity import function_groups
from lmscale_jax.store import dataset
from tests.helpers import lmscale
from tests.test_hf_tools import exported, run, run_tool  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

COMPILERS = [cc for cc in ("gcc", "clang") if shutil.which(cc)]
LEVELS = ("O0", "O1", "O2")
QUERIES = "gcc-O0"
POOL_SIDES = [f"{cc}-O2" for cc in COMPILERS]  # the same compiler, and across compilers
# Every name distinct (the positive is the one query's name), every function distinct (no two
# texts alike: no tie to break). rk_fnv1a exists at -O1 and up only: -O2 holds one function
# more than -O0, so a pool of all -O2 functions is drawn for queries at -O0 and not the other
# way round (-O0 has too few), and eval-similarity's pair cell is that one direction (-O1 makes
# rk_fnv1a a group of two variants, which similarity-build keeps).
SOURCES = {
    "checks.c": """
unsigned rk_adler(const unsigned char *p, int n) {
  unsigned a = 1, b = 0;
  for (int i = 0; i < n; i++) { a = (a + p[i]) % 65521; b = (b + a) % 65521; }
  return (b << 16) | a;
}
unsigned rk_crc8(const unsigned char *p, int n) {
  unsigned c = 0;
  for (int i = 0; i < n; i++) {
    c ^= p[i];
    for (int k = 0; k < 8; k++) c = c & 0x80 ? (c << 1) ^ 0x07 : c << 1;
  }
  return c & 0xff;
}
int rk_parity(unsigned x) {
  x ^= x >> 16; x ^= x >> 8; x ^= x >> 4;
  return (0x6996 >> (x & 15)) & 1;
}
unsigned rk_djb2(const char *s) {
  unsigned h = 5381;
  while (*s) h = h * 33 + (unsigned char)*s++;
  return h;
}
#ifdef __OPTIMIZE__
unsigned rk_fnv1a(const char *s) {
  unsigned h = 2166136261u;
  for (; *s; s++) { h ^= (unsigned char)*s; h *= 16777619u; }
  return h;
}
#endif
""",
    "strings.c": """
int rk_strlen(const char *s) { int n = 0; while (s[n]) n++; return n; }
void rk_reverse(char *s, int n) {
  for (int i = 0, j = n - 1; i < j; i++, j--) { char t = s[i]; s[i] = s[j]; s[j] = t; }
}
int rk_count_char(const char *s, char c) {
  int k = 0;
  for (; *s; s++) k += *s == c;
  return k;
}
int rk_atoi(const char *s) {
  int sign = 1, v = 0;
  while (*s == ' ') s++;
  if (*s == '-') { sign = -1; s++; }
  while (*s >= '0' && *s <= '9') v = v * 10 + (*s++ - '0');
  return sign * v;
}
""",
    "maths.c": """
long rk_gcd(long a, long b) { while (b) { long t = a % b; a = b; b = t; } return a; }
long rk_power(long b, int e) {
  long r = 1;
  while (e > 0) { if (e & 1) r *= b; b *= b; e >>= 1; }
  return r;
}
int rk_is_prime(int n) {
  if (n < 2) return 0;
  for (int d = 2; d * d <= n; d++) if (n % d == 0) return 0;
  return 1;
}
double rk_mean(const double *x, int n) {
  double s = 0;
  for (int i = 0; i < n; i++) s += x[i];
  return n ? s / n : 0.0;
}
""",
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """({variant: [.so per source]}, the benchmark JSONL lmscale similarity-build writes from
  the same sources): each .so built as similarity-build builds its objects (function_groups'
  flags, the sources' directory included)."""
  base = tmp_path_factory.mktemp("recall")
  src = base / "src"
  src.mkdir()
  built = {f"{cc}-{level}": [] for cc in COMPILERS for level in LEVELS}
  for name, text in SOURCES.items():
    (src / name).write_text(text)
    for variant, objects in built.items():
      cc, level = variant.split("-")
      so = base / f"{name[:-2]}_{variant}.so"
      subprocess.run([cc, f"-{level}", *function_groups.BASE_FLAGS, f"-I{src}", "-o", str(so),
                      str(src / name)], check=True, timeout=120)
      objects.append(str(so))
  bench = base / "bench.jsonl"
  subprocess.run([*lmscale("similarity_build"), "--sources", str(src), "--compilers",
                  ",".join(COMPILERS),                  "--opt", ",".join(LEVELS), "--min-instructions", "1", "--no-progress",
                  "--output", str(bench)], check=True, timeout=300, capture_output=True)
  return built, str(bench)


def indexed_names(where) -> dict[str, list[str]]:
  """binary path → the names of its indexed functions, from the index's own files."""
  doc = json.loads((where / "index.json").read_text())
  return {b["path"]: [json.loads(x)["name"] for x in (where / (b["shard"] + ".jsonl")).open()]
          for b in doc["binaries"]}


def source_of(binary: str) -> str:
  """The benchmark's source name of a .so built here (checks_gcc-O2.so → src/checks.c)."""
  return f"src/{os.path.basename(binary).split('_')[0]}.c"


@pytest.mark.parametrize("pool_side", POOL_SIDES)
def test_search_recall_at_1_equals_eval_similarity_with_the_whole_index_as_the_pool(
    run, corpus, pool_side, tmp_path, capsys):
  """Queries at gcc -O0 against an index of every function at ``pool_side`` (-O2) =
  eval-similarity's gcc-O0→``pool_side`` at pool N = that index's size (each pool: the positive
  and all N−1 other functions of that side). Ties count against the positive on both sides
  (retrieval.rank_among over the whole answer, k = N); none occurs here, so the plain top hit
  gives the same R@1."""
  built, bench = corpus
  where = tmp_path / "idx"
  code, _, err = run_tool("index", ["--workdir", run[1], "--elf", *built[pool_side], "--output",
                                    where], capsys)
  assert code == 0, err
  names = indexed_names(where)
  pool = sum(map(len, names.values()))
  _, groups = function_groups.load(bench)
  at_pool = {(g["source"], g["name"]): g["variants"][pool_side]["text"] for g in groups
             if pool_side in g["variants"]}
  # The benchmark's functions at that side are the index's, name for name and text for text.
  assert sorted(at_pool) == sorted((source_of(p), n) for p, ns in names.items() for n in ns)
  for path in built[pool_side]:
    for fn in elf_functions.functions(path):
      assert at_pool[source_of(path), fn.name] == fn.text

  ranks, top_hit = [], []
  for path in built[QUERIES]:
    out = tmp_path / "answer.json"
    code, _, err = run_tool("search", ["--index", where, "--workdir", run[1], "--elf", path,
                                       "--k", pool, "--json", out], capsys)
    assert code == 0, err
    same_source = os.path.abspath(path.replace(f"_{QUERIES}.so", f"_{pool_side}.so"))
    for q in json.loads(out.read_text())["queries"]:
      hits = [(r["binary"], r["function"]) for r in q["results"]]
      assert len(hits) == pool, q
      at = hits.index((same_source, q["query"]))
      ranks.append(retrieval.rank_among([r["score"] for r in q["results"]], at))
      top_hit.append(at == 0)
  ranks = np.asarray(ranks)

  doc = tmp_path / "eval.json"
  code, _, err = run_tool("eval_similarity", ["--bench", bench, "--workdir", run[1], "--pool", pool,
                                              "--pairs", f"{QUERIES}:{pool_side}",
                                              "--no-random-init",
                                              "--no-progress", "--json", doc], capsys)
  assert code == 0, err
  row, = [r for r in json.loads(doc.read_text())["results"]
          if r["method"] != "tfidf" and r["pair"] == f"{QUERIES}↔{pool_side}"]
  assert len(ranks) == 12 and row["pool"] == pool == 13
  assert row["directions"] == {f"{QUERIES}→{pool_side}": 12}
  assert list(row["left_out"]) == [f"{pool_side}→{QUERIES}"]
  assert row["recall_at_1"] == float(np.mean(ranks == 1)), (row, ranks)
  assert row["mrr"] == pytest.approx(float(np.mean(1 / ranks)), abs=1e-12)
  assert top_hit == list(ranks == 1)  # no near-tie: the top hit alone gives the same R@1


# --------------------------------------------------------------------------- the command
@pytest.fixture(scope="module")
def small_index(run, corpus, tmp_path_factory):
  """An index of one -O0 binary (4 functions), built by lmscale index."""
  where = tmp_path_factory.mktemp("small") / "idx"
  r = subprocess.run([*lmscale("index"), "--workdir", str(run[1]), "--elf", corpus[0][QUERIES][0],
                      "--output", str(where)], capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  return where


def search_command(argv: list) -> subprocess.CompletedProcess:
  return subprocess.run([*lmscale("search"), *map(str, argv)], capture_output=True, text=True,
                        timeout=300)


def test_search_command_bad_input_is_one_line_each_and_the_index_is_untouched(
    run, exported, corpus, small_index, tmp_path):
  built, _ = corpus
  where = small_index
  before = {p: (where / p).read_bytes() for p in ["index.json", *(
      f"shards/{n}" for n in os.listdir(where / "shards"))]}
  notes = tmp_path / "notes.txt"
  notes.write_text("not a binary\n")
  (tmp_path / "data.c").write_text("int table[4] = {1, 2, 3, 4};\n")
  no_code = tmp_path / "data.o"
  subprocess.run(["gcc", "-c", "-o", str(no_code), str(tmp_path / "data.c")], check=True)
  corrupt = tmp_path / "corrupt"
  shutil.copytree(where, corrupt)
  npz, = (corrupt / "shards").glob("*.npz")
  npz.write_bytes(npz.read_bytes()[:100])  # cut short, as by a full disk
  model = ["--workdir", run[1]]
  cases = [
      (["--index", where, *model, "--elf", notes], f"{notes}: not an ELF file"),
      (["--index", where, *model, "--elf", no_code], "no named x86-64 functions"),
      (["--index", where, *model, "--elf", built[QUERIES][0], "--function", "rk_adlr"],
       "has no function named 'rk_adlr' (closest: rk_adler"),
      (["--index", where, "--hf", exported, "--elf", built[QUERIES][0]],
       "not by the model given"),
      (["--index", tmp_path / "nowhere", *model, "--text", "push rbp"],
       "no index.json (build the index with lmscale index)"),
      (["--index", corrupt, *model, "--text", "push rbp"], "unreadable shard"),
  ]
  with concurrent.futures.ThreadPoolExecutor(3) as pool:  # a few seconds of imports each
    done = list(pool.map(search_command, [argv for argv, _ in cases]))
  for (argv, message), r in zip(cases, done):
    assert r.returncode == 1 and message in r.stderr, (argv, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
  assert before == {p: (where / p).read_bytes() for p in before}


def test_a_query_longer_than_the_sequence_length_is_answered_and_says_what_was_cut(
    run, small_index, tmp_path):
  text = " [NEXT] ".join(["push rbp", "mov rbp rsp", "sub rsp 0x10"] * 30)
  full = len(Tokenizer.from_file(str(run[0] / dataset.TOKENIZER)).encode(text).ids) - 2
  out = tmp_path / "answer.json"
  r = search_command(["--index", small_index, "--workdir", run[1], "--text", text, "--k", 3,
                      "--json", out])
  assert r.returncode == 0, r.stderr
  doc = json.loads(out.read_text())
  q, = doc["queries"]
  assert (q["cut"], q["tokens"], q["dropped"]) == (True, 62, full - 62) and full > 100, q
  assert len(q["results"]) == 3 and doc["seq_len"] == 64
  assert (f"# text: cut to the model's sequence length (64 tokens): its first 62 tokens used, "
          f"{full - 62} dropped") in r.stdout, r.stdout


def test_exact_search_of_a_small_index_is_the_default_answer_and_says_it_is_exact(
    run, corpus, small_index, tmp_path, capsys):
  """An index this small is searched exactly anyway (vector_search.EXACT_MAX): --exact gives
  the same answer; an approximate one is said above the rows."""
  answers = []
  for extra in ([], ["--exact"]):
    out = tmp_path / "answer.json"
    code, text, err = run_tool("search", ["--index", small_index, "--workdir", run[1], "--elf",
                                          corpus[0][QUERIES][0], "--k", 4, *extra, "--json", out],
                               capsys)
    assert code == 0 and "approximate" not in text, err
    answers.append(json.loads(out.read_text()))
  assert answers[0] == answers[1] and (answers[0]["exact"], answers[0]["recall_at_10"]) == (
      True, None)
  rows = search_cli.table(answers[0]["queries"], 64, recall=0.97)
  assert rows.splitlines()[0] == ("# approximate search (HNSW graph, recall@10 0.970 measured "
                                  "on the index's own rows); --exact: the exact answer")
