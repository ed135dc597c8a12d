"""Export a training run's checkpoint as a Hugging Face masked-LM directory.

  lmscale export-hf --workdir DIR [--step N] [--tokenizer tokenizer.json] --output OUT

OUT gets config.json (every BertConfig field that changes the computation, from the run's own
config.json), model.safetensors (float32), tokenizer.json / tokenizer_config.json /
special_tokens_map.json (special-token roles, a [CLS] … [SEP] post-processor), a model card
(README.md) and lmscale_export.json (the digest of tokenizer.json, which every lmscale tool
that reads the directory checks: another tokenizer of the same size is refused), so that
AutoModelForMaskedLM.from_pretrained(OUT) and AutoTokenizer.from_pretrained(OUT) load it as
it is. The tokenizer is the run's
data.path/tokenizer.json unless --tokenizer is given. OUT is written under a temporary name
and renamed when complete; it must not exist or be empty.

A post-LN run with segment or absolute positions exports as transformers' own
BertForMaskedLM. A run transformers' BERT has no form for (model.norm=pre,
model.positions=instruction) exports as LmscaleForMaskedLM with its modeling code in OUT
(configuration_lmscale.py, modeling_lmscale.py, auto_map in config.json): load it with
AutoModelForMaskedLM.from_pretrained(OUT, trust_remote_code=True)
(lmscale_jax/model/hf_remote_convert.py).

A fine-tuning workdir (lmscale finetune) exports its encoder the same way (its MLM
head is the one it started from) plus its embedding head: projection.safetensors (weight
[D, H], bias [D]) and projection.json (pooling, normalisation); docs/finetune.md shows the few
lines that embed a function with them in transformers. A classification fine-tune (lmscale
finetune --task classify) exports as LmscaleForSequenceClassification (masked-mean pooling →
its classifier, id2label its classes; remote code): AutoModelForSequenceClassification or
pipeline("text-classification", …, trust_remote_code=True) (lmscale_jax/model/hf_classifier.py).
A naming fine-tune (--task name) exports as the same class with one sigmoid per name sub-token:
id2label its vocabulary, problem_type "multi_label_classification", naming_rule the run's
prediction rule (naming_eval.json); lmscale name --hf OUT reads it.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import shutil
import sys
import tempfile
from typing import TYPE_CHECKING

from lmscale_jax.cli import args
from lmscale_jax.errors import UserError
from lmscale_jax.model import hf_dir_checks, hf_remote_convert
from lmscale_jax.store import dir_lock, file_io
from lmscale_jax.store import tokenizer as toklib

if TYPE_CHECKING:  # annotations only
  from lmscale_jax.inference import trained_model

# The model's modules (model_files, trained_model, hf_convert, flops, …) import JAX (~1.5 s):
# each function below imports what it uses, so that --help answers without them.


def parser() -> argparse.ArgumentParser:
  p = args.Parser(prog="lmscale export-hf", description=__doc__.splitlines()[0])
  p.add_argument("--workdir", required=True, help="the training run's --workdir")
  p.add_argument("--step", type=args.number(int, 0, 1 << 62), default=None,
                 help="checkpoint step (default: the latest)")
  p.add_argument("--tokenizer", default="", type=args.input_file, metavar="tokenizer.json",
                 help="the dataset's tokenizer (default: data.path/tokenizer.json of the run)")
  p.add_argument("--output", required=True, type=args.output_dir, metavar="OUT",
                 help="directory to create")
  return p


def check_output(out: str) -> None:
  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise UserError(f"--output {out}: exists and is not an empty directory; give a new "
                    "directory (nothing was written)")


def last_row(workdir: str, step: int, key: str) -> dict | None:
  """The last row of metrics.jsonl at or before ``step`` that has ``key`` (``eval_loss``: an
  evaluation row, ``loss``: a training row)."""
  from lmscale_jax.inference import model_files

  rows = [r for r in model_files.metrics_rows(workdir) if key in r and r["step"] <= step]
  return rows[-1] if rows else None


def number(value, spec: str) -> str:
  """A metric as the card shows it; null is what training writes for a non-finite value."""
  return "non-finite" if value is None else format(value, spec)


def remote_code(model: trained_model.TrainedModel) -> bool:
  return hf_remote_convert.needs_remote_code(model.cfg)


def architecture(model: trained_model.TrainedModel) -> str:
  """What the card says the model is, and the keyword a load needs."""
  cfg = model.cfg
  if not remote_code(model):
    return "BERT masked-language model (lmscale_jax)"
  return (f"BERT masked-language model (lmscale_jax; {cfg.norm}-LN, {cfg.positions} positions: "
          "its own modeling code, load it with `trust_remote_code=True`)")


def model_card(model: trained_model.TrainedModel) -> str:
  from lmscale_jax.model import flops

  c, cfg, run = model.run_config, model.cfg, model.source
  ev = last_row(run, model.step, "eval_loss")
  loss = (f"{number(ev['eval_loss'], '.4f')} (MLM accuracy "
          f"{number(ev.get('eval_mlm_accuracy', float('nan')), '.4f')}"
          f", step {ev['step']}, {c.train.eval_batches} validation batches)" if ev else
          "not measured (no evaluation row in metrics.jsonl)")
  params = flops.count_params_from_config(cfg)
  return f"""---
