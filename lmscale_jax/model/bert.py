"""BERT encoder + masked-LM head (Flax linen); its Hugging Face ``BertForMaskedLM`` mapping is
lmscale_jax/model/hf_convert.py.

``BertForMLM(cfg)`` takes the *resolved* model config (:func:`resolve_model_config`): vocab and
sequence length filled in from the dataset, plus ``pad_id``, ``remat`` and ``attention_impl``.

  logits = BertForMLM(cfg).apply({"params": p}, input_ids, mlm_positions,
                                 deterministic=False, rngs={"dropout": key})

``input_ids`` [B,S] int32, ``mlm_positions`` [B,P] int32 → logits [B,P,V] float32. The
vocabulary projection, the most expensive matmul for small models, runs only at the P gathered
positions, never at all S.

Precision: parameters are float32; matmuls, GELU and the residual stream run in ``cfg.dtype``;
LayerNorm statistics and normalization run in float32 (flax's ``force_float32_reductions``) and
cast back; attention softmax runs in float32; the decoder accumulates and returns float32 logits.

Attention: ``jax.nn.dot_product_attention`` with a key padding mask (``input_ids != pad_id``;
the cuDNN path passes it as per-row key lengths, cuDNN's own padding mask, see
:func:`padding_lengths`).
``implementation=None`` in jax 0.10 always means XLA (it does not pick cuDNN by itself), so
``cfg.attention_impl`` chooses: "auto" = cuDNN flash attention on GPU for bfloat16/float16
compute with a supported head size, XLA otherwise; "xla"; "cudnn". The fused call has no
attention-probability dropout, so when ``cfg.attention_dropout > 0`` and not deterministic an
explicit softmax path runs instead (materializing [B,N,S,S]); the shipped configs use
``attention_dropout = 0.0`` so training takes the fused path.

Packed sequences (``cfg.packed_attention``): "cross" is one attention window per sequence
(format-1 behaviour, bit for bit, with ``positions="absolute"``); "segment" gives every
``[CLS] … [SEP]`` span (a function, see :mod:`lmscale_jax.prep.packing`) its own window, so with
``positions="segment"`` or "instruction" each function is computed exactly as alone in a
sequence (and as the exported model sees it). Segments are derived here from the tokens (:func:`segment_ids`: a segment starts at each
[CLS]; MLM masking never touches specials), so the loader, per-process slicing and resume are
the same in both modes. Paths in segment mode: "xla" with the block-diagonal [B,1,S,S] mask
(:func:`segment_mask`), "cudnn" with that mask as cuDNN's dense bias (``jax.nn`` takes no
segment ids: jax 0.10's cuDNN packed layout, ``q_offsets``, is private and Hopper-only), and
"pallas" (Pallas GPU flash attention with ``segment_ids``: no [S,S] tensor in memory).

Positions (``cfg.positions``), independent of the attention windows: "absolute" = 0..S-1 over
the whole sequence; "segment" = restarting at 0 at each [CLS] (what a function alone gets);
"instruction" = undertale's instruction-trace embedding (arXiv 2509.05258's model,
``undertale/models/custom.py``): no position table, each token gets token + instruction index
(0, 1, … counted by ``[NEXT]``; the ``[NEXT]`` ends its instruction) + argument index (its
place inside the instruction), both restarting at each [CLS] (:func:`instruction_positions`),
computed here in the step from the tokens.

Norm (``cfg.norm``): "post" = BERT (LayerNorm after each residual add); "pre" = pre-LN
(LayerNorm on each branch's input, as undertale), plus a final LayerNorm before the MLM head
(undertale has none there; its head has its own LayerNorm, as ours).

Parameter tree (names chosen so that ``hf_convert.to_hf_state_dict`` is a 1:1 renaming)::

  embeddings/{word_embeddings,position_embeddings,token_type_embeddings}/embedding, LayerNorm
      (positions="instruction": instruction_embeddings and argument_embeddings, [S,H] each,
      instead of position_embeddings)
  layer_{i}/{query,key,value,attention_output,intermediate,output}/{kernel,bias},
  layer_{i}/{attention_LayerNorm,output_LayerNorm}/{scale,bias}
  final_LayerNorm                      (norm="pre" only; the embedding LayerNorm stays)
  mlm_transform/{kernel,bias}, mlm_LayerNorm/{scale,bias}, mlm_bias [V]
The decoder has no parameter of its own: it is the transposed word-embedding matrix.
"""

