"""The HTTP API and the page (FastAPI): /api/info, /api/fill-mask, /api/embed, /api/search,
/api/function, /api/name (a naming model's suggestions, when one is served), /healthz (also
/api/health) and / (static/index.html). The state is loaded once (:mod:`served`) and passed
in; no request reloads anything.

Model calls go through one :class:`batcher.Batcher`: the functions of concurrent /api/embed and
/api/search requests share length-bucketed batches on one model thread (one model on 2 cores
gains nothing from concurrent forward passes: they share the cores); fill-mask and naming run
on the same thread, between batches. Requests waiting for it wait as coroutines, holding no
thread, so /api/info and /healthz answer at once under load.

FastAPI's OpenAPI pages (/docs, /redoc, /openapi.json) are off: the endpoints read and check
their bodies themselves (a JSON object or a multipart upload, each fault one line), so the
generated schema would list them with no request body, and /docs loads Swagger UI's scripts
from a CDN, which a server on an offline or firewalled machine cannot reach.
docs/using-the-model.md ("Serve") is the API's reference."""

from __future__ import annotations

import contextlib
import os

import anyio
import numpy as np
import orjson
from fastapi import FastAPI, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException

from lmscale_jax.errors import UserError
from lmscale_jax.inference import (function_vectors, mask_predictions, name_suggestions,
                                   trained_model)
from lmscale_jax.prep.elf import elf_functions
from lmscale_jax.search import index, query
from lmscale_jax.serve import inputs
from lmscale_jax.serve.batcher import Batcher, normalised
from lmscale_jax.serve.guard import ApiError, Guard
from lmscale_jax.serve.served import Served
from lmscale_jax.store import file_io

PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static", "index.html")
INLINE_TEXTS = 8  # a request of at most this many texts is encoded on the event loop (encoded_soon)


def create_app(served: Served, batcher: Batcher | None = None) -> FastAPI:
  """``batcher``: the model thread (default: a new one, closed when the app shuts down)."""
  batcher = batcher or Batcher(served.model, served.pool)

  @contextlib.asynccontextmanager
  async def lifespan(_):
    yield
    await anyio.to_thread.run_sync(batcher.close)

  app = FastAPI(title="lmscale serve", docs_url=None, redoc_url=None, openapi_url=None,
                lifespan=lifespan)
  add_error_handlers(app)
  add_page(app)
  add_info(app, served, batcher)
  add_model_endpoints(app, served, batcher)
  add_search(app, served, batcher)
  add_function(app, served)
  add_name(app, served, batcher)
  app.add_middleware(Guard, token=served.token, max_body=served.limits.max_upload_bytes)
  return app


def answer(doc: dict) -> Response:
  """An answer as JSON, without FastAPI's ``jsonable_encoder`` walk over it (the answers are
  plain dicts, lists, str, int and float already): that walk cost 235 µs of a 370 µs
  serialisation for one function's embedding (128 floats) on this 2-core machine, and the
  standard library's encoder 52 µs of the rest, orjson 2.4 µs (the same text: both write a
  float's shortest round-trip form)."""
  return Response(orjson.dumps(doc, option=orjson.OPT_NON_STR_KEYS),
                  media_type="application/json")


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


def info(served: Served, batcher: Batcher) -> dict:
  where = None
  if served.corpus is not None:
    where = {"path": served.index_dir, "binaries": len(served.rows),
             "functions": len(served.corpus.names)}
  return {"model": described(served.model), "seq_len": int(served.model.cfg.seq_len),
          "pool": served.pool, "index": where, "naming": naming_info(served.namer),
          "limits": {"max_upload_bytes": served.limits.max_upload_bytes,
                     "max_functions": served.limits.max_functions,
                     "max_texts": served.limits.max_texts, "max_k": served.limits.max_k},
          "batching": {"rows_per_batch": batcher.size, "wait_ms": 1000 * batcher.wait_s,
                       "buckets": function_vectors.BUCKETS, "batches": batcher.batches,
                       "functions": batcher.rows_run, "model_busy_s": batcher.busy_s,
                       "tokens": batcher.tokens, "token_slots": batcher.token_slots,
                       "waiting": batcher.waiting, "pass_ms": pass_ms(batcher.costs)}}


def pass_ms(costs: dict | None) -> dict | None:
  """The measured passes the batches are cut by: {"ROWSxLENGTH": milliseconds}."""
  if costs is None:
    return None
  return {f"{rows}x{length}": round(1000 * s, 3) for (rows, length), s in sorted(costs.items())}


def described(model) -> str:
  return model.source + (f" step {model.step}" if model.step is not None else "")