library_name: transformers
pipeline_tag: fill-mask
tags: [bert, fill-mask, lmscale_jax]
---
# {architecture(model)}

Pretrained with lmscale_jax (masked-language modelling), exported by
`lmscale export-hf` from `{os.path.abspath(run)}` at step {model.step}.

| | |
|---|---|
| data | `{c.data.path}` (sequences of {cfg.seq_len} tokens, vocabulary {cfg.vocab_size}) |
| steps | {model.step} of {c.train.steps}, global batch {c.train.batch_size}, peak LR {c.train.learning_rate} |
| final eval loss | {loss} |
| model | {cfg.layers} layers × {cfg.hidden}, {cfg.heads} heads, FFN {cfg.ffn}, {params:,} parameters |

Inputs are wrapped as `[CLS] … [SEP]` by the tokenizer, as in training. For binary code the
text is pretokenised instruction text (`mov rax qword [ rbp - 0x18 ] [NEXT] …`).
{remote_note(model)}
```python
from transformers import pipeline
fill = pipeline("fill-mask", model="OUT"{trust(model)})
fill("push rbp [NEXT] mov rbp rsp [NEXT] [MASK] rsp 0x10")
```
"""


def remote_note(model: trained_model.TrainedModel) -> str:
  if not remote_code(model):
    return ""
  return f"""
transformers' BERT has no {model.cfg.norm}-LN / {model.cfg.positions}-position model: its code is
in this directory (`modeling_lmscale.py`, `configuration_lmscale.py`), which transformers runs
only when asked: `AutoModelForMaskedLM.from_pretrained("OUT", trust_remote_code=True)`
(`AutoTokenizer.from_pretrained("OUT", trust_remote_code=True)` too: it reads the config
first, and would otherwise ask).
"""


def trust(model: trained_model.TrainedModel) -> str:
  """The keyword argument a remote-code export's from_pretrained/pipeline needs."""
  return ", trust_remote_code=True" if remote_code(model) else ""