from __future__ import annotations


import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from lmscale_jax.config import checks as config_checks
from lmscale_jax.config import modes
from lmscale_jax.store import dataset

DTYPES = {name: jnp.dtype(name) for name in modes.DTYPES}
REMAT_POLICIES = {  # keyed by config.modes.REMAT
    "none": None,
    # Keeps the projection/FFN matmul outputs and recomputes the cheap elementwise ops and the
    # attention (its score/value einsums have batch dimensions, so they are not saved).
    "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    # Keeps only each block's input; the whole block is recomputed in the backward pass.
    "full": jax.checkpoint_policies.nothing_saveable,
}
# How the cuDNN path masks padding (resolved config ``cudnn_mask``): "lengths" (key lengths,
# cuDNN's padding mask) or "bias" (the [B,1,S,S] boolean mask turned into a bias, the earlier
# way; kept for A/B benchmarks).
CUDNN_MASKS = ("lengths", "bias")


# --------------------------------------------------------------------------- config
def resolve_model_config(model_cfg: ml_collections.ConfigDict, meta: dataset.DatasetMeta, *,
                         remat: str = "none",
                         start_positions: str | None = None) -> ml_collections.ConfigDict:
  """``config.model`` + the dataset's metadata → the config :class:`BertForMLM` takes.

  ``vocab_size``/``seq_len`` of 0 are taken from the dataset; a non-zero value must agree with
  it. ``positions="auto"`` becomes ``start_positions`` (those of the model the run starts
  from: the run it resumes, ``init_from``'s), else :func:`data_positions`. Adds ``pad_id``
  (from the dataset's special ids), ``remat`` (``config.train.remat``) and
  ``cudnn_mask`` (one of :data:`CUDNN_MASKS`; "lengths" unless a benchmark sets it) and
  ``cls_id`` (where segments start in ``packed_attention="segment"``; a ``--packing none``
  dataset resolves "segment" to "cross", the same computation) and ``next_id`` (the
  ``[NEXT]`` that ends an instruction, for ``positions="instruction"``).
  """
  config_checks.check_model_config(model_cfg, remat=remat)
  cfg = ml_collections.ConfigDict(model_cfg.to_dict())
  if cfg.positions == "auto":
    cfg.positions = start_positions or data_positions(meta)
  config_checks.check_model_fits_dataset(cfg, meta)
  cfg.vocab_size, cfg.seq_len = meta.vocab_size, meta.seq_len
  cfg.pad_id = meta.pad_id
  cfg.cls_id = int(meta.special_ids["[CLS]"])
  cfg.next_id = int(meta.special_ids["[NEXT]"])
  if cfg.packed_attention == "segment" and meta.raw.get("packing") == "none":
    # One function per record: the same computation as one window, and cuDNN keeps its
    # key-length padding mask instead of a dense [B,1,S,S] bias.
    cfg.packed_attention = "cross"
  cfg.remat = remat
  cfg.cudnn_mask = "lengths"  # see dot_product_attention; benchmarks A/B "bias"
  return cfg


def data_positions(meta: dataset.DatasetMeta) -> str:
  """What ``positions="auto"`` gives a new model: "instruction" on binary code (undertale's;
  benchmarks/longer_functions.sh, seq 256, the same CPU budget: the pretrained + fine-tuned
  similarity model 0.458 / 0.536 R@1 at pool 1,000 against 0.404 / 0.473 with "segment"),
  "segment" on text, which has no [NEXT] to count instructions by."""
  return "instruction" if meta.has_instructions else "segment"


def attention_impl(cfg: ml_collections.ConfigDict, deterministic: bool) -> str:
  """The attention path the model takes on this process's backend: xla | cudnn | pallas |
  explicit. "auto" never picks "pallas" (opt-in until lmscale gpu-check has measured it)."""
  if cfg.attention_dropout > 0 and not deterministic:
    return "explicit"
  if cfg.attention_impl != "auto":
    return cfg.attention_impl
  head_dim = cfg.hidden // cfg.heads
  # cuDNN flash attention takes only half-precision inputs and head sizes that are multiples of
  # 8 up to 128 (256 on Hopper; 128 is the portable bound).
  if (jax.default_backend() == "gpu" and cfg.dtype == "bfloat16"
      and head_dim % 8 == 0 and head_dim <= 128):
    return "cudnn"
  return "xla"


