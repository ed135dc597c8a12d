"""The HTTP API and the page (FastAPI): /api/info, /api/fill-mask, /api/embed, /api/search,
/api/function, and / (static/index.html). The state is loaded once (:mod:`served`) and passed
in; no request reloads anything.

Model calls go one at a time through :class:`ModelGate`: one model on 2 cores gains nothing from
concurrent forward passes (they share the cores), and requests waiting for the model wait as
coroutines, holding no thread, so /api/info answers at once under load."""

from __future__ import annotations

import os

import anyio
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException

from lmscale_jax.errors import UserError
from lmscale_jax.inference import function_vectors, mask_predictions, trained_model
from lmscale_jax.prep.elf import elf_functions
from lmscale_jax.search import query
from lmscale_jax.serve import inputs
from lmscale_jax.serve.guard import ApiError, Guard
from lmscale_jax.serve.served import Served
from lmscale_jax.store import file_io

PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static", "index.html")
MAX_WAITING = 256  # requests queued for the model before a 503 (50 clients: never reached)


class ModelGate:
  """One model call at a time; at most MAX_WAITING waiting (then 503, one line)."""

  def __init__(self, max_waiting: int = MAX_WAITING):
    self.max_waiting, self.waiting, self.limiter = max_waiting, 0, None

  async def run(self, fn, *args):
    if self.waiting >= self.max_waiting:
      raise ApiError(503, f"server busy: {self.waiting} requests wait for the model; retry later")
    self.limiter = self.limiter or anyio.CapacityLimiter(1)
    self.waiting += 1
    try:
      return await anyio.to_thread.run_sync(fn, *args, limiter=self.limiter)
    finally:
      self.waiting -= 1


def create_app(served: Served) -> FastAPI:
  app = FastAPI(title="lmscale serve", docs_url=None, redoc_url=None, openapi_url=None)
  gate = ModelGate()
  add_error_handlers(app)
  add_page(app)
  add_info(app, served)
  add_model_endpoints(app, served, gate)
  add_search(app, served, gate)
  add_function(app, served)
  app.add_middleware(Guard, token=served.token, max_body=served.limits.max_upload_bytes)
  return app


def error(status: int, message: str) -> JSONResponse:
  return JSONResponse({"error": message}, status_code=status)


def add_error_handlers(app: FastAPI) -> None:
  app.add_exception_handler(ApiError, lambda _, e: error(e.status, e.message))
  app.add_exception_handler(UserError, lambda _, e: error(400, str(e)))
  app.add_exception_handler(HTTPException, lambda r, e: error(
      e.status_code, f"{r.method} {r.url.path}: {e.detail}" if e.status_code in (404, 405)
      else str(e.detail)))


def add_page(app: FastAPI) -> None:
  html = None  # read once, at the start: the page is part of the installation, not of a request
  if os.path.exists(PAGE):
    with open(PAGE, encoding="utf-8") as f:
      html = f.read()

  @app.get("/", include_in_schema=False)
  def page():
    if html is None:
      raise ApiError(404, f"{PAGE}: the page is missing from this installation")
    return HTMLResponse(html)


def info(served: Served) -> dict:
  where = None
  if served.corpus is not None:
    where = {"path": served.index_dir, "binaries": len(served.rows),
             "functions": len(served.corpus.names)}
  model = served.model
  return {"model": model.source + (f" step {model.step}" if model.step is not None else ""),
          "seq_len": int(model.cfg.seq_len), "pool": served.pool, "index": where,
          "limits": {"max_upload_bytes": served.limits.max_upload_bytes,
                     "max_functions": served.limits.max_functions,
                     "max_texts": served.limits.max_texts, "max_k": served.limits.max_k}}


def add_info(app: FastAPI, served: Served) -> None:
  @app.get("/api/info")
  async def get_info():  # async: on the event loop, never behind the model's queue
    return info(served)


def fill_mask(model, text: str, k: int) -> dict:
  preds = mask_predictions.fill_text(model, text, k, what="text")
  ids, cut = trained_model.encode(model, text)
  masks = [{"position": int(p), "predictions": [{"token": t["token"], "score": t["probability"]}
                                                for t in top]}
           for p, top in zip(mask_predictions.mask_positions(model, ids), preds)]
  return {"text": text, "cut": bool(cut), "masks": masks}


def embed(model, texts: list[str]) -> dict:
  """``lmscale embed``'s vectors (function_vectors.embed: not normalised) of each text."""
  encoded = [trained_model.encode(model, t) for t in texts]
  out = function_vectors.embed(model, [(f"text{i}", "", ids, cut)
                                       for i, (ids, cut) in enumerate(encoded)])
  vectors = np.asarray(out["embeddings"], np.float32)
  return {"dim": int(vectors.shape[1]), "pool": str(out["pool"]), "embeddings": vectors.tolist(),
          "tokens": [len(ids) - 2 for ids, _ in encoded], "cut": [bool(c) for _, c in encoded]}


