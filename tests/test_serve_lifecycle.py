"""lmscale serve as a load balancer and an operator meet it, on the real server (a subprocess on
a free port) and a real (short) training run: /healthz, concurrent requests sharing batches
(each answered with its own rows, as if it came alone), and Ctrl-C."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest

from tests.helpers import ROOT
from tests.test_hf_tools import run  # noqa: F401 (fixture)
from tests.test_search_index import binaries  # noqa: F401 (fixture: libs uses it)
from tests.test_serve_api import (TOKEN, call, index_dir, libs, post_json,  # noqa: F401
                                  serve_command, start, stop)
from lmscale_jax.inference import function_vectors
from lmscale_jax.prep.elf import elf_functions


@pytest.fixture(scope="module")
def server(run, index_dir, tmp_path_factory):
  base = tmp_path_factory.mktemp("lifecycle-server")
  p, url = start(["--workdir", run[1], "--index", index_dir, "--token", TOKEN],
                 base / "server.log")
  try:
    yield url, base
  finally:
    stop(p)


def test_healthz_is_200_with_the_models_identity_and_needs_no_token(server, run, index_dir):
  status, answer = call(server[0], "/healthz", token=None)
  assert status == 200, answer
  assert answer["status"] == "ok" and answer["index_functions"] == 9
  model = answer["model"]
  assert (model["kind"], model["workdir"], model["step"]) == ("workdir", os.path.abspath(run[1]),
                                                              6)
  assert re.fullmatch(r"[0-9a-f]{64}", model["sha256"])
  import json  # the index records the same identity: one function computes both

  with open(os.path.join(index_dir, "index.json")) as f:
    assert json.load(f)["model"] == model
  assert call(server[0], "/api/health", token=TOKEN) == (200, answer)
  assert call(server[0], "/api/health", token=None)[0] == 401  # under /api/: the token's rule


def test_the_openapi_pages_are_off_with_one_line(server):
  for path in ("/docs", "/openapi.json"):
    status, answer = call(server[0], path, token=None)
    assert status == 404 and answer == {"error": f"GET {path}: Not Found"}, answer


def test_concurrent_requests_share_batches_and_each_gets_its_own_rows(server, libs):
  """24 requests at once, each of 1 to 3 texts: fewer forward passes than requests, and each
  answer is the vectors the same texts get alone (to float rounding: other rows in the batch,
  another bucket)."""
  texts = [f.text for path in libs["O0"] for f in elf_functions.functions(path)]
  asks = [[texts[(i + j) % len(texts)] for j in range(1 + i % 3)] for i in range(24)]
  alone = [post_json(server[0], "/api/embed", {"texts": t})[1]["embeddings"] for t in asks[:3]]
  before = call(server[0], "/api/info")[1]["batching"]
  with concurrent.futures.ThreadPoolExecutor(24) as pool:
    answers = list(pool.map(lambda t: post_json(server[0], "/api/embed", {"texts": t}), asks))
  after = call(server[0], "/api/info")[1]["batching"]
  assert all(status == 200 for status, _ in answers), answers[:2]
  rows = sum(map(len, asks))
  assert after["functions"] - before["functions"] == rows
  assert after["batches"] - before["batches"] < len(asks)  # shared: 24 requests, fewer passes
  for ask, (_, answer) in zip(asks, answers):
    assert len(answer["embeddings"]) == len(ask)
  # The model's work counted: each row's ids ([CLS] … [SEP]) within whole padded batches.
  ids = sum(n + 2 for _, answer in answers for n in answer["tokens"])
  slots = after["token_slots"] - before["token_slots"]
  assert after["tokens"] - before["tokens"] == ids
  assert ids < slots and slots % function_vectors.ROW_BUCKETS[0] == 0
  # The batches are cut by the passes the server timed before it listened: every program.
  assert len(after["pass_ms"]) == len(function_vectors.ROW_BUCKETS) * function_vectors.BUCKETS
  assert all(ms > 0 for ms in after["pass_ms"].values())
  for want, (_, got) in zip(alone, answers):
    np.testing.assert_allclose(got["embeddings"], want, rtol=1e-4, atol=1e-4)
  by_text = {}
  for ask, (_, answer) in zip(asks, answers):  # one text, one vector, whatever its batch
    for text, vector in zip(ask, answer["embeddings"]):
      np.testing.assert_allclose(by_text.setdefault(text, vector), vector, rtol=1e-4, atol=1e-4)


def test_ctrl_c_stops_the_server_with_exit_0_and_no_error_line(run, tmp_path):
  """SIGINT to a real server process (its default handler restored: a process started from a
  script's background inherits SIGINT ignored)."""
  log = tmp_path / "server.log"
  # Not ignored in this process while the child starts: an exec'd child keeps an ignored signal
  # ignored, a handled one reverts to the default (no preexec_fn: a fork of a JAX process).
  before = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    with open(log, "w") as out:
      p = subprocess.Popen(serve_command("--workdir", run[1], "--port", 0), stdout=out,
                           stderr=subprocess.STDOUT, cwd=ROOT)
  finally:
    signal.signal(signal.SIGINT, before)
  try:
    deadline = time.time() + 180
    while not re.search(r"serving (http://\S+)/", log.read_text()):
      assert p.poll() is None and time.time() < deadline, log.read_text()[-3000:]
      time.sleep(0.3)
    url = re.search(r"serving (http://\S+)/", log.read_text()).group(1)
    while call(url, "/healthz", token=None)[0] != 200:
      assert time.time() < deadline, log.read_text()[-3000:]
      time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=60) == 0, log.read_text()[-3000:]
  finally:
    if p.poll() is None:
      p.kill()
      p.wait()
  text = log.read_text()
  assert "error:" not in text and "Traceback" not in text, text[-3000:]
  assert text.rstrip().endswith("lmscale serve: stopped"), text[-3000:]
