"""lmscale serve's HTTP API on real parts: the real server (``python -m lmscale_jax.cli.lmscale
serve`` as a subprocess on a free port), a real (short) training run (tests/test_hf_tools.py's
fixtures), a real index built by ``lmscale index`` over gcc-compiled shared libraries, and
standard-library HTTP clients. Each answer is compared with the command that computes it
(``lmscale fill-mask``, ``embed``, ``search``)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

import numpy as np
import pytest

from lmscale_jax.cli import index as index_cli
from lmscale_jax.prep.elf import elf_functions
from tests.helpers import ROOT, stop_process_group
from tests.test_hf_tools import exported, run, run_tool  # noqa: F401 (fixtures)
from tests.test_search_index import SOURCES, binaries  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

TOKEN = "s3cret-token"
LIMITS = ["--max-upload-mb", "0.1", "--max-texts", "4", "--max-k", "20", "--max-functions", "3"]


def serve_command(*argv) -> list[str]:
  return [sys.executable, "-m", "lmscale_jax.cli.lmscale", "serve", *map(str, argv)]


def start(argv, log_path, env=None) -> tuple[subprocess.Popen, str]:
  """The server on a port it picks (--port 0) and its base URL, once /api/info answers."""
  log = open(log_path, "w")
  p = subprocess.Popen(serve_command(*argv, "--port", 0), stdout=log, stderr=subprocess.STDOUT,
                       cwd=ROOT, env={**os.environ, **(env or {})}, start_new_session=True)
  deadline = time.time() + 180
  while time.time() < deadline and p.poll() is None:
    found = re.search(r"serving (http://[^/]+)/", open(log_path).read())
    if found and call(found.group(1), "/api/info", token=TOKEN)[0] in (200, 401):
      return p, found.group(1)
    time.sleep(0.5)
  stop(p)
  raise AssertionError(f"the server did not start:\n{open(log_path).read()[-3000:]}")


stop = stop_process_group  # tests/test_serve_page.py imports it under this name


def call(base, path, body=None, kind=None, token=TOKEN, method=None):
  """(status, JSON answer) of one request."""
  request = urllib.request.Request(base + path, data=body, method=method)
  if kind:
    request.add_header("Content-Type", kind)
  if token:
    request.add_header("Authorization", f"Bearer {token}")
  try:
    with urllib.request.urlopen(request, timeout=120) as r:
      return r.status, json.loads(r.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())
  except (ConnectionError, urllib.error.URLError) as e:
    return 0, {"error": str(e)}


def post_json(base, path, doc, token=TOKEN):
  return call(base, path, json.dumps(doc).encode(), "application/json", token)


def post_file(base, path, data: bytes, filename: str, token=TOKEN, **fields):
  """A multipart/form-data POST: ``file`` and text fields."""
  boundary = uuid.uuid4().hex
  parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
           for k, v in fields.items()]
  parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename='
               f'"{filename}"\r\nContent-Type: application/octet-stream\r\n\r\n'.encode()
               + data + b"\r\n")
  body = b"".join(parts) + f"--{boundary}--\r\n".encode()
  return call(base, path, body, f"multipart/form-data; boundary={boundary}", token)


@pytest.fixture(scope="module")
def libs(binaries, tmp_path_factory):
  """{"O0": [.so …], "O2": [.so …] (tests/test_search_index.py's), "all": one .so of every
  source (9 functions)}."""
  base = tmp_path_factory.mktemp("elf")
  out = dict(binaries)
  (base / "all.c").write_text("".join(SOURCES.values()))
  subprocess.run(["gcc", "-O0", "-shared", "-fPIC", "-o", str(base / "all.so"),
                  str(base / "all.c")], check=True, timeout=120)
  out["all"] = str(base / "all.so")
  return out


@pytest.fixture(scope="module")
def index_dir(run, libs, tmp_path_factory):
  """lmscale index over the -O0 libraries (its main, in this process)."""
  where = tmp_path_factory.mktemp("index") / "idx"
  assert index_cli.main(["--workdir", str(run[1]), "--elf", *libs["O0"], "--output",
                         str(where)]) == 0
  return where


@pytest.fixture(scope="module")
def server(run, index_dir, tmp_path_factory):
  """One server for the module: a token, small limits, its own TMPDIR (uploads' copies)."""
  base = tmp_path_factory.mktemp("server")
  (base / "tmp").mkdir()
  p, url = start(["--workdir", run[1], "--index", index_dir, "--token", TOKEN, *LIMITS],
                 base / "server.log", env={"TMPDIR": str(base / "tmp")})
  try:
    yield url, base
  finally:
    stop(p)


def test_info_names_the_model_the_index_and_the_limits(server, run, index_dir, libs):
  status, info = call(server[0], "/api/info")
  assert status == 200, info
  assert info["model"] == f"{run[1]} step 6" and info["seq_len"] == 64 and info["pool"] == "mean"
  functions = sum(len(elf_functions.functions(p)) for p in libs["O0"])
  assert info["index"] == {"path": os.path.abspath(index_dir), "binaries": 3,
                           "functions": functions}
  assert info["limits"] == {"max_upload_bytes": int(0.1 * (1 << 20)), "max_functions": 3,
                            "max_texts": 4, "max_k": 20}
  assert info["naming"] is None  # no --namer-workdir (tests/test_serve_name.py: with one)


def listening_addresses(port: int) -> set[str]:
  """The local addresses a socket listens on at ``port`` (/proc/net/tcp and tcp6)."""
  found = set()
  for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in open(table).read().splitlines()[1:] if os.path.exists(table) else ():
      local, state = line.split()[1], line.split()[3]
      address, hex_port = local.split(":")
      if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
        found.add(address)
  return found


def test_the_server_listens_on_the_loopback_address_only_by_default(server):
  port = int(server[0].rsplit(":", 1)[1])
  assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1, little-endian hex


def test_fill_mask_equals_the_fill_mask_command(server, run, capsys):
  text = "push rbp [NEXT] [MASK] rbp rsp [NEXT] [MASK] rsp 0x10"
  status, got = post_json(server[0], "/api/fill-mask", {"text": text, "k": 3})
  code, out, err = run_tool("fill_mask", ["--workdir", run[1], "--text", text, "--top-k", 3,
                                          "--json"], capsys)
  assert status == 200 and code == 0, (got, err)
  want = json.loads(out)
  assert got["text"] == text and got["cut"] is False
  assert [m["position"] for m in got["masks"]] == [4, 8]  # [CLS] push rbp [NEXT] [MASK] …
  for mask, top in zip(got["masks"], want, strict=True):
    assert [p["token"] for p in mask["predictions"]] == [p["token"] for p in top]
    np.testing.assert_allclose([p["score"] for p in mask["predictions"]],
                               [p["probability"] for p in top], rtol=1e-5)


def test_embed_equals_the_embed_commands_vectors(server, run, libs, tmp_path, capsys):
  so = libs["O2"][0]
  code, _, err = run_tool("embed", ["--workdir", run[1], "--elf", so, "--output",
                                    tmp_path / "e.npz"], capsys)
  assert code == 0, err
  texts = [f.text for f in elf_functions.functions(so)]
  status, got = post_json(server[0], "/api/embed", {"texts": texts})
  assert status == 200, got
  want = np.load(tmp_path / "e.npz")
  assert got["dim"] == 64 and got["pool"] == "mean" and got["cut"] == list(want["truncated"])
  assert got["tokens"] == list(want["tokens"])
  np.testing.assert_allclose(np.array(got["embeddings"]), want["embeddings"], atol=1e-5)


def test_search_by_upload_equals_the_search_command(server, run, index_dir, libs, tmp_path,
                                                    capsys):
  so = libs["O2"][2]
  code, _, err = run_tool("search", ["--index", index_dir, "--workdir", run[1], "--elf", so,
                                     "--k", 5, "--json", tmp_path / "s.json"], capsys)
  assert code == 0, err
  want_doc = json.loads((tmp_path / "s.json").read_text())
  want = want_doc["queries"]
  status, got = post_file(server[0], "/api/search", open(so, "rb").read(), "maths_O2.so", k="5")
  assert status == 200 and got["k"] == 5, got
  assert got["warning"] == want_doc["warning"] and "not fine-tuned" in got["warning"]  # MLM
  texts = {f.name: f.text for f in elf_functions.functions(so)}
  digests = {p: hashlib.sha256(open(p, "rb").read()).hexdigest() for p in libs["O0"]}
  for g, w in zip(got["queries"], want, strict=True):
    assert (g["query"], g["address"], g["tokens"], g["cut"]) == (
        w["query"], w["address"], w["tokens"], w["cut"])
    assert g["text"] == texts[g["query"]]
    assert [(r["binary"], r["function"], r["address"], r["same_text_as"],
             r["same_text_as_query"]) for r in g["results"]] == [
        (r["binary"], r["function"], r["address"], r["same_text_as"], r["same_text_as_query"])
        for r in w["results"]]
    np.testing.assert_allclose([r["score"] for r in g["results"]],
                               [r["score"] for r in w["results"]], atol=1e-5)
    assert all(r["sha256"] == digests[r["binary"]] for r in g["results"])
  status, one = post_file(server[0], "/api/search", open(so, "rb").read(), "maths_O2.so",
                          address=hex(want[1]["address"]), k="1")
  assert status == 200 and [q["query"] for q in one["queries"]] == [want[1]["query"]], one
  status, one = post_file(server[0], "/api/search", open(so, "rb").read(), "maths_O2.so",
                          function="gcd", k="2")
  assert status == 200 and [q["query"] for q in one["queries"]] == ["gcd"], one
  assert not os.listdir(server[1] / "tmp")  # every upload's private copy is gone


def test_search_by_text_says_when_the_query_was_cut(server, index_dir):
  status, got = post_json(server[0], "/api/search", {"text": "push rbp [NEXT] mov rbp rsp",
                                                     "k": 2})
  q = got["queries"][0]
  assert status == 200 and (q["query"], q["address"], q["cut"]) == ("text", None, False), got
  assert len(q["results"]) == 2 and q["results"][0]["score"] >= q["results"][1]["score"]
  long_text = " [NEXT] ".join(["push rbp", "mov rbp rsp"] * 40)  # past seq_len 64
  status, got = post_json(server[0], "/api/search", {"text": long_text, "k": 20})
  q = got["queries"][0]
  assert status == 200 and q["cut"] and q["tokens"] == 62 and q["text"] == long_text
  assert len(q["results"]) == 9  # k past the index's size: all of it


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")
def test_search_by_an_objdump_listing_finds_each_pasted_function(server, libs):
  path = libs["O0"][0]

  def listing(*only):
    return subprocess.run(["objdump", "-d", "-M", "intel", *only, path], check=True, text=True,
                          capture_output=True, timeout=60).stdout

  for f in elf_functions.functions(path):
    status, got = post_json(server[0], "/api/search", {"text": listing(f"--disassemble={f.name}"),
                                                       "k": 1})
    top = got["queries"][0]["results"][0]
    assert status == 200 and (top["function"], top["address"]) == (f.name, f.address), got
  status, got = post_json(server[0], "/api/search", {"text": listing(), "k": 1})  # .plt, _init …
  assert status == 413 and "over the server's limit of 3 per search" in got["error"], got
  status, got = post_json(server[0], "/api/search", {"text": "0000000000001139 <bad>:\n"
                                                     "    1139:\tff ff\n", "k": 1})
  assert status == 400 and "do not decode as x86-64" in got["error"], got


def test_function_gives_the_text_of_a_result_and_404_for_an_unknown_binary(server, libs):
  status, got = post_json(server[0], "/api/search", {"text": "push rbp [NEXT] mov rbp rsp"})
  best = got["queries"][0]["results"][0]
  status, fn = call(server[0], f"/api/function?sha256={best['sha256']}&address="
                               f"{best['address']}")
  assert status == 200, fn
  text = {f.address: f.text for f in elf_functions.functions(best["binary"])}[best["address"]]
  assert fn == {"binary": best["binary"], "sha256": best["sha256"],
                "function": best["function"], "address": best["address"], "text": text}
  status, err = call(server[0], f"/api/function?sha256={'0' * 64}&address={best['address']}")
  assert status == 404 and "in the index" in err["error"]


def damaged(path: str) -> bytes:
  """The ELF file with its .symtab's section type overwritten (PROGBITS): a fuzzed upload that
  pyelftools fails on with an AttributeError."""
  from elftools.elf.elffile import ELFFile

  with open(path, "rb") as f:
    elf = ELFFile(f)
    where = (elf["e_shoff"] + elf.get_section_index(".symtab") * elf["e_shentsize"]
             + 4)  # Elf64_Shdr.sh_type
  data = bytearray(open(path, "rb").read())
  data[where:where + 4] = (1).to_bytes(4, "little")
  return bytes(data)


def bad_requests(base, libs):
  """(what, (status, answer), expected status, words of the message)."""
  so = open(libs["O0"][0], "rb").read()
  arm = bytearray(so)
  arm[18:20] = (183).to_bytes(2, "little")  # e_machine = EM_AARCH64
  return [
      ("non-ELF upload", post_file(base, "/api/search", b"hello\n" * 100, "notes.txt"), 400,
       "notes.txt: not an ELF file"),
      ("no x86-64 code", post_file(base, "/api/search", bytes(arm), "arm.so"), 400,
       "arm.so: machine EM_AARCH64; the model reads x86-64 code"),
      ("damaged ELF", post_file(base, "/api/search", damaged(libs["O0"][0]), "bad.so"), 400,
       "bad.so: unreadable ELF file ("),
      ("upload over the limit", post_file(base, "/api/search", b"\x7fELF" + bytes(200_000),
                                          "big.so"), 413, "over the server's limit of 104857"),
      ("too many functions", post_file(base, "/api/search", open(libs["all"], "rb").read(),
                                       "all.so"), 413, "all.so: 9 functions, over the server's "
       "limit of 3"),
      ("unknown function", post_file(base, "/api/search", so, "c.so", function="adlr"), 404,
       "has no function named 'adlr' (closest: adler"),
      ("too many texts", post_json(base, "/api/embed", {"texts": ["push rbp"] * 5}), 413,
       "5 texts, over the server's limit of 4"),
      ("k too large", post_json(base, "/api/search", {"text": "push rbp", "k": 21}), 400,
       "k: 21 is out of range; expected an integer in 1..20"),
      ("no [MASK]", post_json(base, "/api/fill-mask", {"text": "push rbp"}), 400,
       "text has no [MASK]"),
      ("no naming model", post_json(base, "/api/name", {"texts": ["push rbp"]}), 404,
       "no naming model loaded: start lmscale serve with --namer-workdir RUN or --namer-hf"),
      ("bad JSON", call(base, "/api/embed", b"{texts", "application/json"), 400,
       "request body: not JSON"),
      ("missing token", call(base, "/api/info", token=None), 401, "Authorization: Bearer"),
      ("wrong token", post_json(base, "/api/embed", {"texts": ["push rbp"]}, token="guess"), 401,
       "missing or wrong access token"),
  ]


def test_each_bad_request_is_its_4xx_and_one_line_and_the_server_answers_after(server, libs):
  for what, (status, answer), want, words in bad_requests(server[0], libs):
    assert status == want, (what, status, answer)
    assert list(answer) == ["error"] and "\n" not in answer["error"], (what, answer)
    assert words in answer["error"], (what, answer)
    assert call(server[0], "/api/info")[0] == 200, what
  assert "Traceback" not in (server[1] / "server.log").read_text()


def test_startup_refusals_are_one_line_and_exit_1(run, exported, index_dir, tmp_path):
  bad_json = tmp_path / "bad_json"
  shutil.copytree(index_dir, bad_json)
  (bad_json / "index.json").write_text("{not json")
  cases = [
      (["--hf", exported, "--index", index_dir], "index.json: built by "),
      (["--workdir", run[1], "--index", bad_json], "index.json: not a JSON file"),
      (["--workdir", run[1], "--host", "0.0.0.0"], "--host 0.0.0.0 opens the server beyond "
       "this machine: give --token TOKEN"),
  ]
  env = {k: v for k, v in os.environ.items() if k != "LMSCALE_SERVE_TOKEN"}
  for argv, words in cases:
    p = subprocess.run(serve_command(*argv, "--port", 0), capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=180)
    assert p.returncode == 1 and words in p.stderr, (argv, p.stderr)
    assert len(p.stderr.strip().splitlines()) == 1 and "serving" not in p.stdout, p.stderr


def test_a_bug_in_a_handler_is_a_500_with_one_line_and_the_server_stays_up(run, caplog):
  """The app on a state whose model lacks what a handler reads (uvicorn in a thread)."""
  import threading

  import uvicorn

  from lmscale_jax.cli import serve as serve_cli
  from lmscale_jax.serve import app, served

  class NoModel:
    source, step, head = "nothing", None, None

  state = served.Served(NoModel(), served.Limits())
  sock = serve_cli.listen("127.0.0.1", 0)
  base = f"http://127.0.0.1:{sock.getsockname()[1]}"
  server = uvicorn.Server(uvicorn.Config(app.create_app(state), log_level="warning"))
  thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
  thread.start()
  try:
    deadline = time.time() + 30
    while call(base, "/api/search", b"{}", "application/json")[0] != 404:
      assert time.time() < deadline, "the app did not start"
      time.sleep(0.2)
    for _ in range(2):
      status, answer = post_json(base, "/api/embed", {"texts": ["push rbp"]})
      assert status == 500 and list(answer) == ["error"], answer
      assert answer["error"] == ("internal error (AttributeError) in /api/embed; the server's "
                                 "log has the traceback")
    assert "AttributeError" in caplog.text  # the traceback is the server's, not the client's
  finally:
    server.should_exit = True
    thread.join(10)


def test_function_of_a_binary_changed_or_gone_since_indexing_is_409(run, libs, tmp_path):
  """app.indexed_text, the handler's work, on an index of a copy that is then changed."""
  from lmscale_jax.inference import trained_model
  from lmscale_jax.serve import app, served
  from lmscale_jax.serve.guard import ApiError

  copy = tmp_path / "maths.so"
  shutil.copy(libs["O0"][2], copy)
  assert index_cli.main(["--workdir", str(run[1]), "--elf", str(copy), "--output",
                         str(tmp_path / "idx")]) == 0
  state = served.load(trained_model.load(workdir=str(run[1])), served.Limits(), None,
                      str(tmp_path / "idx"))
  sha256, (_, first, _) = next(iter(state.rows.items()))
  fn = state.function(sha256, state.corpus.addresses[first])
  assert app.indexed_text(state, fn.sha256, fn.address)["function"] == fn.function
  with open(copy, "ab") as f:
    f.write(b"\0")
  with pytest.raises(ApiError, match=r"maths.so: changed since it was indexed") as e:
    app.indexed_text(state, fn.sha256, fn.address)
  assert e.value.status == 409
  os.unlink(copy)
  with pytest.raises(ApiError, match=r"maths.so: unreadable since it was indexed \(") as e:
    app.indexed_text(state, fn.sha256, fn.address)
  assert e.value.status == 409
