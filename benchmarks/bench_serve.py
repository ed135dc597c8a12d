"""lmscale serve under concurrent clients: latency and throughput of the HTTP API, beside the
same work done by direct function calls (the server's overhead as a ratio).

  python benchmarks/bench_serve.py (--workdir RUN | --hf DIR) --index INDEX_DIR --elf FILE
      [--clients 50] [--requests 1500] [--seconds 300] [--peer-requests 300]
      [--batch-texts 1 8] [--batch-functions 3000] [--lone-requests 40] [--out FILE]
      [--server-cpus 1 --client-cpus 0]

Batching (first; ``--batch-texts`` empty: skipped): for each size T of ``--batch-texts``, POST
/api/embed requests of T texts each (the functions of ``--elf`` in turn, ``--batch-functions``
functions in all), sent by one client alone (``--lone-requests`` of them: a lone request's
latency), by ``--clients`` clients and by half as many; beside the offline ``lmscale embed``
throughput (``function_vectors.embed`` after encoding, what ``lmscale embed`` runs, in this
process, warmed) on the same functions, measured before and after the server's runs (the
machine is shared: the mean of the two). The goals (issue 56): served functions/s at
``--clients`` >= 0.8x offline, and p99 at half the clients <= 3x the lone request's p50.

The server is the real one (``python -m lmscale_jax.cli.lmscale serve``, its own process, on
127.0.0.1 and a free port: never another host). ``--clients`` threads (standard library
http.client, one connection each) share ``--requests`` requests, stopping at ``--seconds``
whatever is left; the mix is one third each of /api/search with a text (a function of
``--elf``, k=10), /api/search with an upload of ``--elf`` and one of its functions named
(k=10), and /api/embed of 8 of its functions' texts. One request of each kind is sent first
(the model's programs compiled), outside the timing. Meanwhile a probe asks /api/info every
0.2 s: how the server answers while the model is busy.

Then one client sends ``--peer-requests`` requests of the mix, one after another: the
server's unloaded latency; and the peer row, the same requests without HTTP in this process:
the server's own functions (``serve/app.search_answers``, ``serve/app.embed``,
``serve/inputs.elf_queries``) on the same model and index. The two alternate request by
request (the machine is shared: its load drifts on both alike). ``overhead_ratio`` = the one
client's seconds over the peer's (what HTTP, JSON and a second process cost per request);
``overhead_ratio_loaded`` = the peer's requests/s over the ``--clients`` run's (the server
overlaps uploads' ELF extraction with the model's calls, which are one at a time: below 1 is
possible).

``--server-cpus`` / ``--client-cpus`` (Linux CPU ids): the server on the one set, this process
(its client threads, and the offline ``lmscale embed`` it compares with) on the other, so the
load generator does not take the server's cores; the offline row then runs on as many cores
as the server. Without them both share every core (the load generator competes with what it
measures).

The mix (``--requests 0``: skipped) follows. Writes one JSON document to ``--out`` (default ``benchmarks/results/<date>-cpu-serve.json``):
date, device, code version, the load, the server's count, errors (must be 0), statuses,
p50/p99 latency overall and per kind, throughput, /api/info under load, the peer row and the
ratios. Exit 1 (one line) if any request failed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import gc
import http.client
import itertools
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import _host  # noqa: E402
from lmscale_jax.cli.args import Parser, guarded, input_file, number  # noqa: E402
from lmscale_jax.errors import UserError  # noqa: E402
from lmscale_jax.child_process import stop_group  # noqa: E402
from lmscale_jax.store import file_io  # noqa: E402

KINDS = ("search_text", "search_upload", "embed")
EMBED_TEXTS = 8
K = 10


def parser() -> Parser:
  p = Parser(description=__doc__.splitlines()[0])
  p.add_argument("--workdir", default="", help="a training run's --workdir")
  p.add_argument("--hf", default="", help="a directory lmscale export-hf wrote")
  p.add_argument("--index", required=True, help="an index lmscale index built with that model")
  p.add_argument("--elf", required=True, type=input_file, help="the uploaded/queried ELF file")
  p.add_argument("--clients", type=number(int, 1, 200), default=50)
  p.add_argument("--requests", type=number(int, 0, 100_000), default=1500,
                 help="requests of the mix (0: the batching runs only)")
  p.add_argument("--seconds", type=number(float, 1, 3600), default=300)
  p.add_argument("--peer-requests", type=number(int, 1, 100_000), default=300)
  p.add_argument("--batch-texts", type=number(int, 1, 256), nargs="*", default=[1, 8],
                 help="texts per /api/embed request of the batching runs (none: skipped)")
  p.add_argument("--batch-functions", type=number(int, 1, 1_000_000), default=3000)
  p.add_argument("--lone-requests", type=number(int, 1, 10_000), default=40)
  p.add_argument("--server-cpus", type=cpu_ids, default=None, metavar="IDS",
                 help="run the server on these CPUs (e.g. 1 or 2,3)")
  p.add_argument("--client-cpus", type=cpu_ids, default=None, metavar="IDS",
                 help="run the clients and the offline peer on these CPUs (e.g. 0)")
  p.add_argument("--out", default=os.path.join(
      ROOT, "benchmarks", "results", f"{datetime.date.today().isoformat()}-cpu-serve.json"))
  return p


def cpu_ids(text: str) -> set[int]:
  """``"0"`` or ``"2,3"`` -> {0} or {2, 3}: CPUs this machine has (os.sched_getaffinity)."""
  try:
    ids = {int(x) for x in text.split(",")}
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r}: expected CPU ids like 0 or 2,3") from None
  if not ids or not ids <= os.sched_getaffinity(0):
    raise argparse.ArgumentTypeError(f"{text!r}: this process may run on CPUs "
                     f"{sorted(os.sched_getaffinity(0))} only")
  return ids


def percentile(values: list[float], q: float) -> float | None:
  if not values:
    return None
  ordered = sorted(values)
  return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summary(latencies: list[float]) -> dict:
  """count, p50/p99/max in milliseconds."""
  ms = [1000 * s for s in latencies]
  return {"count": len(ms), "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99),
          "max_ms": max(ms) if ms else None}


# ------------------------------------------------------------------------------------ requests
def work(elf: str) -> tuple[list, bytes]:
  """The mix's inputs: (name, text) of each function of ``elf`` and the file's bytes."""
  from lmscale_jax.prep.elf import elf_functions

  fns = [(f.name, f.text) for f in elf_functions.functions(elf)]
  if not fns:
    raise UserError(f"{elf}: no named x86-64 functions to query with")
  with open(elf, "rb") as f:
    return fns, f.read()


def request_of(i: int, fns: list, data: bytes, elf: str) -> tuple[str, str, bytes, str]:
  """(kind, path, body, content type) of request ``i`` of the mix."""
  kind = KINDS[i % len(KINDS)]
  name, text = fns[(i // len(KINDS)) % len(fns)]
  if kind == "search_text":
    return kind, "/api/search", json.dumps({"text": text, "k": K}).encode(), "application/json"
  if kind == "embed":
    texts = [fns[(i + j) % len(fns)][1] for j in range(EMBED_TEXTS)]
    return kind, "/api/embed", json.dumps({"texts": texts}).encode(), "application/json"
  boundary = uuid.uuid4().hex
  fields = {"function": name, "k": str(K)}
  body = b"".join(f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'
                  .encode() for k, v in fields.items())
  body += (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename='
           f'"{os.path.basename(elf)}"\r\n\r\n'.encode() + data
           + f"\r\n--{boundary}--\r\n".encode())
  return kind, "/api/search", body, f"multipart/form-data; boundary={boundary}"


class Client:
  """One keep-alive connection to the server (reopened after an error)."""

  def __init__(self, port: int):
    self.port, self.conn = port, None

  def send(self, method: str, path: str, body: bytes | None = None, kind: str | None = None):
    headers = {"Content-Type": kind} if kind else {}
    try:
      self.conn = self.conn or http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
      self.conn.request(method, path, body=body, headers=headers)
      r = self.conn.getresponse()
      answer = r.read()
      return r.status, answer
    except (OSError, http.client.HTTPException) as e:
      self.conn = None
      return 0, str(e).encode()


# ------------------------------------------------------------------------------------- server
def start_server(a) -> tuple[subprocess.Popen, int, str]:
  log = tempfile.NamedTemporaryFile("w", prefix="bench-serve-", suffix=".log", delete=False)
  model = ["--workdir", a.workdir] if a.workdir else ["--hf", a.hf]
  p = subprocess.Popen([sys.executable, "-m", "lmscale_jax.cli.lmscale", "serve", *model,
                        "--index", a.index, "--host", "127.0.0.1", "--port", "0"],
                       stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
  if a.server_cpus:  # before the interpreter starts its threads: they inherit it
    os.sched_setaffinity(p.pid, a.server_cpus)
  deadline = time.time() + 300
  while time.time() < deadline and p.poll() is None:
    found = re.search(r"serving http://127\.0\.0\.1:(\d+)/", open(log.name).read())
    if found and Client(int(found.group(1))).send("GET", "/api/info")[0] == 200:
      return p, int(found.group(1)), log.name
    time.sleep(0.5)
  stop_group(p)
  raise UserError(f"the server did not start (its log: {log.name})")




def warm_up(a, port: int, fns: list, data: bytes) -> None:
  """Each kind once: the model's programs compiled outside the timing."""
  for i in range(len(KINDS)):  # warm-up: each kind once, compiled outside the timing
    kind, path, body, ctype = request_of(i, fns, data, a.elf)
    status, answer = Client(port).send("POST", path, body, ctype)
    if status != 200:
      raise UserError(f"warm-up {kind}: HTTP {status} {answer[:200]!r}")