def naming_info(namer: name_suggestions.Namer | None) -> dict | None:
  """The naming model /api/name answers with: its run or export, its rule, its vocabulary."""
  if namer is None:
    return None
  return {"model": described(namer.model), "rule": namer.rule,
          "vocabulary": len(namer.model.namer["tokens"])}


def health(served: Served, batcher: Batcher) -> JSONResponse:
  """200 and the model's identity while the model thread runs (the server listens only once the
  model and index are loaded: listening is ready); 503 when it has stopped."""
  ok = batcher.alive
  return JSONResponse({"status": "ok" if ok else "model thread stopped",
                       "model": served.identity,
                       "index_functions": len(served.corpus.names) if served.corpus else None},
                      status_code=200 if ok else 503)


def add_info(app: FastAPI, served: Served, batcher: Batcher) -> None:
  @app.get("/api/info")
  async def get_info():  # async: on the event loop, never behind the model's queue
    return info(served, batcher)

  # /healthz: outside /api/, so a load balancer polls it without the access token.
  app.get("/healthz")(lambda: health(served, batcher))
  app.get("/api/health")(lambda: health(served, batcher))


def fill_mask(model, text: str, k: int) -> dict:
  preds = mask_predictions.fill_text(model, text, k, what="text")
  ids, cut = trained_model.encode(model, text)
  masks = [{"position": int(p), "predictions": [{"token": t["token"], "score": t["probability"]}
                                                for t in top]}
           for p, top in zip(mask_predictions.mask_positions(model, ids), preds)]
  return {"text": text, "cut": bool(cut), "masks": masks}


def encoded(model, texts: list[str]) -> list:
  """(ids, cut) of each text, as ``lmscale embed`` encodes it."""
  return [trained_model.encode(model, t) for t in texts]


async def encoded_soon(model, texts: list[str]) -> list:
  """:func:`encoded`, on the event loop for a few texts, else in a worker thread. Encoding reads
  at most seq_len words a text (``trained_model.encode``): 0.08 ms a function (demo model) against
  the hand-off's cost to a thread and back."""
  if len(texts) <= INLINE_TEXTS:
    return encoded(model, texts)
  return await anyio.to_thread.run_sync(encoded, model, texts)


def embed_answer(pool: str, codes: list, vectors: np.ndarray) -> dict:
  return {"dim": int(vectors.shape[1]), "pool": pool, "embeddings": vectors.tolist(),
          "tokens": [len(ids) - 2 for ids, _ in codes], "cut": [bool(c) for _, c in codes]}


def embed(model, texts: list[str]) -> dict:
  """/api/embed's answer by a direct call (function_vectors.embed, not normalised): what the
  batched endpoint answers, without the batcher (benchmarks/bench_serve.py's peer)."""
  codes = encoded(model, texts)
  out = function_vectors.embed(model, [(f"text{i}", "", ids, cut)
                                       for i, (ids, cut) in enumerate(codes)])
  return embed_answer(str(out["pool"]), codes, np.asarray(out["embeddings"], np.float32))


async def batched_embed(served: Served, batcher: Batcher, texts: list[str]) -> dict:
  codes = await encoded_soon(served.model, texts)
  vectors = await batcher.vectors([ids for ids, _ in codes])
  return embed_answer(served.pool, codes, np.asarray(np.stack(vectors), np.float32))


def add_model_endpoints(app: FastAPI, served: Served, batcher: Batcher) -> None:
  @app.post("/api/fill-mask")
  async def post_fill_mask(request: Request):
    doc = inputs.json_object(await request.body(), '{"text": "… [MASK] …", "k": 5}')
    text, k = inputs.text_of(doc), inputs.k_of(doc.get("k"), 5, served.limits)
    return answer(await batcher.call(fill_mask, served.model, text, k))

  @app.post("/api/embed")
  async def post_embed(request: Request):
    doc = inputs.json_object(await request.body(), '{"texts": ["push rbp [NEXT] …", …]}')
    return answer(await batched_embed(served, batcher, inputs.texts_of(doc, served.limits)))


def answers_of(served: Served, queries: list, k: int, vectors: np.ndarray, codes: list) -> dict:
  """query.ranked's answers with each query's text and each result's binary's sha256, and the
  model's warning about its scores (query.similarity_warning; null for a similarity model)."""
  answers = query.ranked(served.corpus, [q[:3] for q in queries], vectors, codes, k)
  for a, (_, _, text, *called) in zip(answers, queries):
    if called:  # an upload's: what /api/name reads with the text (the page sends both)
      a["calls"] = called[0]
    a["text"] = text
    a["results"] = [{**r, "sha256": served.sha256_of(r["binary"], r["function"], r["address"])}
                    for r in a["results"]]
  out = {"k": k, "warning": query.similarity_warning(served.model), "queries": answers}
  if queries and len(queries[0]) > 4:  # an upload's namespace, for /api/name (the page)
    out["file_shares"] = queries[0][4]
  return out