# --------------------------------------------------------------------------- segments
def segment_ids(input_ids, cls_id: int, pad_id: int):
  """Which function each token belongs to, int32 [B,S]: 1, 2, … in order, 0 at [PAD].

  A segment starts at each [CLS] (and at position 0, so a row that does not begin with [CLS]
  still has its first tokens in a segment). A function split across sequences starts each
  piece with [CLS], so it is a segment in each.
  """
  starts = (input_ids == cls_id).at[:, 0].set(True)
  seg = jnp.cumsum(starts, axis=1, dtype=jnp.int32)
  return jnp.where(input_ids == pad_id, 0, seg)


def segment_positions(input_ids, cls_id: int):
  """Position ids restarting at 0 at each [CLS], int32 [B,S] (what a function alone gets)."""
  s = input_ids.shape[1]
  index = jnp.arange(s, dtype=jnp.int32)[None, :]
  starts = (input_ids == cls_id).at[:, 0].set(True)
  return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


def instruction_positions(input_ids, cls_id: int, next_id: int):
  """(instruction index, argument index), int32 [B,S] each, restarting at each [CLS].

  ``[CLS] push rbp [NEXT] mov rbp rsp [NEXT] …`` → instructions 0 0 0 0 1 1 1 1 …, arguments
  0 1 2 3 0 1 2 3 …: the ``[NEXT]`` belongs to the instruction it ends (undertale's
  ``compute_instruction_index``/``compute_argument_index``, which shift the [NEXT] mask by one).
  Both are < S, the size of each table.
  """
  s = input_ids.shape[1]
  index = jnp.arange(s, dtype=jnp.int32)[None, :]
  functions = (input_ids == cls_id).at[:, 0].set(True)
  after_next = jnp.zeros_like(functions).at[:, 1:].set(input_ids[:, :-1] == next_id)
  count = jnp.cumsum(after_next, axis=1, dtype=jnp.int32)
  instruction = count - jax.lax.cummax(jnp.where(functions, count, 0), axis=1)
  starts = functions | after_next
  argument = index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
  return instruction, argument


def segment_mask(seg):
  """Block-diagonal attention mask from :func:`segment_ids`, bool [B,1,S,S] (query, key).

  A token attends to the tokens of its own segment; [PAD] (segment 0) attends only to [PAD],
  so no query row is fully masked. The dense mask the "xla" and "cudnn" segment paths take
  (and what lmscale gpu-check compares the kernels with).
  """
  return (seg[:, :, None] == seg[:, None, :])[:, None]


# --------------------------------------------------------------------------- layers
def dot_product_attention(q, k, v, key_mask, *, impl: str, dropout_rate: float = 0.0,
                          dropout_rng=None, cudnn_mask: str = "lengths", segments=None):
  """Multi-head attention core. q/k/v [B,S,N,D] (BTNH), key_mask [B,S] bool → [B,S,N,D].

  ``segments``: :func:`segment_ids` [B,S] for per-segment attention (then ``key_mask`` is not
  used: [PAD] is segment 0); None for one window per row (``packed_attention="cross"``).
  """
  if impl == "pallas":
    # Flash attention comparing segment ids per tile: nothing [S,S] is materialised. One window
    # per row is the segments non-pad = 1, [PAD] = 0 (identical outputs at non-pad tokens).
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    seg = key_mask.astype(jnp.int32) if segments is None else segments
    return pallas_attention.mha(q, k, v, seg, sm_scale=float(1.0 / np.sqrt(q.shape[-1])),
                                interpret=jax.default_backend() != "gpu")
  b, s = key_mask.shape
  if segments is not None:
    mask = segment_mask(segments)  # [B,1,S,S]: also the shape cuDNN needs for a dense mask
  elif impl == "explicit":
    mask = key_mask[:, None, None, :]
  elif impl == "cudnn":
    if cudnn_mask == "lengths":
      # cuDNN's padding mask type: no [B,1,S,S] bias tensor is built, and the kernel skips
      # fully padded key tiles. Exact because padding is trailing (see padding_lengths).
      return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=padding_lengths(
          key_mask), implementation="cudnn")
    # cuDNN adds a boolean mask as a bias, which it requires as [B,1,T,S] (no broadcast).
    mask = jnp.broadcast_to(key_mask[:, None, None, :], (b, 1, s, s))
  else:
    mask = key_mask[:, None, None, :]
  if impl == "explicit":
    return _explicit_attention(q, k, v, mask, dropout_rate, dropout_rng)
  # jax.nn takes no segment ids: segment mode gives "xla" and "cudnn" (as a bias) the dense mask.
  return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=impl)