def load_server(a, port: int, fns: list, data: bytes, clients: int, requests: int) -> dict:
  """``clients`` threads sharing ``requests`` requests, and the /api/info probe's run."""
  lock, next_i, rows = threading.Lock(), [0], []
  deadline = time.time() + a.seconds

  def client():
    c = Client(port)
    while time.time() < deadline:
      with lock:
        i, next_i[0] = next_i[0], next_i[0] + 1
      if i >= requests:
        return
      kind, path, body, ctype = request_of(i, fns, data, a.elf)
      t = time.perf_counter()
      status, answer = c.send("POST", path, body, ctype)
      rows.append((kind, status, time.perf_counter() - t, answer[:200]))

  info, done = [], threading.Event()

  def probe():
    c = Client(port)
    while not done.wait(0.2):
      t = time.perf_counter()
      status, _ = c.send("GET", "/api/info")
      info.append((status, time.perf_counter() - t))

  prober = threading.Thread(target=probe, daemon=True)
  prober.start()
  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(clients) as pool:
    for f in [pool.submit(client) for _ in range(clients)]:
      f.result()
  elapsed = time.perf_counter() - start
  done.set()
  prober.join()
  return server_row(rows, info, elapsed)


def server_row(rows: list, info: list, elapsed: float) -> dict:
  failed = [r for r in rows if r[1] != 200]
  statuses = {}
  for r in rows:
    statuses[str(r[1])] = statuses.get(str(r[1]), 0) + 1
  return {"count": len(rows), "errors": len(failed), "statuses": statuses,
          "first_errors": [f"{k}: {s} {a.decode(errors='replace')}" for k, s, _, a in failed[:3]],
          "seconds": elapsed, "throughput_rps": len(rows) / elapsed,
          **summary([r[2] for r in rows]),
          "per_kind": {k: summary([r[2] for r in rows if r[0] == k]) for k in KINDS},
          "info_under_load": {"errors": sum(s != 200 for s, _ in info),
                              **summary([t for _, t in info])}}