def search_answers(served: Served, queries: list, k: int) -> dict:
  """/api/search's answer by a direct call, without the batcher (bench_serve.py's peer)."""
  vectors, codes = index.embed_texts(served.model, [(q[0], q[2]) for q in queries])
  return answers_of(served, queries, k, vectors, codes)


async def batched_search(served: Served, batcher: Batcher, queries: list, k: int) -> dict:
  codes = await encoded_soon(served.model, [q[2] for q in queries])
  vectors = normalised(await batcher.vectors([ids for ids, _ in codes]))
  return await anyio.to_thread.run_sync(answers_of, served, queries, k, vectors, codes)


SEARCH_BODY = '{"text": "push rbp [NEXT] …", "k": 10} or multipart/form-data with a field file'
NAME_BODY = ('{"texts": ["push rbp [NEXT] …", …], "k": 5} (optional "calls": per text, the '
             'names it calls; "file_shares": their file\'s, from /api/search), {"text": "…", '
             '"k": 5} or multipart/form-data with a field file')


async def search_queries(request: Request, served: Served, default_k: int = 10,
                         texts: bool = False) -> tuple[list, int]:
  """(queries, k) of a search request: a multipart upload or a JSON text; ``texts``
  (/api/name's): or a JSON list of function texts, as /api/embed takes them (each query
  unnamed: (None, None, text))."""
  kind = request.headers.get("content-type", "")
  if kind.startswith("multipart/form-data"):
    async with request.form(max_files=1, max_fields=8) as form:  # closed: its spooled file
      upload = form.get("file")
      if not isinstance(upload, UploadFile):
        raise ApiError(400, "field file: expected an uploaded ELF file (multipart/form-data)")
      data, filename = await upload.read(), upload.filename
      k = inputs.k_of(inputs.field(form, "k"), default_k, served.limits)
      name, address = inputs.field(form, "function"), inputs.field(form, "address")
    queries = await anyio.to_thread.run_sync(inputs.elf_queries, data, filename, name,
                                             inputs.address_of(address), served.limits,
                                             served.namer is not None)  # calls: for naming
    return queries, k
  doc = inputs.json_object(await request.body(), NAME_BODY if texts else SEARCH_BODY)
  k = inputs.k_of(doc.get("k"), default_k, served.limits)
  if texts and "texts" in doc:
    given = inputs.texts_of(doc, served.limits)
    calls = inputs.calls_of(doc, given) or [None] * len(given)
    shares = inputs.file_shares_of(doc)
    return [(None, None, t, c, shares) for t, c in zip(given, calls)], k
  return inputs.text_queries(inputs.text_of(doc), served.limits), k


def add_search(app: FastAPI, served: Served, batcher: Batcher) -> None:
  @app.post("/api/search")
  async def post_search(request: Request):
    if served.corpus is None:
      raise ApiError(404, "no index loaded: start lmscale serve with --index INDEX_DIR")
    queries, k = await search_queries(request, served)
    return answer(await batched_search(served, batcher, queries, k))


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


def names(served: Served, queries: list, k: int) -> dict:
  """/api/name's answer: ``lmscale name``'s suggestions (inference/name_suggestions, their one
  owner) for each query function, named and placed as /api/search names its queries."""
  namer = served.namer
  calls = [q[3] if len(q) > 3 else None for q in queries]
  shares = queries[0][4] if len(queries[0]) > 4 else None  # the file's: an upload's, or sent
  named = name_suggestions.suggest(namer, [q[2] for q in queries], k,
                                   calls=calls if any(c is not None for c in calls) else None,
                                   shares=shares)
  return {"model": described(namer.model), "rule": namer.rule, "k": k, "functions": [
      {"function": q[0], "address": q[1], **n, **({"calls": c} if c is not None else {})}
      for q, n, c in zip(queries, named, calls)]}


def add_name(app: FastAPI, served: Served, batcher: Batcher) -> None:
  @app.post("/api/name")
  async def post_name(request: Request):
    if served.namer is None:
      raise ApiError(404, "no naming model loaded: start lmscale serve with --namer-workdir RUN "
                     "or --namer-hf DIR (a lmscale finetune --task name run, or its export)")
    queries, k = await search_queries(request, served, default_k=5, texts=True)
    return answer(await batcher.call(names, served, queries, k))