def _explicit_attention(q, k, v, mask, dropout_rate: float, dropout_rng):
  """Softmax attention with attention-probability dropout (the fused calls have none)."""
  scale = 1.0 / np.sqrt(q.shape[-1])
  scores = jnp.einsum("btnd,bsnd->bnts", q, k, preferred_element_type=jnp.float32) * scale
  scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1)
  if dropout_rate > 0:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs.shape)
    probs = jnp.where(keep, probs / (1.0 - dropout_rate), 0.0)
  return jnp.einsum("bnts,bsnd->btnd", probs.astype(v.dtype), v)


def padding_lengths(key_mask):
  """Non-pad tokens per row, int32 [B]: the key length cuDNN's padding mask takes.

  Equals the position of the first [PAD] because padding is always trailing: prepared
  datasets pack ``[CLS] … [SEP] [PAD]…`` and MLM masking never writes [PAD].
  """
  return key_mask.sum(axis=-1, dtype=jnp.int32)


def _dense(cfg, features: int, name: str) -> nn.Dense:
  return nn.Dense(features, dtype=DTYPES[cfg.dtype], param_dtype=jnp.float32,
                  kernel_init=nn.initializers.normal(cfg.initializer_range),
                  bias_init=nn.initializers.zeros, name=name)


def _layer_norm(cfg, name: str) -> nn.LayerNorm:
  # Reductions and normalization happen in float32 (force_float32_reductions); `dtype` is only
  # the output dtype.
  return nn.LayerNorm(epsilon=cfg.layer_norm_eps, dtype=DTYPES[cfg.dtype],
                      param_dtype=jnp.float32, name=name)


class BertEmbeddings(nn.Module):
  cfg: ml_collections.ConfigDict

  def setup(self):
    cfg = self.cfg
    embed = lambda n, name: nn.Embed(n, cfg.hidden, dtype=DTYPES[cfg.dtype],
                                     param_dtype=jnp.float32, name=name,
                                     embedding_init=nn.initializers.normal(cfg.initializer_range))
    self.word_embeddings = embed(cfg.vocab_size, "word_embeddings")
    if cfg.positions == "instruction":
      self.instruction_embeddings = embed(cfg.seq_len, "instruction_embeddings")
      self.argument_embeddings = embed(cfg.seq_len, "argument_embeddings")
    else:
      self.position_embeddings = embed(cfg.seq_len, "position_embeddings")
    self.token_type_embeddings = embed(cfg.type_vocab_size, "token_type_embeddings")
    self.LayerNorm = _layer_norm(cfg, "LayerNorm")
    self.dropout = nn.Dropout(cfg.dropout)

  def __call__(self, input_ids, deterministic: bool, position_ids=None):
    s = input_ids.shape[1]
    if s > self.cfg.seq_len:
      raise ValueError(f"input length {s} exceeds model.seq_len={self.cfg.seq_len}")
    x = self.word_embeddings(input_ids)
    if self.cfg.positions == "instruction":
      instruction, argument = position_ids
      x = x + self.instruction_embeddings(instruction) + self.argument_embeddings(argument)
    elif position_ids is None:  # "absolute": 0..S-1 for every row
      x = x + self.position_embeddings(jnp.arange(s))[None]
    else:
      x = x + self.position_embeddings(position_ids)
    # Single-segment pretraining: every token has type 0 (the table exists for HF parity).
    x = x + self.token_type_embeddings(jnp.zeros((1, 1), jnp.int32))
    return self.dropout(self.LayerNorm(x), deterministic=deterministic)

  def decode(self, h):
    """Tied decoder: h [...,H] @ word_embeddings^T, float32 accumulation and result."""
    table = self.word_embeddings.embedding.astype(h.dtype)
    return jnp.einsum("...h,vh->...v", h, table, preferred_element_type=jnp.float32)