def finetuned_card(model: trained_model.TrainedModel) -> str:
  c, cfg, run, head = model.run_config, model.cfg, model.source, model.head
  row = last_row(run, model.step, "loss")
  loss = (f"{number(row['loss'], '.4f')} (in-batch accuracy "
          f"{number(row.get('accuracy', float('nan')), '.3f')}, step {row['step']})" if row
          else "not logged")
  dim = head["projection"]["kernel"].shape[1]
  return f"""---
library_name: transformers
pipeline_tag: feature-extraction
tags: [bert, binary-code-similarity, lmscale_jax]
---
# BERT binary-code embedding model (lmscale_jax, contrastively fine-tuned)

Fine-tuned with lmscale_jax (symmetric InfoNCE over in-batch negatives, temperature
{c.finetune.temperature}) from `{c.init.source}:{c.init.path}` on `{c.data.pairs}`, exported
by `lmscale export-hf` from `{os.path.abspath(run)}` at step {model.step}.

| | |
|---|---|
| steps | {model.step} of {c.train.steps}, {c.train.batch_size} pairs per step, peak LR {c.train.learning_rate} |
| last training loss | {loss} |
| encoder | {cfg.layers} layers × {cfg.hidden}, {cfg.heads} heads, vocabulary {cfg.vocab_size}, {cfg.seq_len} tokens |
| embedding | {head['pool']} pooling → Linear {cfg.hidden}→{dim} (projection.safetensors) → L2 normalisation |

Mean pooling averages the last hidden layer over `attention_mask` ([CLS] and [SEP] included).
Inputs are pretokenised instruction text; the tokenizer adds [CLS] … [SEP].

```python
import json, torch
from safetensors.torch import load_file
from transformers import AutoModel, AutoTokenizer
tok = AutoTokenizer.from_pretrained("OUT"{trust(model)})
bert = AutoModel.from_pretrained("OUT", add_pooling_layer=False{trust(model)}).eval()
head, pool = load_file("OUT/projection.safetensors"), json.load(open("OUT/projection.json"))["pool"]
x = tok(["push rbp [NEXT] mov rbp rsp [NEXT] pop rbp [NEXT] ret"], return_tensors="pt",
        padding=True, truncation=True)
with torch.no_grad():
  h = bert(**x).last_hidden_state
m = x["attention_mask"].unsqueeze(-1).float()
v = h[:, 0] if pool == "cls" else (h * m).sum(1) / m.sum(1)
e = torch.nn.functional.normalize(v @ head["weight"].T + head["bias"], dim=-1)  # cosine = e @ e.T
```
"""


def classify_windows(model: trained_model.TrainedModel) -> int:
  from lmscale_jax.finetune import classify_run

  return classify_run.windows_of(model.run_config)


def classifier_card(model: trained_model.TrainedModel) -> str:
  c, cfg, run = model.run_config, model.cfg, model.source
  names = model.classifier["labels"]
  scores = read_scores(run)
  held_out = (f"accuracy {scores['accuracy']:.3f}, macro-F1 {scores['macro_f1']:.3f} on "
              f"`{scores['file']}` ({scores['examples']} examples)" if scores else
              "not measured (no classification_eval.json)")
  windows = classify_windows(model)
  if windows > 1:
    held_out += (f"; each function read as up to {windows} windows of {cfg.seq_len} tokens cut "
                 "at instructions (`[NEXT]`), scored by the mean of their log-probabilities "
                 "(config.json `windows`); one call of the pipeline reads one window")
  return f"""---
library_name: transformers
pipeline_tag: text-classification
tags: [bert, text-classification, lmscale_jax]
---
# Binary-code classifier (lmscale_jax, fine-tuned)

Fine-tuned with lmscale_jax (masked-mean pooling → Linear {cfg.hidden}→{len(names)},
cross-entropy) from `{c.init.source}:{c.init.path}` on `{c.finetune.labels}`, exported by
`lmscale export-hf` from `{os.path.abspath(run)}` at step {model.step}. Its code is in this
directory (`modeling_lmscale.py`): load it with `trust_remote_code=True`.

| | |
|---|---|
| classes | {", ".join(f"`{n}`" for n in names)} |
| held out | {held_out} |
| encoder | {cfg.layers} layers × {cfg.hidden}, {cfg.heads} heads, vocabulary {cfg.vocab_size}, {cfg.seq_len} tokens, {cfg.norm}-LN, {cfg.positions} positions |

```python
from transformers import pipeline
classify = pipeline("text-classification", model="OUT", trust_remote_code=True)
classify("push rbp [NEXT] mov rbp rsp [NEXT] pop rbp [NEXT] ret")
```
"""


