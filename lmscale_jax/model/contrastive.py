"""The fine-tuned embedding model: the BERT encoder, a pooling, a projection head and L2
normalisation; its InfoNCE loss; and the head's files beside an exported encoder.

  z = ContrastiveEncoder(cfg, proj_dim=128, pool="mean").apply({"params": p}, ids)  # [B, D]

``p`` is ``{"bert": BertForMLM parameters, "projection": {"kernel" [H, D], "bias" [D]}}``: the
encoder's tree is the pretraining one, MLM head included (fine-tuning leaves the head as it
was, so the exported directory stays a complete ``BertForMaskedLM``). Pooling: ``mean`` is the
mean of the last hidden layer over the non-pad tokens ([CLS] and [SEP] included: what
``attention_mask`` selects in transformers, so the recipe in docs/finetune.md is two lines),
``cls`` the [CLS] position's vector. The projection runs in float32, then the vector is
L2-normalised, so a dot product is the cosine the similarity benchmark ranks by.

Files (:func:`save_head`, :func:`load_head`): ``projection.safetensors`` (``weight`` [D, H]
and ``bias`` [D], torch's ``nn.Linear`` layout) and ``projection.json`` (format, pooling,
normalisation, sizes).
"""

from __future__ import annotations

import functools
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from lmscale_jax.config.modes import POOLS
from lmscale_jax.errors import UserError
from lmscale_jax.model import bert as model_lib
from lmscale_jax.store import file_io

HEAD_WEIGHTS = "projection.safetensors"
HEAD_CONFIG = "projection.json"
HEAD_FORMAT = "lmscale_jax.projection/1"


def pool(h, ids, pad_id: int, how: str):
  """h [B,S,H] → [B,H] float32: mean over the non-pad tokens, or the [CLS] (first) token."""
  h = h.astype(jnp.float32)
  if how == "cls":
    return h[:, 0]
  keep = (ids != pad_id).astype(jnp.float32)[..., None]
  return (h * keep).sum(axis=1) / jnp.maximum(keep.sum(axis=1), 1.0)


def l2_normalise(z):
  # max(norm, 1e-12) as torch.nn.functional.normalize, with optax's gradient at 0 (not NaN).
  return z / optax.safe_norm(z, 1e-12, axis=-1, keepdims=True)


class ContrastiveEncoder(nn.Module):
  cfg: ml_collections.ConfigDict   # the resolved BertForMLM config
  proj_dim: int
  pool: str = "mean"

  @nn.compact
  def __call__(self, input_ids, deterministic: bool = True):
    h = model_lib.BertForMLM(self.cfg, name="bert")(input_ids, None, deterministic)
    pooled = pool(h, input_ids, self.cfg.pad_id, self.pool)
    z = nn.Dense(self.proj_dim, dtype=jnp.float32, param_dtype=jnp.float32,
                 name="projection")(pooled)
    return l2_normalise(z)


def init_projection(cfg, proj_dim: int, rng) -> dict:
  """Fresh ``{"kernel", "bias"}`` of the head (flax's Dense initialisers); call under jit."""
  return nn.Dense(proj_dim, param_dtype=jnp.float32).init(
      rng, jnp.zeros((1, cfg.hidden), jnp.float32))["params"]


def info_nce(a, p, temperature: float):
  """Symmetric InfoNCE over in-batch negatives: row i of ``a`` [B,D] and of ``p`` [B,D] are a
  positive pair, every other row of the other side a negative (vectors L2-normalised).
  → (loss, accuracy): the mean of both directions' cross-entropies, and how often the
  positive scores highest among the B candidates (both directions)."""
  logits = jnp.einsum("id,jd->ij", a, p, preferred_element_type=jnp.float32) / temperature
  labels = jnp.arange(a.shape[0])
  loss = 0.5 * (optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
                + optax.softmax_cross_entropy_with_integer_labels(logits.T, labels).mean())
  accuracy = 0.5 * ((jnp.argmax(logits, axis=1) == labels).mean()
                    + (jnp.argmax(logits, axis=0) == labels).mean())
  return loss, accuracy


# --------------------------------------------------------------------------- inference
@functools.lru_cache(maxsize=8)
def _embed_fn(cfg_json: str, proj_dim: int, how: str):
  model = ContrastiveEncoder(ml_collections.ConfigDict(json.loads(cfg_json)), proj_dim, how)
  return jax.jit(lambda p, ids: model.apply({"params": p}, ids, deterministic=True))


def embed(cfg, bert_params, head: dict, ids: np.ndarray) -> np.ndarray:
  """ids [B,S] → the fine-tuned embeddings, float32 [B,D], unit length."""
  proj = head["projection"]
  fn = _embed_fn(cfg.to_json(), int(np.shape(proj["kernel"])[1]), head["pool"])
  return np.asarray(fn({"bert": bert_params, "projection": proj}, jnp.asarray(ids)))


# --------------------------------------------------------------------------- files
def save_head(head: dict, out_dir: str) -> None:
  """``projection.safetensors`` + ``projection.json`` into ``out_dir``."""
  from safetensors.numpy import save

  kernel = np.asarray(head["projection"]["kernel"], np.float32)
  tensors = {"weight": np.ascontiguousarray(kernel.T),
             "bias": np.asarray(head["projection"]["bias"], np.float32)}
  file_io.atomic_write_bytes(os.path.join(out_dir, HEAD_WEIGHTS), save(tensors))
  file_io.atomic_write_json(os.path.join(out_dir, HEAD_CONFIG), {
      "format": HEAD_FORMAT, "pool": head["pool"], "normalize": True,
      "in_features": int(kernel.shape[0]), "out_features": int(kernel.shape[1]),
      "pool_means": "mean: last hidden layer averaged over attention_mask (non-pad tokens, "
                    "[CLS] and [SEP] included); cls: the first token's",
      "embedding": "normalize(weight @ pooled + bias)"})


def load_head(directory: str, hidden: int) -> dict | None:
  """The head files of ``directory`` → ``{"pool", "projection": {"kernel", "bias"}}``; None if
  it has none (a plain exported encoder)."""
  from safetensors.numpy import load_file

  path, meta_path = (os.path.join(directory, n) for n in (HEAD_WEIGHTS, HEAD_CONFIG))
  if not os.path.exists(path) and not os.path.exists(meta_path):
    return None
  try:
    with open(meta_path) as f:
      meta = json.load(f)
    tensors = load_file(path)
  except (OSError, ValueError) as e:
    raise UserError(f"{directory}: unreadable projection head ({HEAD_WEIGHTS} + {HEAD_CONFIG}:"
                    f" {e}); export it again with lmscale export-hf") from None
  weight = tensors.get("weight")
  if (meta.get("format") != HEAD_FORMAT or meta.get("pool") not in POOLS or weight is None
      or weight.ndim != 2 or weight.shape[1] != hidden or "bias" not in tensors
      or tensors["bias"].shape != (weight.shape[0],)):
    raise UserError(f"{meta_path}: not a projection head for this encoder (format "
                    f"{meta.get('format')!r}, pool {meta.get('pool')!r}, weight "
                    f"{None if weight is None else list(weight.shape)}; expected {HEAD_FORMAT}, "
                    f"one of {list(POOLS)}, [D, {hidden}])")
  return {"pool": meta["pool"],
          "projection": {"kernel": np.ascontiguousarray(weight.T), "bias": tensors["bias"]}}