# ---------------------------------------------------------------------------------- batching
def texts_of(i: int, size: int, fns: list) -> list[str]:
  """The texts of batching request ``i`` of ``size`` texts: the functions in turn."""
  return [fns[(i * size + j) % len(fns)][1] for j in range(size)]


def settled_heap() -> None:
  """A full collection now, then the heap frozen (as lmscale serve freezes its own): this
  process holds JAX and a model for the offline peer, and a full collection of that heap inside
  a timed run paused every client thread and counted as the server's latency (one text a
  request, half load, run after the 8-text runs: p99 133-185 ms where 30 ms before them)."""
  gc.collect()
  gc.freeze()


def embed_load(port: int, clients: int, bodies: list[bytes]) -> dict:
  """``clients`` threads, one connection each, sharing the POST /api/embed ``bodies``."""
  settled_heap()
  lock, next_i, rows = threading.Lock(), [0], []

  def client():
    c = Client(port)
    while True:
      with lock:
        i, next_i[0] = next_i[0], next_i[0] + 1
      if i >= len(bodies):
        return
      t = time.perf_counter()
      status, answer = c.send("POST", "/api/embed", bodies[i], "application/json")
      rows.append((status, time.perf_counter() - t, answer[:200]))

  counted = batching_counters(port)
  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(clients) as pool:
    for f in [pool.submit(client) for _ in range(clients)]:
      f.result()
  return {"clients": clients,
          **load_row(rows, time.perf_counter() - start, f"batching, {clients} clients"),
          "token_fill": token_fill(counted, batching_counters(port))}


