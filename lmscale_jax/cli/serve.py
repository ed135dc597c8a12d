"""The model and a function index as an HTTP API and a web page.

  lmscale serve (--workdir RUN [--step N] | --hf DIR) [--index INDEX_DIR]
      [--namer-workdir NAMER | --namer-hf NAMER_DIR]
      [--host 127.0.0.1] [--port 8000] [--token TOKEN (or env LMSCALE_SERVE_TOKEN)]
      [--max-upload-mb 32] [--max-functions 256] [--max-texts 256] [--max-k 100]
      [--batch-wait-ms 5] [--log-level info]

Endpoints (JSON; every error is {"error": one line}): GET /api/info, POST /api/fill-mask,
POST /api/embed, POST /api/search (an ELF upload or a text), GET /api/function, POST
/api/name (with a naming fine-tune: lmscale name's suggestions); GET /healthz
(no token needed: 200 and the model's identity while ready); GET / is the page. Concurrent
requests' functions share length-bucketed batches (serve/batcher.py). Bound to 127.0.0.1
unless --host says otherwise; another host needs --token, and then every /api/ request needs
"Authorization: Bearer TOKEN" (the page: open /#token=TOKEN). The models and the index are
loaded once, before the server listens. Ctrl-C or SIGTERM stops the server cleanly: exit 0.
"""

from __future__ import annotations

import argparse
import gc
import ipaddress
import logging
import os
import socket
import sys

from lmscale_jax.cli import args
from lmscale_jax.errors import UserError

TOKEN_ENV = "LMSCALE_SERVE_TOKEN"


def parser() -> argparse.ArgumentParser:
  p = args.Parser(prog="lmscale serve", description=__doc__.splitlines()[0])
  args.add_model_source(p)
  p.add_argument("--index", default=None, metavar="INDEX_DIR", help="what lmscale index wrote")
  namer = p.add_mutually_exclusive_group()
  namer.add_argument("--namer-workdir", default="", metavar="NAMER",
                     help="a lmscale finetune --task name run (its latest checkpoint): "
                     "/api/name and the page's suggested names")
  namer.add_argument("--namer-hf", default="", metavar="NAMER_DIR",
                     help="or its lmscale export-hf directory")
  p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
  p.add_argument("--port", type=args.number(int, 0, 65535), default=8000, help="0: any free")
  p.add_argument("--token", default=None, help=f"access token (default: ${TOKEN_ENV})")
  p.add_argument("--max-upload-mb", type=args.number(float, 1e-3, 4096), default=32)
  p.add_argument("--max-functions", type=args.number(int, 1, 1 << 20), default=256,
                 help="functions of an uploaded ELF file per search (more: 413)")
  p.add_argument("--max-texts", type=args.number(int, 1, 1 << 20), default=256,
                 help="texts per /api/embed request")
  p.add_argument("--max-k", type=args.number(int, 1, 1 << 20), default=100)
  p.add_argument("--batch-wait-ms", type=args.number(float, 0, 1000), default=5,
                 help="how long a request's functions wait for others' to share a batch "
                 "(a full batch runs at once)")
  p.add_argument("--log-level", choices=["debug", "info", "warning"], default="info",
                 help="the server's log on stderr (debug: tracebacks of rejected uploads too)")
  return p


def is_loopback(host: str) -> bool:
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


def listen(host: str, port: int) -> socket.socket:
  """The bound socket, or one line naming why not (a port in use, an unknown address)."""
  try:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
  except OSError as e:
    raise UserError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e}); "
                    "choose another port or host") from None
  return sock


def main(argv=None) -> int:
  parser_ = parser()
  a = parser_.parse_args(argv)
  # JAX, the model and the server here, not at module level: --help answers without them.
  from lmscale_jax.inference import name_suggestions, trained_model
  from lmscale_jax.search import query
  from lmscale_jax.serve import app as serve_app
  from lmscale_jax.serve import batcher as serve_batcher
  from lmscale_jax.serve import served as served_lib

  token = a.token if a.token is not None else os.environ.get(TOKEN_ENV) or None
  if not is_loopback(a.host) and not token:
    parser_.error(f"--host {a.host} opens the server beyond this machine: give --token TOKEN "
                  f"(or set {TOKEN_ENV}), or leave --host out (127.0.0.1)")
  limits = served_lib.Limits(int(a.max_upload_mb * (1 << 20)), a.max_functions, a.max_texts,
                             a.max_k)

  def go() -> int:
    import uvicorn

    model = trained_model.load(a.workdir, a.hf, a.step, a.tokenizer)
    namer = None
    if a.namer_workdir or a.namer_hf:
      namer = name_suggestions.load(a.namer_workdir, a.namer_hf,
                                    flags=("--namer-workdir", "--namer-hf"))
    served = served_lib.load(model, limits, token, a.index, namer)
    sock = listen(a.host, a.port)
    batcher = serve_batcher.Batcher(model, served.pool, wait_s=a.batch_wait_ms / 1000)
    batcher.warm()  # every bucket's program compiled before the first request
    if namer is not None:
      name_suggestions.warm(namer)  # the same for the naming model's row counts
    # The model, jax and the index are long-lived: out of the collector's sight, a full
    # collection is 0.005 ms, not 109 ms (demo model; each one a pause of every request).
    gc.freeze()
    port = sock.getsockname()[1]
    logging.basicConfig(level=a.log_level.upper(), format="%(levelname)s: %(message)s")
    functions = len(served.corpus.names) if served.corpus is not None else 0
    warning = query.similarity_warning(model) if served.corpus is not None else None
    if warning:  # what /api/search answers carry too ("warning")
      print(f"warning: {warning}", file=sys.stderr, flush=True)
    print(f"serving http://{a.host}:{port}/ (model {model.source}, "
          + (f"index {a.index}: {functions} functions" if a.index else "no index")
          + (f", naming {namer.given}" if namer is not None else "") + ")",
          flush=True)
    config = uvicorn.Config(serve_app.create_app(served, batcher), log_level=a.log_level,
                            timeout_keep_alive=5)
    try:
      uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # Terminated too: uvicorn has shut down cleanly and then raised
      pass  # the signal it caught again; a stop is how a server ends, not an error
    print("lmscale serve: stopped", flush=True)
    return 0

  return args.guarded(go, "the server stopped")


if __name__ == "__main__":
  sys.exit(main())
