"""Parameter counts, training FLOPs (the MFU numerator), memory (an analytic estimate and the
compiled peak), device peaks.

All functions take the *resolved* model config (``model.bert.resolve_model_config``), in which
``vocab_size``, ``seq_len`` and ``remat`` are filled in.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_collections

from lmscale_jax.model import bert as model_lib

_BYTES = {"float32": 4, "bfloat16": 2}


def param_count(params) -> int:
  """Number of scalars in a parameter pytree (arrays or ``jax.ShapeDtypeStruct``s)."""
  return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(params))


def count_params_from_config(cfg: ml_collections.ConfigDict) -> int:
  """Analytic parameter count of ``BertForMLM(cfg)``; equals :func:`param_count` of its params."""
  h, f, v = cfg.hidden, cfg.ffn, cfg.vocab_size
  ln = 2 * h
  tables = 2 if cfg.positions == "instruction" else 1  # instruction + argument, or positions
  embeddings = (v + tables * cfg.seq_len + cfg.type_vocab_size) * h + ln
  layer = 4 * (h * h + h) + (h * f + f) + (f * h + h) + 2 * ln  # q,k,v,out; ffn in/out; 2 LNs
  head = (h * h + h) + ln + v  # transform dense, its LN, output bias (decoder tied)
  final_ln = ln if cfg.norm == "pre" else 0
  return embeddings + cfg.layers * layer + final_ln + head


def train_flops_per_sequence(cfg: ml_collections.ConfigDict, seq_len: int,
                             num_predictions: int) -> int:
  """Matmul FLOPs of one training step (forward + backward) for one sequence.

  With L layers, hidden H, FFN width F, vocabulary V, S tokens and P predicted positions::

    6 · N_enc · S            N_enc = L · (4·H² + 2·H·F): the q/k/v/output projections and the
                             two FFN matrices. Embedding lookups are gathers, not matmuls, so
                             the embedding tables are excluded.
    + 3 · (2·2·S²·H) · L     attention scores Q·Kᵀ and probabilities·V, 2·S²·H each forward,
                             ×3 for forward + backward (whatever the implementation recomputes)
                             over the full S×S window in both ``model.packed_attention``
                             modes: "segment" masks the off-diagonal blocks but the kernels
                             (XLA and cuDNN with the dense mask, Pallas comparing segment ids
                             per tile) still compute them, and counting them keeps MFU the
                             same number it was (a run's FLOPs do not depend on its packing)
    + 6 · P · (H² + H·V)     the MLM head (transform dense + tied decoder), run only at the P
                             gathered positions.

  Each matmul costs 2 FLOPs per multiply-add forward and twice that backward (gradients
  w.r.t. inputs and weights), hence the factor 6 = 2 + 4. Biases, LayerNorm, GELU and softmax
  are not counted; rematerialization is not counted either (MFU, not HFU).
  """
  h, f, v, layers = cfg.hidden, cfg.ffn, cfg.vocab_size, cfg.layers
  n_enc = layers * (4 * h * h + 2 * h * f)
  encoder = 6 * n_enc * seq_len
  attention = 3 * (2 * 2 * seq_len * seq_len * h) * layers
  head = 6 * num_predictions * (h * h + h * v)
  return encoder + attention + head


def train_flops_per_step(cfg: ml_collections.ConfigDict, global_batch: int, seq_len: int,
                         num_predictions: int) -> int:
  """:func:`train_flops_per_sequence` × the global batch (all devices, all accumulation steps)."""
  return global_batch * train_flops_per_sequence(cfg, seq_len, num_predictions)


def memory_estimate_bytes(cfg: ml_collections.ConfigDict, per_device_batch: int, seq_len: int,
                          num_predictions: int, *, accum_steps: int = 1,
                          fsdp_devices: int = 1) -> int:
  """Rough peak device memory of one training step, in bytes.

  Assumptions (an estimate to choose batch size / levers with, not a guarantee; for the
  compiler's own number see lmscale max-batch):
    * state = 16 B/param: float32 params, float32 grads, Adam's two float32 moments; plus
      2 B/param for the bfloat16 copies of the weights when compute is bfloat16;
    * ``fsdp_devices`` > 1 (train.fsdp): params, moments and reduced grads are split over
      that many devices; each device still holds the gathered compute-dtype weights and its
      local full-size gradients while the step runs;
    * ``accum_steps`` > 1: activations are those of one microbatch
      (``per_device_batch / accum_steps`` sequences), plus a float32 gradient accumulator
      (4 B/param) beside the microbatch's own gradients;
    * activations kept for the backward pass, per token and layer, in the compute dtype:
      block input, q, k, v, attention context, pre-LN residual sum, post-LN output, FFN
      pre-GELU and post-GELU, second pre-LN sum = 8·H + 2·F values; one byte per H for each of
      the two dropout masks when dropout > 0; with XLA or explicit attention (not cuDNN flash)
      also the [N,S] attention probabilities, once in float32 and once in compute dtype;
    * remat "dots" keeps only block input + matmul outputs (6·H + F); "full" keeps only the
      block input (H); both then also hold one layer's full activations while recomputing;
    * embeddings keep 2·H per token; the head keeps 4·H per prediction plus three float32
      [V] rows (logits, log-softmax, their gradient);
    * XLA temporaries, fragmentation and the runtime's own reservation are not counted.
  """
  compute = _BYTES[cfg.dtype]
  n = count_params_from_config(cfg)
  d = max(1, int(fsdp_devices))
  k = max(1, int(accum_steps))
  copies = 2 * n if cfg.dtype != "float32" else 0
  if d == 1 and k == 1:
    state = 16 * n + copies
  else:
    # sharded params + moments + reduced grads; gathered compute weights; local gradients
    # (compute dtype) and, with accumulation, their float32 running sum.
    state = 16 * n // d + compute * n + compute * n + (4 * n if k > 1 else 0)

  h, f = cfg.hidden, cfg.ffn
  impl = model_lib.attention_impl(cfg, deterministic=False)
  full_layer = (8 * h + 2 * f) * compute
  if cfg.dropout > 0:
    full_layer += 2 * h
  if impl != "cudnn":
    full_layer += cfg.heads * seq_len * (4 + compute)
  if impl == "explicit":
    full_layer += cfg.heads * seq_len  # attention dropout mask
  kept = {"none": full_layer, "dots": (6 * h + f) * compute, "full": h * compute}[cfg.remat]
  recompute = full_layer if cfg.remat != "none" else 0

  micro = max(1, per_device_batch // k)
  tokens = micro * seq_len
  predictions = micro * num_predictions
  activations = (tokens * (cfg.layers * kept + recompute + 2 * h * compute)
                 + predictions * (4 * h * compute + 3 * 4 * cfg.vocab_size))
  return state + activations


# Dense (no structured sparsity) tensor-core peaks from NVIDIA's datasheets, in TFLOP/s.
# "float32" is the TF32 peak: XLA runs float32 matmuls on TF32 tensor cores at jax's default
# matmul precision on these GPUs.
DEVICE_PEAK_TFLOPS = {
    "H200": {"bfloat16": 989.0, "float32": 494.5},  # also matches GH200
    "H100 SXM": {"bfloat16": 989.0, "float32": 494.5},
    "H100 NVL": {"bfloat16": 835.0, "float32": 417.5},
    "H100 PCIe": {"bfloat16": 756.0, "float32": 378.0},
    "A100": {"bfloat16": 312.0, "float32": 156.0},
}


def peak_bytes(memory_analysis) -> int:
  """Device bytes a compiled executable needs (``.compile().memory_analysis()``): arguments +
  outputs - donated buffers reused as outputs + XLA's temporary buffer."""
  m = memory_analysis
  return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
             + m.temp_size_in_bytes)


def abstract_batch(batch_size: int, seq_len: int, predictions: int, sharding=None) -> dict:
  """ShapeDtypeStructs of a global batch (for ``.lower()`` without data)."""
  shapes = {"input_ids": ((batch_size, seq_len), jnp.int32),
            "mlm_positions": ((batch_size, predictions), jnp.int32),
            "mlm_labels": ((batch_size, predictions), jnp.int32),
            "mlm_weights": ((batch_size, predictions), jnp.float32)}
  return {k: jax.ShapeDtypeStruct(s, d, sharding=sharding) for k, (s, d) in shapes.items()}



def _table_entry(device_kind: str) -> str | None:
  """Maps a jax ``device.device_kind`` (e.g. "NVIDIA H100 80GB HBM3") to a table key."""
  kind = device_kind.upper()
  if "H200" in kind:
    return "H200"
  if "H100" in kind:
    if "NVL" in kind:
      return "H100 NVL"
    if "PCIE" in kind:
      return "H100 PCIe"
    return "H100 SXM"  # SXM parts report e.g. "NVIDIA H100 80GB HBM3"
  if "A100" in kind:
    return "A100"
  return None


def device_peak_flops(device_kind: str, override_tflops: float = 0.0,
                      dtype: str = "bfloat16") -> float | None:
  """Peak FLOP/s of one device for ``dtype`` matmuls; None when unknown (e.g. CPU), in which
  case MFU is not reported. ``override_tflops`` > 0 (``metrics.peak_tflops``) wins."""
  if override_tflops > 0:
    return override_tflops * 1e12
  key = _table_entry(device_kind)
  return None if key is None else DEVICE_PEAK_TFLOPS[key][dtype] * 1e12
