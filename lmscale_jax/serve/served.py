"""What the server holds, loaded once at start and passed to the app: the model, the index
(its vectors and, per function, where it came from) and the request limits."""

from __future__ import annotations

import dataclasses
import os

from lmscale_jax.inference import function_vectors, model_identity, name_suggestions, trained_model
from lmscale_jax.search import query


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
  """``rows``: sha256 → (path, first row, end row) of each indexed binary in ``corpus``;
  ``shas``: path → the sha256s indexed from it (two where a file was changed and indexed
  again). Per binary, not per function: an index of 1M functions adds no 1M objects.
  ``identity``: the model's, as an index records it (``inference/model_identity``: its run or HF
  directory, step and sha256), what /healthz answers. ``namer``: a naming fine-tune for
  /api/name (lmscale serve --namer-workdir/--namer-hf), or None."""
  model: trained_model.TrainedModel
  limits: Limits
  token: str | None = None
  index_dir: str | None = None
  corpus: query.Corpus | None = None
  rows: dict = dataclasses.field(default_factory=dict)
  shas: dict = dataclasses.field(default_factory=dict)
  identity: dict | None = None
  namer: name_suggestions.Namer | None = None

  @property
  def pool(self) -> str:
    return function_vectors.resolve_pool(self.model, None)

  def function(self, sha256: str, address: int) -> Indexed | None:
    """The indexed function at ``address`` of the binary ``sha256``."""
    path, lo, hi = self.rows.get(sha256, (None, 0, 0))
    for i in range(lo, hi):
      if self.corpus.addresses[i] == address:
        return Indexed(path, sha256, self.corpus.names[i], address)
    return None

  def sha256_of(self, path: str, name: str, address: int) -> str:
    """The sha256 of the binary a search result (path, function, address) came from (a path
    indexed twice with that function in both versions: the newer)."""
    shas = self.shas[path]
    if len(shas) > 1:
      shas = [s for s in shas if (f := self.function(s, address)) and f.function == name]
    return shas[-1]


def load(model, limits: Limits, token: str | None, index_dir: str | None,
         namer: name_suggestions.Namer | None = None) -> Served:
  """The served state; an index built by another model or a damaged one is one line here."""
  served = Served(model, limits, token or None, identity=model_identity.identity(model),
                  namer=namer)
  if index_dir is None:
    return served
  served.index_dir = os.path.abspath(index_dir)
  served.corpus = query.load(index_dir, model)
  served.corpus.prepared(build=True)  # the search structure made once, before listening
  row = 0  # query.load stacks the binaries' shards in index.json's order
  for b in served.corpus.entries:
    served.rows[b["sha256"]] = (b["path"], row, row + b["functions"])
    served.shas.setdefault(b["path"], []).append(b["sha256"])
    row += b["functions"]
  return served