def batching_counters(port: int) -> dict:
  """The server's batcher counters (/api/info's ``batching``)."""
  status, answer = Client(port).send("GET", "/api/info")
  if status != 200:
    raise UserError(f"GET /api/info: HTTP {status} {answer[:200]!r}")
  return json.loads(answer)["batching"]


def token_fill(before: dict, after: dict) -> float | None:
  """The share of the positions the model computed that were the requests' own tokens,
  between two reads of the counters (the rest: padding to the batch's rows and bucket)."""
  slots = after["token_slots"] - before["token_slots"]
  return (after["tokens"] - before["tokens"]) / slots if slots else None


def load_row(rows: list, elapsed: float, what: str) -> dict:
  """A load run's row from its (status, seconds, answer) ``rows``; one failed request ends the
  benchmark (one line naming ``what`` and the first failure)."""
  failed = [f"{s} {a.decode(errors='replace')}" for s, _, a in rows if s != 200]
  if failed:
    raise UserError(f"{what}: {len(failed)} requests failed: {failed[0]}")
  return {"requests": len(rows), "seconds": elapsed, "requests_per_s": len(rows) / elapsed,
          **summary([t for _, t, _ in rows])}


def open_load(port: int, rate: float, bodies: list[bytes], seed: int = 0) -> dict:
  """The POST /api/embed ``bodies`` sent at ``rate`` requests/s, Poisson arrivals (an open
  loop: a request is sent when it is due, whether or not earlier ones were answered, as users
  of a shared server send them). Latency counts from when it was due, so a client pool too
  small to send it on time would show (64 connections: far above the requests in flight at
  half load). Closed-loop clients, which send again the moment they are answered, keep any
  server saturated whatever their number: their latency is the queue, not the server's."""
  rng, local, rows = random.Random(seed), threading.local(), []
  dues = list(itertools.accumulate(rng.expovariate(rate) for _ in bodies))

  def send(body: bytes, due: float):
    local.client = getattr(local, "client", None) or Client(port)
    time.sleep(max(0.0, due - time.perf_counter()))
    status, answer = local.client.send("POST", "/api/embed", body, "application/json")
    rows.append((status, time.perf_counter() - due, answer[:200]))

  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(64) as pool:
    for f in [pool.submit(send, b, start + d) for b, d in zip(bodies, dues)]:
      f.result()
  return {"offered_requests_per_s": rate,
          **load_row(rows, time.perf_counter() - start, "batching, open load")}


def offline(model, texts: list[str], costs: dict | None = None) -> float:
  """Functions/s of ``lmscale embed``'s work on ``texts``: encoding, then
  function_vectors.embed (the offline length buckets; ``costs``: cut by measured passes, as
  the server cuts)."""
  from lmscale_jax.inference import function_vectors, trained_model

  start = time.perf_counter()
  codes = [trained_model.encode(model, t) for t in texts]
  function_vectors.embed(model, [(f"f{i}", "", ids, cut) for i, (ids, cut) in enumerate(codes)],
                         costs=costs)
  return len(texts) / (time.perf_counter() - start)


def offline_fill(model, texts: list[str], costs: dict | None = None) -> float:
  """The same share for the offline embedder's batches of ``texts`` (function_vectors'
  rule: WINDOW batches sorted by length at a time)."""
  from lmscale_jax.inference import function_vectors, trained_model

  lengths = [len(trained_model.encode(model, t)[0]) for t in texts]
  devices = function_vectors.mesh().devices.size
  return sum(lengths) / function_vectors.window_slots(lengths, devices, int(model.cfg.seq_len),
                                                      costs)


def measured(model) -> dict:
  """The passes' costs measured here, as the server measures its own (``Batcher.warm``)."""
  from lmscale_jax.inference import function_vectors

  return function_vectors.measured_passes(model, function_vectors.resolve_pool(model, None),
                                          function_vectors.mesh())


def offline_peers(model, texts: list[str], costs: dict) -> dict:
  """Functions/s offline under both cuts (by positions: ``lmscale embed``; by the measured
  passes: the server's rule), each once now; :func:`batching` calls it before and after."""
  return {"positions": offline(model, texts), "measured": offline(model, texts, costs)}


