"""The transformers side of the HF tests, run by the HF virtual environment's Python
(torch + transformers, no jax: tools/test.sh makes it), as a user of an exported model would.

  .venv-hf/bin/python tests/hf_side.py REQUEST.json RESPONSE.json

REQUEST: a list of {"op": …} jobs; RESPONSE: the list of their results, in order.
"""

import json
import sys

import numpy as np
import torch
import transformers


def load(d, attn="eager"):
  model, info = transformers.AutoModelForMaskedLM.from_pretrained(
      d, attn_implementation=attn, output_loading_info=True)
  return model.eval(), {k: sorted(map(str, v)) for k, v in info.items()}


def op_logits(job):
  """MLM logits at job["positions"] of a padded batch (attention_mask = ids != pad)."""
  model, info = load(job["dir"], job.get("attn", "eager"))
  ids = torch.tensor(job["ids"], dtype=torch.long)
  with torch.no_grad():
    out = model(input_ids=ids, attention_mask=(ids != model.config.pad_token_id).long()).logits
  pos = np.asarray(job["positions"])
  logits = np.take_along_axis(out.numpy(), pos[..., None], 1)
  return {"logits": logits.tolist(), "info": info, "class": type(model).__name__}


def op_strict(job):
  """load_state_dict(strict=True) of a full state dict (npz) into BertForMaskedLM."""
  config = transformers.AutoConfig.from_pretrained(job["dir"])
  model = transformers.BertForMaskedLM(config)
  sd = {k: torch.from_numpy(v) for k, v in np.load(job["npz"]).items()}
  result = model.load_state_dict(sd, strict=True)
  return {"missing": list(result.missing_keys), "unexpected": list(result.unexpected_keys)}


def op_tokenize(job):
  tok = transformers.AutoTokenizer.from_pretrained(job["dir"])
  enc = tok(job["text"])
  return {"ids": enc["input_ids"], "decoded": tok.decode(enc["input_ids"],
                                                         skip_special_tokens=True),
          "roles": {r: getattr(tok, r) for r in ("pad_token", "unk_token", "cls_token",
                                                 "sep_token", "mask_token")}}


def op_fill_mask(job):
  fill = transformers.pipeline("fill-mask", model=job["dir"], tokenizer=job["dir"],
                               device="cpu")
  out = fill(job["text"], top_k=job["top_k"])
  if out and isinstance(out[0], dict):  # one [MASK]: a flat list
    out = [out]
  return [[{"id": int(p["token"]), "probability": float(p["score"])} for p in m] for m in out]


def op_save_random(job):
  """A BertForMaskedLM saved by transformers itself, every parameter perturbed."""
  torch.manual_seed(job.get("seed", 0))
  model = transformers.BertForMaskedLM(transformers.BertConfig(**job["config"]))
  with torch.no_grad():
    for p in model.parameters():
      p.add_(torch.randn_like(p) * 0.2)
  model.save_pretrained(job["dir"])
  return {"keys": sorted(model.state_dict())}


def op_embed(job):
  """A fine-tuned export's embeddings, computed as docs/finetune.md shows: AutoTokenizer,
  AutoModel, the pooling of projection.json, projection.safetensors, L2 normalisation."""
  from safetensors.torch import load_file

  d = job["dir"]
  tok = transformers.AutoTokenizer.from_pretrained(d, trust_remote_code=True)
  bert = transformers.AutoModel.from_pretrained(d, add_pooling_layer=False, trust_remote_code=True,
                                                attn_implementation="eager").eval()
  head = load_file(f"{d}/projection.safetensors")
  with open(f"{d}/projection.json") as f:
    pool = json.load(f)["pool"]
  x = tok(job["texts"], return_tensors="pt", padding=True, truncation=True)
  with torch.no_grad():
    h = bert(**x).last_hidden_state
  m = x["attention_mask"].unsqueeze(-1).float()
  v = h[:, 0] if pool == "cls" else (h * m).sum(1) / m.sum(1)
  e = torch.nn.functional.normalize(v @ head["weight"].T + head["bias"], dim=-1)
  return {"ids": x["input_ids"].tolist(), "embeddings": e.tolist()}


def op_remote(job):
  """An lmscale remote-code export as a user loads it: AutoTokenizer (job["texts"], padded) or
  job["ids"] (attention_mask = ids != pad), then job["auto"] ("AutoModelForMaskedLM",
  "AutoModelForSequenceClassification" or "AutoModel") with trust_remote_code=True. → its
  logits (last_hidden_state for AutoModel), the ids it ran on, and what was loaded."""
  d = job["dir"]
  if "texts" in job:
    tok = transformers.AutoTokenizer.from_pretrained(d, trust_remote_code=True)
    x = tok(job["texts"], return_tensors="pt", padding=True)
    ids, mask = x["input_ids"], x["attention_mask"]
  else:
    ids = torch.tensor(job["ids"], dtype=torch.long)
    mask = None
  auto = getattr(transformers, job["auto"])
  model, info = auto.from_pretrained(d, trust_remote_code=True, output_loading_info=True)
  model.eval()
  if mask is None:
    mask = (ids != model.config.pad_token_id).long()
  with torch.no_grad():
    out = model(input_ids=ids, attention_mask=mask)
  values = out.last_hidden_state if job["auto"] == "AutoModel" else out.logits
  return {"ids": ids.tolist(), "logits": values.numpy().tolist(), "class": type(model).__name__,
          "info": {k: sorted(map(str, v)) for k, v in info.items()},
          "id2label": {str(k): v for k, v in model.config.id2label.items()}}


OPS = {"logits": op_logits, "strict": op_strict, "tokenize": op_tokenize,
       "fill_mask": op_fill_mask, "save_random": op_save_random, "embed": op_embed,
       "remote": op_remote}

if __name__ == "__main__":
  with open(sys.argv[1]) as f:
    jobs = json.load(f)
  with open(sys.argv[2], "w") as f:
    json.dump([OPS[j["op"]](j) for j in jobs], f)
