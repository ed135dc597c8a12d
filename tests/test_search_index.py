"""lmscale index and lmscale search on real parts: small C files compiled by the machine's gcc
at -O0 and -O2, a real (short) training run and its Hugging Face export (tests/test_hf_tools.py's
fixtures), an index on disk built, extended, interrupted and damaged."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from lmscale_jax.inference import trained_model
from lmscale_jax.search import index, index_files, query
from tests.test_hf_tools import exported, run, run_tool  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

SOURCES = {
    "checksums.c": """
unsigned adler(const unsigned char *p, int n) {
  unsigned a = 1, b = 0;
  for (int i = 0; i < n; i++) { a = (a + p[i]) % 65521; b = (b + a) % 65521; }
  return (b << 16) | a;
}
unsigned fletcher(const unsigned short *p, int n) {
  unsigned s1 = 0, s2 = 0;
  while (n--) { s1 += *p++; s2 += s1; }
  return s2 << 16 | (s1 & 0xffff);
}
int parity(unsigned x) {
  x ^= x >> 16; x ^= x >> 8; x ^= x >> 4;
  return (0x6996 >> (x & 15)) & 1;
}
""",
    "strings.c": """
int my_strlen(const char *s) { int n = 0; while (s[n]) n++; return n; }
void reverse(char *s, int n) {
  for (int i = 0, j = n - 1; i < j; i++, j--) { char t = s[i]; s[i] = s[j]; s[j] = t; }
}
int count_char(const char *s, char c) {
  int k = 0;
  for (; *s; s++) k += *s == c;
  return k;
}
""",
    "maths.c": """