def namer_card(model: trained_model.TrainedModel, rule: dict) -> str:
  c, cfg, run = model.run_config, model.cfg, model.source
  tokens = model.namer["tokens"]
  scores = read_scores(run, naming=True)
  held_out = (f"token precision {scores['precision']:.3f}, recall {scores['recall']:.3f}, F1 "
              f"{scores['f1']:.3f}, exact names {scores['exact']:.3f} on {scores['functions']} "
              "functions of libraries never trained on" if scores else
              "not measured (no naming_eval.json)")
  kept = (f"the {rule['k']} most probable sub-tokens" if rule["kind"] == "topk" else
          f"every sub-token of probability ≥ {rule['threshold']}" +
          (" (the most probable one where none is)" if rule["kind"] == "threshold_min1" else "")
          + ("; the model's best sub-tokens and those of the names the function calls are "
             "scored together by the rule's gate (config.json) from their probabilities and "
             "copy rates (`callee_copy.json`: lmscale name reads the calls of an ELF file; the "
             "logits alone do not)" if rule.get("gate") else
             "; a sub-token of a name the function calls scores the larger of its probability "
             "and its copy rate (`callee_copy.json`: lmscale name reads the calls of an ELF "
             "file; the logits alone do not)" if rule.get("calls") else ""))
  return f"""---
library_name: transformers
pipeline_tag: text-classification
tags: [bert, function-naming, multi-label-classification, lmscale_jax]
---
# Binary-code function namer (lmscale_jax, fine-tuned)

Fine-tuned with lmscale_jax (masked-mean pooling → Linear {cfg.hidden}→{len(tokens)}, one
sigmoid per name sub-token, binary cross-entropy) from `{c.init.source}:{c.init.path}` on
`{c.finetune.labels}`, exported by `lmscale export-hf` from `{os.path.abspath(run)}` at step
{model.step}. Its code is in this directory (`modeling_lmscale.py`): load it with
`trust_remote_code=True`.

| | |
|---|---|
| name sub-tokens | {len(tokens)} (`id2label`; e.g. {", ".join(f"`{t}`" for t in tokens[:8])}) |
| prediction rule | {kept}, joined by `_` (`naming_rule` in config.json, chosen on held-out training libraries) |
| held out | {held_out} |
| encoder | {cfg.layers} layers × {cfg.hidden}, {cfg.heads} heads, vocabulary {cfg.vocab_size}, {cfg.seq_len} tokens, {cfg.norm}-LN, {cfg.positions} positions |

```python
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer
tok = AutoTokenizer.from_pretrained("OUT", trust_remote_code=True)
model = AutoModelForSequenceClassification.from_pretrained("OUT", trust_remote_code=True).eval()
x = tok(["push rbp [NEXT] mov rbp rsp [NEXT] pop rbp [NEXT] ret"], return_tensors="pt",
        padding=True, truncation=True)
with torch.no_grad():
  p = torch.sigmoid(model(**x).logits)[0]
print([(model.config.id2label[int(i)], float(p[i])) for i in p.argsort(descending=True)[:5]])
```

`lmscale name --hf OUT --elf FILE` suggests names for every function of an ELF file with it.
"""


def read_scores(workdir: str, naming: bool = False) -> dict | None:
  """The run's last held-out scores (classify_run.EVAL_REPORT, ``naming``:
  name_run.EVAL_REPORT), None where it has none."""
  from lmscale_jax.finetune import classify_run, name_run
  from lmscale_jax.inference import model_files

  path = os.path.join(workdir, (name_run if naming else classify_run).EVAL_REPORT)
  return model_files.read_json(path, "a JSON object") if os.path.exists(path) else None


def save(model: trained_model.TrainedModel, out_dir: str) -> str:
  """The model's files into ``out_dir``; returns its model card."""
  from lmscale_jax.inference import callee_copy
  from lmscale_jax.finetune import name_run
  from lmscale_jax.inference import trained_model
  from lmscale_jax.model import contrastive, hf_classifier, hf_convert, name_head

  if model.classifier is not None:
    hf_classifier.save_classifier(trained_model.classifier_params(model), model.cfg,
                                  model.classifier["labels"], out_dir,
                                  {"windows": classify_windows(model)})
    return classifier_card(model)
  if model.namer is not None:
    rule = name_head.saved_rule(os.path.join(model.source, name_run.EVAL_REPORT))
    hf_classifier.save_namer(trained_model.namer_params(model), model.cfg,
                             model.namer["tokens"], rule, out_dir)
    copy = callee_copy.load(model.source)
    if copy is not None:  # the rates lmscale name merges where the rule reads the calls
      callee_copy.save(out_dir, copy)
    return namer_card(model, rule)
  hf_convert.save_model(model.params, model.cfg, out_dir)
  if model.head is not None:
    contrastive.save_head(model.head, out_dir)
    return finetuned_card(model)
  return model_card(model)