def add_model_endpoints(app: FastAPI, served: Served, gate: ModelGate) -> None:
  @app.post("/api/fill-mask")
  async def post_fill_mask(request: Request):
    doc = inputs.json_object(await request.body(), '{"text": "… [MASK] …", "k": 5}')
    text, k = inputs.text_of(doc), inputs.k_of(doc.get("k"), 5, served.limits)
    return await gate.run(fill_mask, served.model, text, k)

  @app.post("/api/embed")
  async def post_embed(request: Request):
    doc = inputs.json_object(await request.body(), '{"texts": ["push rbp [NEXT] …", …]}')
    return await gate.run(embed, served.model, inputs.texts_of(doc, served.limits))


def search_answers(served: Served, queries: list, k: int) -> dict:
  """query.search's answers with each query's text and each result's binary's sha256."""
  answers = query.search(served.model, served.corpus, queries, k)
  for a, (_, _, text) in zip(answers, queries):
    a["text"] = text
    a["results"] = [{"score": r["score"], "binary": r["binary"],
                     "sha256": served.sha256_of(r["binary"], r["function"], r["address"]),
                     "function": r["function"], "address": r["address"]} for r in a["results"]]
  return {"k": k, "queries": answers}


async def search_queries(request: Request, served: Served) -> tuple[list, int]:
  """(queries, k) of a search request: a multipart upload or a JSON text."""
  kind = request.headers.get("content-type", "")
  if kind.startswith("multipart/form-data"):
    async with request.form(max_files=1, max_fields=8) as form:  # closed: its spooled file
      upload = form.get("file")
      if not isinstance(upload, UploadFile):
        raise ApiError(400, "field file: expected an uploaded ELF file (multipart/form-data)")
      data, filename = await upload.read(), upload.filename
      k = inputs.k_of(inputs.field(form, "k"), 10, served.limits)
      name, address = inputs.field(form, "function"), inputs.field(form, "address")
    queries = await anyio.to_thread.run_sync(inputs.elf_queries, data, filename, name,
                                             inputs.address_of(address), served.limits)
    return queries, k
  doc = inputs.json_object(await request.body(), '{"text": "push rbp [NEXT] …", "k": 10} or '
                           "multipart/form-data with a field file")
  k = inputs.k_of(doc.get("k"), 10, served.limits)
  return inputs.text_queries(inputs.text_of(doc), served.limits), k


def add_search(app: FastAPI, served: Served, gate: ModelGate) -> None:
  @app.post("/api/search")
  async def post_search(request: Request):
    if served.corpus is None:
      raise ApiError(404, "no index loaded: start lmscale serve with --index INDEX_DIR")
    queries, k = await search_queries(request, served)
    return await gate.run(search_answers, served, queries, k)


def indexed_text(served: Served, sha256: str, address: int) -> dict:
  """The normalised text of an indexed function, re-read from its binary (checked unchanged)."""
  fn = served.function(sha256, address)
  if fn is None:
    raise ApiError(404, f"no function at address {address} of a binary with sha256 {sha256} "
                   "in the index")
  try:
    now = file_io.sha256_file(fn.binary)
  except OSError as e:
    raise ApiError(409, f"{fn.binary}: unreadable since it was indexed "
                   f"({file_io.error_reason(e)}); index it again") from None
  if now != sha256:
    raise ApiError(409, f"{fn.binary}: changed since it was indexed (sha256 {now[:12]}, indexed "
                   f"{sha256[:12]}); index it again")
  found = [f for f in elf_functions.functions(fn.binary) if f.address == address]
  if not found:
    raise ApiError(404, f"{fn.binary}: no function at {address:#x} any more")
  return {"binary": fn.binary, "sha256": sha256, "function": fn.function, "address": address,
          "text": found[0].text}


def add_function(app: FastAPI, served: Served) -> None:
  @app.get("/api/function")
  async def get_function(request: Request):
    sha256 = request.query_params.get("sha256", "")
    address = inputs.address_of(request.query_params.get("address"))
    if not sha256 or address is None:
      raise ApiError(400, "expected ?sha256=<the binary's sha256>&address=<int>")
    if served.corpus is None:
      raise ApiError(404, "no index loaded: start lmscale serve with --index INDEX_DIR")
    return await anyio.to_thread.run_sync(indexed_text, served, sha256, address)
