"""An lmscale_jax BERT in torch: what lmscale_jax/model/bert.py computes, for transformers.

Written into an exported model directory by ``lmscale export-hf`` and loaded with
``trust_remote_code=True``; lmscale_jax itself never imports this file:

  AutoModelForMaskedLM.from_pretrained(DIR, trust_remote_code=True)                # MLM logits
  AutoModel.from_pretrained(DIR, trust_remote_code=True)                 # last_hidden_state
  AutoModelForSequenceClassification.from_pretrained(DIR, trust_remote_code=True)  # classes

The options BERT has no field for (``LmscaleConfig``): ``positions`` = "absolute" (a table
indexed 0..S-1), "segment" (that table indexed from 0 at each [CLS]) or "instruction"
(undertale's instruction-trace embedding: no position table; each token adds an instruction
index, counted by [NEXT], and an argument index, its place inside the instruction, both
restarting at each [CLS]; the [NEXT] belongs to the instruction it ends); ``norm`` = "post"
(BERT) or "pre" (LayerNorm on each branch's input, a final LayerNorm after the last layer; the
embedding LayerNorm stays); ``packed_attention`` = "cross" (attention over the whole row, [PAD]
keys masked) or "segment" (each [CLS] … span attends within itself, as in training on packed
rows). An exported model sees one function per row, where "segment" and "cross" are the same.

Parameter names are BertForMaskedLM's (``bert.embeddings.…``, ``bert.encoder.layer.N.…``,
``cls.predictions.…``) plus ``bert.embeddings.{instruction,argument}_embeddings`` and
``bert.encoder.final_LayerNorm``. The decoder is the word-embedding matrix transposed plus
``cls.predictions.bias`` (no decoder matrix of its own). Exact (erf) GELU; the padding mask is
``input_ids != pad_token_id`` (and ``attention_mask`` where given); token type 0 is added.
"""

import math

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import (BaseModelOutput, MaskedLMOutput,
                                           SequenceClassifierOutput)

from .configuration_lmscale import LmscaleConfig


def function_starts(input_ids, cls_id):
  """bool [B,S]: where a function starts (each [CLS], and position 0)."""
  starts = input_ids == cls_id
  starts[:, 0] = True
  return starts


def since_last(flags):
  """int64 [B,S]: how many positions since the last True of ``flags`` (flags[:, 0] is True)."""
  index = torch.arange(flags.shape[1], device=flags.device).expand_as(flags)
  return index - torch.cummax(torch.where(flags, index, torch.zeros_like(index)), dim=1).values


def segment_positions(input_ids, cls_id):
  """Position ids restarting at 0 at each [CLS] (what a function alone gets)."""
  return since_last(function_starts(input_ids, cls_id))


def instruction_positions(input_ids, cls_id, next_id):
  """(instruction index, argument index), each [B,S], restarting at each [CLS]:
  ``[CLS] push rbp [NEXT] mov rbp rsp [NEXT]`` → instructions 0 0 0 0 1 1 1 1, arguments
  0 1 2 3 0 1 2 3."""
  functions = function_starts(input_ids, cls_id)
  after_next = torch.zeros_like(functions)
  after_next[:, 1:] = input_ids[:, :-1] == next_id
  count = torch.cumsum(after_next.long(), dim=1)
  instruction = count - torch.cummax(torch.where(functions, count, torch.zeros_like(count)),
                                     dim=1).values
  return instruction, since_last(functions | after_next)


def attention_mask_of(config, input_ids, attention_mask):
  """bool [B,1,S,S] (query, key): the keys each query attends to."""
  keys = input_ids != config.pad_token_id
  if attention_mask is not None:
    keys = keys & attention_mask.bool()
  if config.packed_attention != "segment":
    return keys[:, None, None, :].expand(-1, 1, input_ids.shape[1], -1)
  segment = torch.cumsum(function_starts(input_ids, config.cls_token_id).long(), dim=1)
  segment = torch.where(keys, segment, torch.zeros_like(segment))  # [PAD] attends to [PAD]
  return (segment[:, :, None] == segment[:, None, :])[:, None]