class BertLayer(nn.Module):
  cfg: ml_collections.ConfigDict

  @nn.compact
  def __call__(self, x, key_mask, segments, deterministic: bool):
    cfg = self.cfg
    b, s, h = x.shape
    n = cfg.heads
    dropout = lambda y: nn.Dropout(cfg.dropout)(y, deterministic=deterministic)
    attn_ln = _layer_norm(cfg, "attention_LayerNorm")
    out_ln = _layer_norm(cfg, "output_LayerNorm")

    def attention(y):
      heads = lambda name: _dense(cfg, h, name)(y).reshape(b, s, n, h // n)
      impl = attention_impl(cfg, deterministic)
      ctx = dot_product_attention(
          heads("query"), heads("key"), heads("value"), key_mask, impl=impl,
          dropout_rate=cfg.attention_dropout, cudnn_mask=cfg.cudnn_mask, segments=segments,
          dropout_rng=self.make_rng("dropout") if impl == "explicit" else None)
      return dropout(_dense(cfg, h, "attention_output")(ctx.reshape(b, s, h)))

    def mlp(y):
      y = jax.nn.gelu(_dense(cfg, cfg.ffn, "intermediate")(y), approximate=False)
      return dropout(_dense(cfg, h, "output")(y))

    if cfg.norm == "pre":  # same parameters, LayerNorms moved onto the branch inputs
      x = x + attention(attn_ln(x))
      return x + mlp(out_ln(x))
    x = attn_ln(x + attention(x))
    return out_ln(x + mlp(x))


def position_ids(cfg, input_ids):
  """What :class:`BertEmbeddings` adds for ``cfg.positions``: None ("absolute", 0..S-1), the
  segment positions [B,S], or the (instruction, argument) pair."""
  if cfg.positions == "segment":
    return segment_positions(input_ids, cfg.cls_id)
  if cfg.positions == "instruction":
    return instruction_positions(input_ids, cfg.cls_id, cfg.next_id)
  return None


class BertForMLM(nn.Module):
  cfg: ml_collections.ConfigDict

  @nn.compact
  def __call__(self, input_ids, mlm_positions, deterministic: bool = True):
    """→ MLM logits [B,P,V] at ``mlm_positions``; with ``mlm_positions=None`` the encoder's
    last hidden layer [B,S,H] instead (the MLM head is not run:
    lmscale_jax/model/contrastive.py)."""
    cfg = self.cfg
    key_mask = input_ids != cfg.pad_id
    segments = None
    if cfg.packed_attention == "segment":
      segments = segment_ids(input_ids, cfg.cls_id, cfg.pad_id)
    positions = position_ids(cfg, input_ids)
    embeddings = BertEmbeddings(cfg, name="embeddings")
    x = embeddings(input_ids, deterministic, positions)
    layer_cls = BertLayer
    if REMAT_POLICIES[cfg.remat] is not None:
      # static_argnums counts `self` as 0: `deterministic` is a Python bool.
      layer_cls = nn.remat(BertLayer, policy=REMAT_POLICIES[cfg.remat], static_argnums=(4,))
    for i in range(cfg.layers):
      x = layer_cls(cfg, name=f"layer_{i}")(x, key_mask, segments, deterministic)
    if cfg.norm == "pre":
      x = _layer_norm(cfg, "final_LayerNorm")(x)
    if mlm_positions is None:
      return x

    h = jnp.take_along_axis(x, mlm_positions[..., None], axis=1)  # [B,P,H]
    h = jax.nn.gelu(_dense(cfg, cfg.hidden, "mlm_transform")(h), approximate=False)
    h = _layer_norm(cfg, "mlm_LayerNorm")(h)
    bias = self.param("mlm_bias", nn.initializers.zeros, (cfg.vocab_size,), jnp.float32)
    return embeddings.decode(h) + bias


def init_params(cfg: ml_collections.ConfigDict, rng, batch: int = 1, predictions: int = 1):
  """Fresh float32 parameters (shapes do not depend on ``batch``/``predictions``).

  Pure, so ``jax.eval_shape(lambda r: init_params(cfg, r), rng)`` gives the shapes without
  allocating, and ``jax.jit`` (with ``out_shardings``) places them; call it under jit: eager
  initialization dispatches one random-number kernel per parameter and is slow.
  """
  ids = jnp.zeros((batch, cfg.seq_len), jnp.int32)
  positions = jnp.zeros((batch, predictions), jnp.int32)
  return BertForMLM(cfg).init({"params": rng}, ids, positions, deterministic=True)["params"]
