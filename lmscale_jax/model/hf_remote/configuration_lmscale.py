"""LmscaleConfig: the configuration of an lmscale_jax BERT exported with remote code.

Written into an exported model directory by ``lmscale export-hf`` (lmscale_jax/model/
hf_remote_convert.py) and loaded by transformers with ``trust_remote_code=True``; lmscale_jax
itself never imports this file. The fields are BertConfig's that change the computation, plus
the three lmscale model options BERT has no field for:

  positions         "absolute" (0..S-1), "segment" (0.. restarting at each [CLS]) or
                    "instruction" (undertale's instruction + argument index from [NEXT])
  norm              "post" (BERT) or "pre" (pre-LN, a final LayerNorm after the last layer)
  packed_attention  "cross" (one window per row) or "segment" (each [CLS] … span attends
                    within itself, as the model was trained on packed rows)
"""

from transformers import PretrainedConfig

POSITIONS = ("absolute", "segment", "instruction")
NORMS = ("post", "pre")
PACKED_ATTENTION = ("cross", "segment")


def _one_of(name, value, allowed):
  if value not in allowed:
    raise ValueError(f"LmscaleConfig: {name}={value!r}, expected one of {list(allowed)}")
  return value


class LmscaleConfig(PretrainedConfig):
  model_type = "lmscale_bert"

  def __init__(self, vocab_size=30522, hidden_size=768, num_hidden_layers=12,
               num_attention_heads=12, intermediate_size=3072, max_position_embeddings=512,
               type_vocab_size=2, layer_norm_eps=1e-12, hidden_dropout_prob=0.1,
               attention_probs_dropout_prob=0.0, initializer_range=0.02, pad_token_id=0,
               positions="segment", norm="post", packed_attention="cross", cls_token_id=2,
               next_token_id=5, classifier_dropout=None, **kwargs):
    self.vocab_size = vocab_size
    self.hidden_size = hidden_size
    self.num_hidden_layers = num_hidden_layers
    self.num_attention_heads = num_attention_heads
    self.intermediate_size = intermediate_size
    self.max_position_embeddings = max_position_embeddings
    self.type_vocab_size = type_vocab_size
    self.layer_norm_eps = layer_norm_eps
    self.hidden_dropout_prob = hidden_dropout_prob
    self.attention_probs_dropout_prob = attention_probs_dropout_prob
    self.initializer_range = initializer_range
    self.positions = _one_of("positions", positions, POSITIONS)
    self.norm = _one_of("norm", norm, NORMS)
    self.packed_attention = _one_of("packed_attention", packed_attention, PACKED_ATTENTION)
    self.cls_token_id = cls_token_id
    self.next_token_id = next_token_id
    self.classifier_dropout = classifier_dropout
    super().__init__(pad_token_id=pad_token_id, **kwargs)
