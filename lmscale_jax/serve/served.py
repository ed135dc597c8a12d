"""What the server holds, loaded once at start and passed to the app: the model, the index
(its vectors and, per function, where it came from) and the request limits."""

from __future__ import annotations

import dataclasses
import os

from lmscale_jax.inference import function_vectors, trained_model
from lmscale_jax.search import index_files, query


@dataclasses.dataclass(frozen=True)
class Limits:
  max_upload_bytes: int = 32 << 20
  max_functions: int = 256   # functions of one uploaded ELF searched in one request
  max_texts: int = 256       # texts of one /api/embed request
  max_k: int = 100


@dataclasses.dataclass(frozen=True)
class Indexed:
  """One function of the index: its binary (path, sha256), name and address."""
  binary: str
  sha256: str
  function: str
  address: int


@dataclasses.dataclass
class Served:
  model: trained_model.TrainedModel
  limits: Limits
  token: str | None = None
  index_dir: str | None = None
  corpus: query.Corpus | None = None
  binaries: int = 0
  by_row: dict = dataclasses.field(default_factory=dict)      # (path, name, address) → Indexed
  by_address: dict = dataclasses.field(default_factory=dict)  # (sha256, address) → Indexed

  @property
  def pool(self) -> str:
    return function_vectors.resolve_pool(self.model, None)


def load(model, limits: Limits, token: str | None, index_dir: str | None) -> Served:
  """The served state; an index built by another model or a damaged one is one line here."""
  served = Served(model, limits, token or None)
  if index_dir is None:
    return served
  served.index_dir = os.path.abspath(index_dir)
  served.corpus = query.load(index_dir, model)
  served.corpus.prepared(build=True)  # the search structure made once, before listening
  doc = index_files.read(index_dir)
  served.binaries = len(doc["binaries"])
  row = 0  # query.load stacks the binaries' shards in index.json's order
  for b in doc["binaries"]:
    for i in range(row, row + b["functions"]):
      fn = Indexed(b["path"], b["sha256"], served.corpus.names[i], served.corpus.addresses[i])
      served.by_row[(fn.binary, fn.function, fn.address)] = fn
      served.by_address[(fn.sha256, fn.address)] = fn
    row += b["functions"]
  return served