def what(model: trained_model.TrainedModel) -> str:
  """The one-line summary's description of what was exported."""
  from lmscale_jax.model import hf_convert

  if model.classifier is not None:
    return (f"LmscaleForSequenceClassification, {len(model.classifier['labels'])} classes, "
            "remote code: load with trust_remote_code=True")
  if model.namer is not None:
    return (f"LmscaleForSequenceClassification, multi-label over {len(model.namer['tokens'])} "
            "name sub-tokens, remote code: load with trust_remote_code=True")
  kind = ("LmscaleForMaskedLM, remote code: load with trust_remote_code=True"
          if remote_code(model) else hf_convert.ARCHITECTURE)
  head = "" if model.head is None else (
      f" + projection head {model.cfg.hidden}→{model.head['projection']['kernel'].shape[1]} "
      f"({model.head['pool']} pooling)")
  return kind + head


def export(a) -> str:
  from lmscale_jax.inference import model_dir, model_files, trained_model
  from lmscale_jax.model import hf_convert

  check_output(a.output)
  # Refuse what cannot be represented, or would fail at the end, before restoring anything.
  read = model_dir.read_run(a.workdir, a.tokenizer)
  hf_convert.check_exportable(read.cfg)  # BERT or remote code: what neither represents
  model_files.metrics_rows(a.workdir)  # the model card's source: damaged, one line now
  model = trained_model.from_dir(read, a.step)
  out = os.path.abspath(a.output)
  parent = os.path.dirname(out)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(out)}.", suffix=".tmp")
  try:
    card = save(model, tmp)
    toklib.write_hf_files(model.tokenizer, tmp, model_max_length=model.cfg.seq_len)
    hf_dir_checks.stamp_tokenizer(tmp)  # binds the weights to this tokenizer.json
    file_io.atomic_write_bytes(os.path.join(tmp, "README.md"), card.encode())
    os.chmod(tmp, 0o755)
    check_output(a.output)  # still free: then the complete directory takes the name
    publish(tmp, out, a.output)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return (f"exported {a.workdir} step {model.step} to {a.output} ({what(model)}, "
          f"{model.cfg.layers} layers × {model.cfg.hidden}, vocab {model.cfg.vocab_size})")


def publish(tmp: str, out: str, output: str) -> None:
  """The complete directory ``tmp`` takes the name ``out``: a rename, which replaces an empty
  directory in one step and fails if anything took ``out`` meanwhile (another writer, which
  :func:`output_lock` cannot keep out). Removing the empty one first left a window in which
  the later of two exports got a traceback (OSError: directory not empty)."""
  try:
    os.rename(tmp, out)
  except OSError as e:
    if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
      raise
    raise UserError(f"--output {output}: something else wrote it while this export ran "
                    f"({e.strerror}); it is kept as it is, and nothing of this export was "
                    "written") from None


@contextlib.contextmanager
def output_lock(output: str):
  """Holds ``.OUT.export-hf.lock`` beside OUT (inside, it would make OUT non-empty) while an
  export runs, removed as it ends: a second export into the same OUT is refused at its start,
  naming the first. Not when OUT's parent does not exist yet (the export creates it, after its
  checks): then :func:`publish` tells the later of two exports."""
  out = os.path.abspath(output)
  if not os.path.isdir(os.path.dirname(out)):
    yield
    return
  path = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.export-hf.lock")
  try:
    fd = dir_lock.acquire(path, doing=f"lmscale export-hf --output {output}")
  except dir_lock.Busy as e:
    raise UserError(f"--output {output}: another lmscale export-hf is writing it ({e.holder}; "
                    f"lock {path}): wait for it to end; nothing was written") from None
  except dir_lock.Unusable as e:
    raise UserError(f"--output {output}: {e}; give an output in a writable local or NFSv4 "
                    "directory (nothing was written)") from None
  try:
    yield
  finally:
    dir_lock.release(fd, remove=path)


def main(argv=None) -> int:
  a = parser().parse_args(argv)

  def go() -> int:
    with output_lock(a.output):
      print(export(a))
    return 0

  return args.guarded(go, f"nothing was written to {a.output}; rerun to export")


if __name__ == "__main__":
  sys.exit(main())
