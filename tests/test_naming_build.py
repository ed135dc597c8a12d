"""The function-naming task (lmscale naming-build) and its baselines
(benchmarks/naming_baselines.py), end to end on real gcc-compiled shared libraries: three small
C "libraries" with named functions (snake and camel case, a leading-underscore name, one
function copied verbatim into two libraries), and a function-groups file of
tests/data/similarity built by lmscale similarity-build.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from lmscale_jax.prep.elf import elf_corpus
from lmscale_jax.similarity import symbol_names
from tests.helpers import ROOT, lmscale

BASELINES = os.path.join(ROOT, "benchmarks", "naming_baselines.py")
pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

# The body every function shares, long enough at -O0 for the 8-instruction floor; each
# function adds its own constant so that texts differ.
BODY = "int s = 0; for (int i = 0; i < n; i++) s += p[i] * {k} + (s >> 3); return s ^ {k};"
SHARED = "int shared_checksum(const int *p, int n) { " + BODY.format(k=77) + " }\n"
LIBS = {
    "alpha": ["alpha_parse_header", "alphaComputeSum", "__alpha_internal_step", "alpha_reset2"],
    "beta": ["beta_read_file", "betaWriteFile", "beta_open_stream"],
    "gamma": ["gamma_encode_block", "gammaDecodeBlock", "gamma_init_table", "gamma_free"],
}


# A function that calls an import and one of its library's exports: the names a stripped copy
# still shows ("calls").
CALLER = ("void free(void *);\nint gamma_release_table(const int *p, int n) { free((void *)p); "
          "return gamma_init_table(p, n) + n * 5 + 1; }\n")


def c_source(lib: str, names: list[str]) -> str:
  funcs = [f"int {n}(const int *p, int n) {{ {BODY.format(k=10 * i + len(lib))} }}\n"
           for i, n in enumerate(names, 1)]
  return "".join(funcs) + SHARED + (CALLER if lib == "gamma" else "")


def compile_library(work, lib: str) -> str:
  src = work / f"{lib}.c"
  src.write_text(c_source(lib, LIBS[lib]))
  out = work / f"lib{lib}.so.1.2.3"
  subprocess.run(["gcc", "-O0", "-fPIC", "-shared", "-nostartfiles", f"-Wl,-soname,lib{lib}.so.1",
                  str(src), "-o", str(out)], check=True)
  return str(out)


def run(name, *args, timeout=180):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cmd = [sys.executable, BASELINES] if name == "baselines" else lmscale(name)
  return subprocess.run([*cmd, *map(str, args)], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def read_jsonl(path) -> list[dict]:
  return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module")
def elfs(tmp_path_factory):
  work = tmp_path_factory.mktemp("naming-src")
  return [compile_library(work, lib) for lib in LIBS]


@pytest.fixture(scope="module")
def task(elfs, tmp_path_factory):
  out = tmp_path_factory.mktemp("naming") / "task"
  r = run("naming_build", "--elf", *elfs, "--output", out, "--test-fraction", "0.3")
  assert r.returncode == 0, r.stderr
  assert r.stdout.startswith(f"{out}: ") and "never in training" in r.stdout
  return out


def test_the_split_shares_no_library_and_no_function_text(task):
  train, test = read_jsonl(task / "train.jsonl"), read_jsonl(task / "test.jsonl")
  assert train and test
  assert not {r["library"] for r in train} & {r["library"] for r in test}
  digests = [{elf_corpus.function_digest(r["text"]) for r in rows} for rows in (train, test)]
  assert not digests[0] & digests[1]
  meta = json.load(open(task / "task.json"))
  libs = meta["split"]["train_libraries"] + meta["split"]["test_libraries"]
  assert sorted(libs) == ["libalpha", "libbeta", "libgamma"]  # soname without .so.1


def test_a_text_of_every_library_stays_once_in_test_and_leaves_training(task):
  meta = json.load(open(task / "task.json"))
  train, test = read_jsonl(task / "train.jsonl"), read_jsonl(task / "test.jsonl")
  assert not [r for r in train if r["function"] == "shared_checksum"]
  assert len([r for r in test if r["function"] == "shared_checksum"]) == 1
  n_train, n_test = (len(meta["split"][f"{s}_libraries"]) for s in ("train", "test"))
  assert meta["text_duplicates_dropped"] == {"train_text_in_test": n_train,
                                             "repeated_within_split": n_test - 1}


def test_every_line_carries_the_contract_fields_and_normalised_names(task):
  rows = read_jsonl(task / "train.jsonl") + read_jsonl(task / "test.jsonl")
  assert all(set(r) == {"text", "name", "tokens", "library", "function", "binary", "calls"}
             for r in rows)
  by_function = {r["function"]: r for r in rows}
  assert by_function["gamma_release_table"]["calls"] == ["free", "gamma_init_table"]
  assert by_function["gamma_init_table"]["calls"] == []
  assert by_function["alphaComputeSum"]["tokens"] == ["alpha", "compute", "sum"]
  assert by_function["__alpha_internal_step"]["name"] == "alpha_internal_step"
  assert by_function["alpha_reset2"]["tokens"] == ["alpha", "reset", "2"]
  assert all(" [NEXT] " in r["text"] and r["binary"].endswith(".so.1.2.3") for r in rows)


def test_task_json_counts_tokens_and_the_unseen_share(task):
  meta = json.load(open(task / "task.json"))
  train, test = read_jsonl(task / "train.jsonl"), read_jsonl(task / "test.jsonl")
  seen = {t for r in train for t in r["tokens"]}
  assert set(meta["train_token_counts"]) == seen
  test_tokens = [set(r["tokens"]) for r in test]
  share = sum(len(t - seen) for t in test_tokens) / sum(map(len, test_tokens))
  assert meta["unseen_in_training"]["test_token_share"] == round(share, 4)
  assert meta["format"] == "lmscale_jax.naming_task/1" and len(meta["sources"]) == 3
  assert all(len(s["sha256"]) == 64 for s in meta["sources"])


def test_the_same_files_and_seed_write_byte_identical_tasks(elfs, task, tmp_path):
  r = run("naming_build", "--elf", *reversed(elfs), "--output", tmp_path / "again",
          "--test-fraction", "0.3")
  assert r.returncode == 0, r.stderr
  for name in ("train.jsonl", "test.jsonl"):
    assert (task / name).read_bytes() == (tmp_path / "again" / name).read_bytes()
  # task.json lists the files in the order given; all else is the same
  a, b = (json.load(open(d / "task.json")) for d in (task, tmp_path / "again"))
  a.pop("sources"), b.pop("sources")
  assert a == b


def test_the_baselines_score_both_methods(task, tmp_path):
  out = tmp_path / "baselines.json"
  r = run("baselines", "--task", task, "--json", out)
  assert r.returncode == 0, r.stderr
  doc = json.load(open(out))
  for name in ("frequent_tokens", "tfidf_nearest", "frequent_tokens_own_dropped",
               "tfidf_nearest_own_dropped"):
    s = doc["baselines"][name]["scores"]
    assert s["functions"] == doc["examples"]["test"]
    assert all(0 <= s[k] <= 1 for k in ("precision", "recall", "f1", "exact"))
  assert doc["baselines"]["frequent_tokens"]["k"] >= 1 and doc["library_share"] == 0.5
  copy = doc["baselines"]["callee_copy"]  # the task's ELF examples carry what they call
  assert 0 < copy["threshold"] < 1 and 0 <= copy["overall_copy_rate"] <= 1
  assert copy["scores"]["functions"] == doc["examples"]["test"]
  assert "callee_copy_else_tfidf_nearest" in doc["baselines"]
  r = run("baselines", "--task", task, "--library-share", "0", "--json", tmp_path / "b.json")
  assert r.returncode == 0 and "own_dropped" not in r.stdout


def test_a_library_share_outside_0_to_1_is_one_line(task, tmp_path):
  r = run("baselines", "--task", task, "--library-share", "2", "--json", tmp_path / "b.json")
  assert r.returncode == 1 and r.stderr.strip().count("\n") == 0
  assert "--library-share 2.0" in r.stderr and not (tmp_path / "b.json").exists()


def test_function_groups_files_split_by_source_library(tmp_path):
  src = os.path.join(ROOT, "tests", "data", "similarity")
  roots = []
  for lib in ("codecs", "numeric", "strings"):
    os.makedirs(tmp_path / "src" / lib)
    shutil.copy(os.path.join(src, f"{lib}.c"), tmp_path / "src" / lib)
    roots.append(tmp_path / "src" / lib)
  bench = tmp_path / "bench.jsonl"
  r = run("similarity_build", "--sources", *roots, "--output", bench, "--compilers", "gcc",
          "--opt", "O0,O2")
  assert r.returncode == 0, r.stderr
  for variants, most in (("one", 1), ("all", 2)):
    out = tmp_path / variants
    r = run("naming_build", "--bench", bench, "--output", out, "--variants", variants)
    assert r.returncode == 0, r.stderr
    rows = read_jsonl(out / "train.jsonl") + read_jsonl(out / "test.jsonl")
    assert {r["library"] for r in rows} <= {"codecs", "numeric", "strings"}
    per_function = {}
    for row in rows:
      per_function.setdefault((row["library"], row["function"]), []).append(row["binary"])
    assert max(map(len, per_function.values())) <= most
    assert all(b.split(":")[-1] in ("gcc-O0", "gcc-O2") for b in sum(per_function.values(), []))


# --------------------------------------------------------------------------- bad input
def test_files_with_no_usable_names_are_one_line_naming_them_and_the_drops(elfs, tmp_path):
  r = run("naming_build", "--elf", *elfs, "--output", tmp_path / "t", "--min-instructions",
          "100000")
  assert r.returncode == 1 and r.stdout == ""
  line = r.stderr.strip()
  assert "\n" not in line and line.startswith("error: ") and elfs[0] in line
  assert "no usable function names" in line and "too_small 15" in line
  assert not os.path.exists(tmp_path / "t" / "task.json")


def test_a_stripped_program_has_no_usable_names(tmp_path):
  (tmp_path / "main.c").write_text("int main(void) { return 0; }\n")
  prog = tmp_path / "prog"
  subprocess.run(["gcc", str(tmp_path / "main.c"), "-o", str(prog)], check=True)
  subprocess.run(["strip", str(prog)], check=True)
  r = run("naming_build", "--elf", prog, "--output", tmp_path / "t")
  assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
  assert f"{prog}: no usable function names" in r.stderr


@pytest.mark.parametrize("case", ["missing", "not_elf", "bench_not_groups", "one_library",
                                  "output_not_empty"])
def test_bad_input_is_one_error_line_before_work(case, elfs, tmp_path):
  text = tmp_path / "notes.txt"
  text.write_text("not a binary\n")
  out = tmp_path / "t"
  argv = {"missing": ["--elf", tmp_path / "nope.so"],
          "not_elf": ["--elf", elfs[0], text],
          "bench_not_groups": ["--bench", elfs[0]],
          "one_library": ["--elf", elfs[0]],
          "output_not_empty": ["--elf", *elfs]}[case]
  if case == "output_not_empty":
    out.mkdir()
    (out / "x").write_text("")
  r = run("naming_build", *argv, "--output", out)
  line = r.stderr.strip()
  assert r.returncode != 0 and len(line.splitlines()) == 1, r.stderr
  want = {"missing": "no such file", "not_elf": f"{text}: not an ELF file",
          "bench_not_groups": "not a function-groups file", "one_library": "at least 2",
          "output_not_empty": "not empty"}[case]
  assert want in line
  assert not os.path.exists(out / "task.json")


# --------------------------------------------------------------------------- the names
@pytest.mark.parametrize("symbol,name,tokens", [
    ("memcpy@GLIBC_2.2.5", "memcpy", ["memcpy"]),
    ("memcpy@@GLIBC_2.14", "memcpy", ["memcpy"]),
    ("inflate_fast.cold", "inflate_fast", ["inflate", "fast"]),
    ("deflate_slow.isra.0", "deflate_slow", ["deflate", "slow"]),
    ("lz4_compress.constprop.0.isra.0", "lz4_compress", ["lz", "4", "compress"]),
    ("xmlParseDoc.part.3", "xmlParseDoc", ["xml", "parse", "doc"]),
    ("helper.lto_priv.0", "helper", ["helper"]),
    ("__libc_malloc", "libc_malloc", ["libc", "malloc"]),
    ("HTTPServerStart", "HTTPServerStart", ["http", "server", "start"]),
    ("sha256_update", "sha256_update", ["sha", "256", "update"]),
])
def test_symbols_normalise_to_names_and_sub_tokens(symbol, name, tokens):
  got, why = symbol_names.normalise(symbol)
  assert (got, why) == (name, "")
  assert symbol_names.tokens(got) == tokens


@pytest.mark.parametrize("symbol,why", [
    ("_init", "generated"), ("_start", "generated"), ("frame_dummy", "generated"),
    ("register_tm_clones", "generated"), ("__do_global_dtors_aux", "generated"),
    ("__x86.get_pc_thunk.bx", "generated"), ("_GLOBAL__sub_I_main", "generated"),
    ("sub_401a2c", "unnamed"), ("_ZN3foo3barEv", "cpp_mangled"), ("__", "no_letters"),
])
def test_generated_unnamed_and_cpp_symbols_are_dropped_with_their_reason(symbol, why):
  assert symbol_names.normalise(symbol) == (None, why)