class LmscaleEmbeddings(nn.Module):
  def __init__(self, config):
    super().__init__()
    self.config = config
    h, s = config.hidden_size, config.max_position_embeddings
    self.word_embeddings = nn.Embedding(config.vocab_size, h)
    if config.positions == "instruction":
      self.instruction_embeddings = nn.Embedding(s, h)
      self.argument_embeddings = nn.Embedding(s, h)
    else:
      self.position_embeddings = nn.Embedding(s, h)
    self.token_type_embeddings = nn.Embedding(config.type_vocab_size, h)
    self.LayerNorm = nn.LayerNorm(h, eps=config.layer_norm_eps)
    self.dropout = nn.Dropout(config.hidden_dropout_prob)

  def forward(self, input_ids, token_type_ids=None):
    c, s = self.config, input_ids.shape[1]
    if s > c.max_position_embeddings:
      raise ValueError(f"input length {s} exceeds max_position_embeddings="
                       f"{c.max_position_embeddings}")
    x = self.word_embeddings(input_ids)
    if c.positions == "instruction":
      instruction, argument = instruction_positions(input_ids, c.cls_token_id, c.next_token_id)
      x = x + self.instruction_embeddings(instruction) + self.argument_embeddings(argument)
    elif c.positions == "segment":
      x = x + self.position_embeddings(segment_positions(input_ids, c.cls_token_id))
    else:
      x = x + self.position_embeddings(torch.arange(s, device=input_ids.device))[None]
    if token_type_ids is None:
      token_type_ids = torch.zeros_like(input_ids)
    x = x + self.token_type_embeddings(token_type_ids)
    return self.dropout(self.LayerNorm(x))