long gcd(long a, long b) { while (b) { long t = a % b; a = b; b = t; } return a; }
long power(long b, int e) {
  long r = 1;
  while (e > 0) { if (e & 1) r *= b; b *= b; e >>= 1; }
  return r;
}
int is_prime(int n) {
  if (n < 2) return 0;
  for (int d = 2; d * d <= n; d++) if (n % d == 0) return 0;
  return 1;
}
""",
}


@pytest.fixture(scope="module")
def binaries(tmp_path_factory):
  """{"O0": [.so …], "O2": [.so …]}: each source compiled as a shared library per level."""
  base = tmp_path_factory.mktemp("elf")
  out = {"O0": [], "O2": []}
  for name, text in SOURCES.items():
    (base / name).write_text(text)
    for level in out:
      so = base / f"{name[:-2]}_{level}.so"
      subprocess.run(["gcc", f"-{level}", "-shared", "-fPIC", "-o", str(so), str(base / name)],
                     check=True, timeout=120)
      out[level].append(str(so))
  return out


@pytest.fixture(scope="module")
def model(run):
  return trained_model.load(workdir=str(run[1]))


@pytest.fixture(scope="module")
def built(model, binaries, tmp_path_factory):
  """An index of the -O0 binaries."""
  where = str(tmp_path_factory.mktemp("index") / "idx")
  done = index.build(model, binaries["O0"], where, say=lambda _: None)
  return where, done


def test_index_holds_every_function_with_its_metadata_and_the_models_identity(run, built,
                                                                             binaries):
  where, done = built
  doc = json.load(open(os.path.join(where, "index.json")))
  assert done["added"] == binaries["O0"] and done["skipped"] == []
  assert doc["model"]["kind"] == "workdir" and doc["model"]["step"] == 6
  assert doc["model"]["workdir"] == os.path.abspath(run[1]) and len(doc["model"]["sha256"]) == 64
  assert [b["path"] for b in doc["binaries"]] == binaries["O0"]
  assert done["functions"] == sum(b["functions"] for b in doc["binaries"])
  for b in doc["binaries"]:
    vectors, rows = index_files.read_shard(where, b, doc["dim"])
    assert b["shard"] == f"shards/{b['sha256']}" and b["size"] == os.path.getsize(b["path"])
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    assert all(r["bytes"] > 0 and r["instructions"] > 0 and r["tokens"] > 0 for r in rows)
  names = {r["name"] for b in doc["binaries"] for r in index_files.read_shard(where, b, 64)[1]}
  assert {"adler", "fletcher", "parity", "my_strlen", "gcd", "is_prime"} <= names


def test_each_function_of_an_indexed_binary_finds_itself_first(model, built, binaries):
  corpus = query.load(built[0], model)
  for path in binaries["O0"]:
    for a in query.search(model, corpus, query.elf_queries(path), k=5):
      first = a["results"][0]
      assert (first["binary"], first["function"], first["address"]) == (
          os.path.abspath(path), a["query"], a["address"]) and first["score"] >= 0.9999, a


def test_adding_binaries_embeds_only_the_new_ones(model, built, binaries, tmp_path):
  where = str(tmp_path / "idx")
  shutil.copytree(built[0], where)
  before = {p: os.stat(os.path.join(where, "shards", p)).st_mtime_ns
            for p in os.listdir(os.path.join(where, "shards"))}
  done = index.build(model, binaries["O0"] + binaries["O2"], where, say=lambda _: None)
  assert done["added"] == binaries["O2"] and done["skipped"] == binaries["O0"]
  o2 = sum(len(index.elf_functions_of(p)) for p in binaries["O2"])
  assert done["functions"] == o2 and o2 > 0
  for p, mtime in before.items():  # the -O0 shards were not rewritten
    assert os.stat(os.path.join(where, "shards", p)).st_mtime_ns == mtime
  assert len(query.load(where, model).vectors) == built[1]["functions"] + o2


def test_an_interrupted_build_is_completed_by_a_rerun(model, built, binaries, tmp_path):
  """A crash mid-shard leaves a temp file and an index.json without that binary."""
  where = tmp_path / "idx"
  shutil.copytree(built[0], where)
  doc = json.loads((where / "index.json").read_text())
  lost = doc["binaries"].pop()
  (where / "index.json").write_text(json.dumps(doc))
  os.unlink(where / (lost["shard"] + ".jsonl"))
  os.rename(where / (lost["shard"] + ".npz"), where / "shards" / f".{lost['sha256']}.npz.x.tmp")
  done = index.build(model, binaries["O0"], str(where), say=lambda _: None)
  assert done["added"] == [lost["path"]] and done["functions"] == lost["functions"]
  assert not [n for n in os.listdir(where / "shards") if n.endswith(".tmp")]
  np.testing.assert_allclose(query.load(str(where), model).vectors,
                             query.load(built[0], model).vectors, atol=1e-6)


def test_search_command_prints_rows_and_writes_json(run, built, binaries, tmp_path, capsys):
  out = tmp_path / "r.json"
  code, text, err = run_tool("search", ["--index", built[0], "--workdir", run[1], "--elf",
                                        binaries["O0"][0], "--function", "adler", "--k", 3,
                                        "--json", out], capsys)
  assert code == 0, err
  got = json.loads(out.read_text())["queries"]
  assert [q["query"] for q in got] == ["adler"] and len(got[0]["results"]) == 3
  assert got[0]["results"][0]["function"] == "adler" and "adler @ 0x" in text
  address = hex(got[0]["address"])
  code, _, err = run_tool("search", ["--index", built[0], "--workdir", run[1], "--elf",
                                     binaries["O0"][0], "--address", address, "--k", 1,
                                     "--json", out], capsys)
  assert code == 0 and json.loads(out.read_text())["queries"][0]["query"] == "adler", err
  text_query = " [NEXT] ".join(["push rbp", "mov rbp rsp"] * 40)  # longer than seq_len 64
  code, text, err = run_tool("search", ["--index", built[0], "--workdir", run[1], "--text",
                                        text_query, "--k", 100, "--json", out], capsys)
  q = json.loads(out.read_text())["queries"][0]
  assert code == 0 and q["cut"] and "cut to the model's" in text
  assert len(q["results"]) == built[1]["functions"]  # k past the index's size: all of it
  code, text, _ = run_tool("index", ["--workdir", run[1], "--elf", *binaries["O0"], "--output",
                                     built[0]], capsys)
  assert code == 0 and "added 0 binaries" in text and "3 already indexed" in text


# --------------------------------------------------------------------------- bad input
def test_bad_input_is_one_line_each(run, exported, built, binaries, tmp_path, capsys):
  text_file = tmp_path / "notes.txt"
  text_file.write_text("not a binary\n")
  (tmp_path / "data.c").write_text("int table[4] = {1, 2, 3, 4};\n")
  no_code = tmp_path / "data.o"
  subprocess.run(["gcc", "-c", "-o", str(no_code), str(tmp_path / "data.c")], check=True)
  arm = tmp_path / "arm.so"
  data = bytearray(open(binaries["O0"][0], "rb").read())
  data[18:20] = (183).to_bytes(2, "little")  # e_machine = EM_AARCH64
  arm.write_bytes(bytes(data))
  bad_json = tmp_path / "bad_json"
  shutil.copytree(built[0], bad_json)
  (bad_json / "index.json").write_text("{not json")
  bad_shard = tmp_path / "bad_shard"
  shutil.copytree(built[0], bad_shard)
  first = json.loads((bad_shard / "index.json").read_text())["binaries"][0]
  np.savez(bad_shard / (first["shard"] + ".npz"), vectors=np.zeros((2, 3), np.float32))
  model = ["--workdir", run[1]]
  cases = [
      ("index", [*model, "--elf", text_file, "--output", tmp_path / "i1", "--strict"],
       "not an ELF file"),
      ("index", [*model, "--elf", no_code, "--output", tmp_path / "i2", "--strict"],
       "no named x86-64 functions"),
      ("index", [*model, "--elf", arm, "--output", tmp_path / "i3", "--strict"],
       "machine AArch64; the model reads x86-64 code"),
      ("index", [*model, "--elf", no_code, "--output", tmp_path / "i4"],
       "every file given was skipped (no_functions 1): nothing to index"),
      ("index", ["--hf", exported, "--elf", binaries["O0"][0], "--output", built[0]],
       "index.json: built by "),
      ("search", ["--index", built[0], "--hf", exported, "--text", "push rbp"],
       "not by the model given"),
      ("search", ["--index", bad_json, *model, "--text", "push rbp"], "not a JSON file"),
      ("search", ["--index", bad_shard, *model, "--text", "push rbp"],
       "vectors float32 [2, 3], index.json expects float32"),
      ("search", ["--index", built[0], *model, "--elf", binaries["O0"][0], "--function",
                  "adlr"], "has no function named 'adlr' (closest: adler"),
      ("search", ["--index", built[0], *model, "--elf", binaries["O0"][0], "--address",
                  "0x1"], "has no function at 0x1 (closest: "),
      ("search", ["--index", built[0], *model, "--text", "push rbp", "--function", "f"],
       "--function and --address pick a function of --elf FILE"),
  ]
  for name, argv, message in cases:
    code, _, err = run_tool(name, argv, capsys)
    assert code == 1, (name, argv, err)
    assert len(err.strip().splitlines()) == 1 and message in err, (name, err)
  assert json.load(open(os.path.join(built[0], "index.json")))["model"]["kind"] == "workdir"