def batching(a, port: int, fns: list, model) -> list:
  """Per size of --batch-texts: lone, --clients and half as many, and offline (see above)."""
  warm = [json.dumps({"texts": texts_of(i, 32, fns)}).encode()
          for i in range(-(-len(fns) // 32))]
  embed_load(port, 1, warm)  # every bucket's program compiled in the server, untimed
  costs = measured(model)  # and here: every program, compiled and timed
  out = []
  for size in a.batch_texts:
    n = max(1, a.batch_functions // size)
    bodies = [json.dumps({"texts": texts_of(i, size, fns)}).encode() for i in range(n)]
    texts = [t for i in range(n) for t in texts_of(i, size, fns)]
    # Untimed first: these texts' passes (8 or 32 rows at each bucket) compiled here. Without
    # it the first timed offline run held compiles: 333 against 597-634 functions/s after.
    offline_peers(model, texts, costs)
    before = offline_peers(model, texts, costs)
    lone = embed_load(port, 1, bodies[:a.lone_requests])
    full = embed_load(port, a.clients, bodies)
    half = embed_load(port, max(1, a.clients // 2), bodies)
    settled_heap()
    half_load = open_load(port, full["requests_per_s"] / 2, bodies)
    after = offline_peers(model, texts, costs)
    out.append(batching_row(size, len(texts), lone, full, half, half_load, before, after))
    out[-1]["offline_token_fill"] = {"positions": offline_fill(model, texts),
                                     "measured": offline_fill(model, texts, costs)}
    print(json.dumps({**{k: out[-1][k] for k in ("texts_per_request", "throughput_ratio",
                                                 "p99_half_load_over_lone",
                                                 "offline_token_fill")},
                      "token_fill": full["token_fill"]}), flush=True)
  return out


def batching_row(size, functions, lone, full, half, half_load, before, after) -> dict:
  """The ratio is against the faster offline peer (either cut): the server must not look good
  by a cut that ``lmscale embed`` could use too."""
  offline_fps = {k: {"before": before[k], "after": after[k], "mean": (before[k] + after[k]) / 2}
                 for k in before}
  best = max(peer["mean"] for peer in offline_fps.values())
  for row in (lone, full, half, half_load):
    row["functions_per_s"] = row["requests_per_s"] * size
  return {"texts_per_request": size, "functions": functions, "lone": lone, "clients": full,
          "half_clients": half, "half_load": half_load,
          "offline_functions_per_s": offline_fps,
          "throughput_ratio": full["functions_per_s"] / best,
          "p99_half_load_over_lone": half_load["p99_ms"] / lone["p50_ms"],
          "p99_half_clients_over_lone": half["p99_ms"] / lone["p50_ms"],
          "goals": {"throughput_ratio_min": 0.8, "p99_half_load_over_lone_max": 3.0}}


# --------------------------------------------------------------------------------------- peer
def direct_calls(a, fns: list, data: bytes):
  """``call(i)``: request ``i`` of the mix by the server's functions in this process, warmed
  up; and the number of indexed functions."""
  from lmscale_jax.inference import trained_model
  from lmscale_jax.serve import app, inputs, served

  model = trained_model.load(a.workdir, a.hf)
  state = served.load(model, served.Limits(), None, a.index)
  name = os.path.basename(a.elf)

  def call(i):
    kind, _, body, _ = request_of(i, fns, data, a.elf)
    if kind == "search_text":
      return app.search_answers(state, [("text", None, json.loads(body)["text"])], K)
    if kind == "embed":
      return app.embed(model, json.loads(body)["texts"])
    fn = fns[(i // len(KINDS)) % len(fns)][0]
    return app.search_answers(state, inputs.elf_queries(data, name, fn, None, state.limits), K)

  for i in range(len(KINDS)):
    call(i)
  return call, len(state.corpus.names)


def paired(a, port: int, fns: list, data: bytes, call) -> tuple[dict, dict]:
  """(one client's row, the peer's row): request i through HTTP and by direct call, in turn
  (which goes first alternates), so that the shared machine's load drifts on both alike."""
  client, times = Client(port), {"server": [], "peer": []}
  for i in range(a.peer_requests):
    kind, path, body, ctype = request_of(i, fns, data, a.elf)
    for side in (("server", "peer") if i % 2 == 0 else ("peer", "server")):
      t = time.perf_counter()
      status = client.send("POST", path, body, ctype)[0] if side == "server" else call(i)
      times[side].append((kind, time.perf_counter() - t))
      if side == "server" and status != 200:
        raise UserError(f"one-client {kind}: HTTP {status}")
  return tuple(sequential_row(times[side]) for side in ("server", "peer"))


def sequential_row(times: list) -> dict:
  total = sum(t for _, t in times)
  return {"count": len(times), "seconds": total, "throughput_rps": len(times) / total,
          **summary([t for _, t in times]),
          "per_kind": {k: summary([t for kind, t in times if kind == k]) for k in KINDS}}


def batching_policy(port: int) -> dict:
  from lmscale_jax.inference import function_vectors
  from lmscale_jax.serve import batcher

  info = json.loads(Client(port).send("GET", "/api/info")[1])["batching"]
  return {"rows_per_pass_per_device": list(function_vectors.ROW_BUCKETS),
          "buckets": f"a pass is padded to the next multiple of seq_len / "
                     f"{function_vectors.BUCKETS} above its longest function",
          "cut": "the waiting functions, sorted by length, cut where the passes cost least "
                 "(dynamic programming): the server by its measured passes (pass_ms), "
                 "lmscale embed by positions computed + PASS_SLOTS a pass",
          "pass_ms": info["pass_ms"], "pass_slots": function_vectors.PASS_SLOTS,
          "window_batches": function_vectors.WINDOW, "wait_ms": 1000 * batcher.WAIT_S}


def mix(a, port: int, fns: list, data: bytes) -> dict:
  """The mix under --clients, one client alone, and the peer (see above)."""
  warm_up(a, port, fns, data)
  server = load_server(a, port, fns, data, a.clients, a.requests)
  call, _ = direct_calls(a, fns, data)
  one, direct = paired(a, port, fns, data, call)
  return {"server": server, "server_one_client": one, "peer": direct,
          "overhead_ratio": one["seconds"] / direct["seconds"],
          "overhead_ratio_loaded": direct["throughput_rps"] / server["throughput_rps"]}


def main(argv=None) -> int:
  a = parser().parse_args(argv)
  if bool(a.workdir) == bool(a.hf):
    parser().error("give --workdir RUN or --hf DIR (one of them)")

  def go() -> int:
    if a.client_cpus:  # before JAX starts its threads (the offline peer's): they inherit it
      os.sched_setaffinity(0, a.client_cpus)
    from lmscale_jax.inference import trained_model

    fns, data = work(a.elf)
    model = trained_model.load(a.workdir, a.hf)
    p, port, log = start_server(a)
    try:
      batched = batching(a, port, fns, model) if a.batch_texts else []
      mixed = mix(a, port, fns, data) if a.requests else {}
      policy = batching_policy(port)
    finally:
      stop_group(p)
    import jax

    doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": f"{_host.host_description(ROOT)}; jax {jax.devices()[0].platform}",
           "code": _host.code_version(), "model": a.workdir or a.hf, "index": a.index,
           "elf": a.elf, "elf_functions": len(fns), "batching_policy": policy,
           "batching": batched,
           "load": {"clients": a.clients, "requests": a.requests, "seconds_limit": a.seconds,
                    "mix": list(KINDS), "k": K, "embed_texts": EMBED_TEXTS, "host": "127.0.0.1"},
           "cpus": {"server": sorted(a.server_cpus or os.sched_getaffinity(0)),
                    "client": sorted(a.client_cpus or os.sched_getaffinity(0))},
           **mixed, "loadavg_1m": os.getloadavg()[0]}
    errors = mixed.get("server", {}).get("errors", 0)
    if errors:
      doc["server_log"] = log
    file_io.atomic_write_bytes(a.out, json.dumps(doc, indent=1).encode())
    print(json.dumps({"batching": [{k: b[k] for k in ("texts_per_request", "throughput_ratio",
                                                      "p99_half_load_over_lone")} for b in batched]}
                     | ({"overhead_ratio": mixed["overhead_ratio"],
                         "server": {k: mixed["server"][k] for k in
                                    ("count", "errors", "p50_ms", "p99_ms", "throughput_rps")},
                         "info_under_load": mixed["server"]["info_under_load"]}
                        if mixed else {}), indent=1))
    if errors:
      raise UserError(f"{errors} of {mixed['server']['count']} requests failed: "
                      f"{mixed['server']['first_errors'][0]}")
    return 0

  return guarded(go, "the benchmark stopped; nothing was written")


if __name__ == "__main__":
  sys.exit(main())