class LmscaleSelfAttention(nn.Module):
  def __init__(self, config):
    super().__init__()
    h = config.hidden_size
    self.heads = config.num_attention_heads
    self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
    self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

  def forward(self, x, mask):
    b, s, h = x.shape
    split = lambda t: t.view(b, s, self.heads, h // self.heads).transpose(1, 2)
    q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
    scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(h // self.heads))
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = self.dropout(torch.softmax(scores, dim=-1))
    return torch.matmul(probs, v).transpose(1, 2).reshape(b, s, h)


class LmscaleOutput(nn.Module):
  """A branch's output projection and the LayerNorm BERT names beside it."""

  def __init__(self, config, inputs):
    super().__init__()
    self.dense = nn.Linear(inputs, config.hidden_size)
    self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
    self.dropout = nn.Dropout(config.hidden_dropout_prob)


class LmscaleAttention(nn.Module):
  def __init__(self, config):
    super().__init__()
    self.self = LmscaleSelfAttention(config)
    self.output = LmscaleOutput(config, config.hidden_size)


class LmscaleIntermediate(nn.Module):
  def __init__(self, config):
    super().__init__()
    self.dense = nn.Linear(config.hidden_size, config.intermediate_size)


class LmscaleLayer(nn.Module):
  def __init__(self, config):
    super().__init__()
    self.pre = config.norm == "pre"
    self.attention = LmscaleAttention(config)
    self.intermediate = LmscaleIntermediate(config)
    self.output = LmscaleOutput(config, config.intermediate_size)

  def forward(self, x, mask):
    out_a, out_m = self.attention.output, self.output
    attention = lambda y: out_a.dropout(out_a.dense(self.attention.self(y, mask)))
    mlp = lambda y: out_m.dropout(out_m.dense(nn.functional.gelu(self.intermediate.dense(y))))
    if self.pre:  # same parameters, LayerNorms on the branch inputs
      x = x + attention(out_a.LayerNorm(x))
      return x + mlp(out_m.LayerNorm(x))
    x = out_a.LayerNorm(x + attention(x))
    return out_m.LayerNorm(x + mlp(x))


class LmscaleEncoder(nn.Module):
  def __init__(self, config):
    super().__init__()
    self.layer = nn.ModuleList(LmscaleLayer(config) for _ in range(config.num_hidden_layers))
    if config.norm == "pre":
      self.final_LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

  def forward(self, x, mask):
    for layer in self.layer:
      x = layer(x, mask)
    return self.final_LayerNorm(x) if hasattr(self, "final_LayerNorm") else x


class LmscalePreTrainedModel(PreTrainedModel):
  config_class = LmscaleConfig
  base_model_prefix = "bert"

  @torch.no_grad()
  def _init_weights(self, module):
    """As lmscale_jax initialises: normal(initializer_range) matrices, zero biases, unit
    LayerNorms (only what a checkpoint lacks: a new classifier)."""
    std = self.config.initializer_range
    if isinstance(module, (nn.Linear, nn.Embedding)):
      nn.init.normal_(module.weight, mean=0.0, std=std)
    if isinstance(module, nn.Linear) and module.bias is not None:
      nn.init.zeros_(module.bias)
    if isinstance(module, nn.LayerNorm):
      nn.init.ones_(module.weight)
      nn.init.zeros_(module.bias)
    if isinstance(module, LmscalePredictions):
      nn.init.zeros_(module.bias)


class LmscaleModel(LmscalePreTrainedModel):
  """The encoder: ``last_hidden_state`` [B,S,H]."""

  def __init__(self, config, add_pooling_layer=False):
    # add_pooling_layer: accepted as BertModel takes it; this model has no pooler.
    super().__init__(config)
    self.embeddings = LmscaleEmbeddings(config)
    self.encoder = LmscaleEncoder(config)
    self.post_init()

  def get_input_embeddings(self):
    return self.embeddings.word_embeddings

  def set_input_embeddings(self, value):
    self.embeddings.word_embeddings = value

  def forward(self, input_ids, attention_mask=None, token_type_ids=None, return_dict=None,
              **kwargs):
    mask = attention_mask_of(self.config, input_ids, attention_mask)
    x = self.encoder(self.embeddings(input_ids, token_type_ids), mask)
    return BaseModelOutput(last_hidden_state=x)


class LmscalePredictions(nn.Module):
  def __init__(self, config):
    super().__init__()
    self.transform = LmscaleOutput(config, config.hidden_size)  # dense + LayerNorm
    self.bias = nn.Parameter(torch.zeros(config.vocab_size))


class LmscaleMLMHead(nn.Module):
  def __init__(self, config):
    super().__init__()
    self.predictions = LmscalePredictions(config)

  def forward(self, x, word_embeddings):
    t = self.predictions.transform
    h = t.LayerNorm(nn.functional.gelu(t.dense(x)))
    return torch.matmul(h, word_embeddings.t()) + self.predictions.bias  # tied decoder


class LmscaleForMaskedLM(LmscalePreTrainedModel):
  """MLM logits [B,S,V] (``labels``: -100 where not predicted, as BertForMaskedLM)."""

  def __init__(self, config):
    super().__init__(config)
    self.bert = LmscaleModel(config)
    self.cls = LmscaleMLMHead(config)
    self.post_init()

  def get_input_embeddings(self):
    return self.bert.embeddings.word_embeddings

  def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None,
              return_dict=None, **kwargs):
    h = self.bert(input_ids, attention_mask, token_type_ids).last_hidden_state
    logits = self.cls(h, self.bert.embeddings.word_embeddings.weight)
    loss = None
    if labels is not None:
      loss = nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
    return MaskedLMOutput(loss=loss, logits=logits)


class LmscaleForSequenceClassification(LmscalePreTrainedModel):
  """Classes of a whole input: the mean of the last hidden layer over the non-pad tokens
  ([CLS] and [SEP] included) → ``classifier`` (Linear hidden → num_labels); ``id2label`` in the
  config names the classes. ``problem_type="multi_label_classification"`` (a naming export):
  each logit is an independent sigmoid, one per name sub-token, and ``naming_rule`` in the
  config says which make the name."""

  def __init__(self, config):
    super().__init__(config)
    self.num_labels = config.num_labels
    self.bert = LmscaleModel(config)
    rate = config.classifier_dropout
    self.dropout = nn.Dropout(config.hidden_dropout_prob if rate is None else rate)
    self.classifier = nn.Linear(config.hidden_size, config.num_labels)
    self.post_init()

  def get_input_embeddings(self):
    return self.bert.embeddings.word_embeddings

  def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None,
              return_dict=None, **kwargs):
    h = self.bert(input_ids, attention_mask, token_type_ids).last_hidden_state
    keep = (input_ids != self.config.pad_token_id)
    if attention_mask is not None:
      keep = keep & attention_mask.bool()
    keep = keep.to(h.dtype)[..., None]
    pooled = (h * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1.0)
    logits = self.classifier(self.dropout(pooled))
    loss = None
    if labels is not None and self.config.problem_type == "multi_label_classification":
      # A naming export: one independent sigmoid per name sub-token (labels: 0/1 [B, C]).
      loss = nn.functional.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))
    elif labels is not None:
      loss = nn.functional.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
    return SequenceClassifierOutput(loss=loss, logits=logits)
