"""Data preparation: corpus → tokenizer → packed uint16 ArrayRecord shards → dataset directory.

Three passes, each resumable, over ``OUTPUT/_work/`` (removed when the dataset is complete):
  1. extract (``corpus_extract``, a process pool over input files, ordered): functions/documents
     → normalised text, exact duplicates dropped, in resumable corpus chunks.
  2. tokenizer (here): trained on a sample of ``tokenizer_sample_mb`` of the corpus (or given).
  3. tokenize → pack → shards (``shard_writer``, a process pool over chunks, ordered).
This module holds the options, the output directory's life cycle, pass 2 and the final
``stats.json``/``metadata.json``.
Every file appears under its final name only once complete (temp file, fsync, rename), and
``metadata.json`` is written last. Output is byte-identical for any number of workers: pools are
ordered and every decision depends only on the input order.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

from lmscale_jax import corpus_extract, dataset, shard_writer
from lmscale_jax import tokenizer as toklib
from lmscale_jax.errors import PrepareError  # noqa: F401  (tools/_cli.py catches it from here)

WORK = "_work"


@dataclasses.dataclass
class Options:
  kind: str                       # "binary" | "text"
  inputs: list
  output: str
  seq_len: int = 512
  vocab_size: int = 8192
  tokenizer: str = ""             # a given tokenizer.json; empty = train one
  tokenizer_model: str = "wordpiece"
  tokenizer_sample_mb: int = 64
  lowercase: bool = False
  workers: int = 0                # 0 = os.cpu_count()
  max_input_bytes: int = 0
  packing: str = "greedy"
  shard_size_mb: float = 64
  chunk_mb: float = 32            # corpus chunk size: the resume granularity of pass 1
  val_fraction: float = 0.01
  txt_docs: str = "line"
  text_field: str = "text"
  overwrite: bool = False
  progress: bool = True

  def output_params(self) -> dict:
    """Everything that determines the output bytes (a resume must match them)."""
    skip = {"workers", "overwrite", "progress", "output"}
    d = {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}
    d["inputs"] = [os.path.abspath(p) for p in self.inputs]
    if self.tokenizer:
      d["tokenizer"] = dataset.sha256_file(self.tokenizer)
    return d


# ----------------------------------------------------------------------------- checks
def _check_options(o: Options) -> None:
  if o.kind not in ("binary", "text"):
    raise PrepareError(f"kind {o.kind!r}: expected 'binary' or 'text'")
  if not o.tokenizer:
    try:
      toklib.check_vocab_size(o.vocab_size)
    except toklib.TokenizerError as e:
      raise PrepareError(str(e)) from None
  if o.seq_len < 8 or o.seq_len > 1 << 16:
    raise PrepareError(f"--seq-len {o.seq_len}: expected 8..65536")
  if o.packing not in ("greedy", "none"):
    raise PrepareError(f"--packing {o.packing!r}: expected 'greedy' or 'none'")
  if not 0 <= o.val_fraction < 1:
    raise PrepareError(f"--val-fraction {o.val_fraction}: expected 0 <= f < 1")
  if o.shard_size_mb <= 0 or o.chunk_mb <= 0:
    raise PrepareError(f"--shard-size-mb {o.shard_size_mb} / --chunk-mb {o.chunk_mb}: "
                       "expected > 0")
  if o.txt_docs not in ("line", "blank"):
    raise PrepareError(f"--txt-docs {o.txt_docs!r}: expected 'line' or 'blank'")
  if o.tokenizer and not os.path.isfile(o.tokenizer):
    raise PrepareError(f"--tokenizer {o.tokenizer!r}: no such file")


def _open_output(o: Options) -> bool:
  """Creates/validates the output directory. Returns True when resuming an earlier run."""
  out, work = o.output, os.path.join(o.output, WORK)
  params = o.output_params()
  if os.path.exists(out) and not os.path.isdir(out):
    raise PrepareError(f"output {out!r} exists and is not a directory")
  if os.path.isdir(out) and os.listdir(out):
    if o.overwrite:
      for name in os.listdir(out):
        p = os.path.join(out, name)
        shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
    elif os.path.isdir(work) and os.path.exists(os.path.join(work, "params.json")):
      with open(os.path.join(work, "params.json")) as f:
        old = json.load(f)
      if old != params:
        changed = sorted(k for k in set(old) | set(params) if old.get(k) != params.get(k))
        raise PrepareError(f"output {out!r} holds an unfinished preparation with other "
                           f"settings ({', '.join(changed)} differ); pass --overwrite to "
                           "start over")
      return True
    elif os.path.exists(os.path.join(out, dataset.METADATA)):
      raise PrepareError(f"output {out!r} already holds a complete dataset; pass --overwrite "
                         "to replace it")
    else:
      raise PrepareError(f"output {out!r} is not empty; pass --overwrite to replace its "
                         "contents")
  try:
    os.makedirs(work, exist_ok=True)
    dataset.atomic_write_json(os.path.join(work, "params.json"), params)
  except OSError as e:
    raise PrepareError(f"output {out!r} is not writable: {e.strerror}") from None
  return False


# ----------------------------------------------------------------------------- pass 2
def _tokenizer(o: Options, work: str, chunks: list[str]):
  path = os.path.join(work, dataset.TOKENIZER)
  if os.path.exists(path):
    return toklib.load(path)
  try:
    if o.tokenizer:
      tok = toklib.load(o.tokenizer)
    else:
      tok = toklib.train(corpus_extract.iter_texts(chunks, o.tokenizer_sample_mb << 20),
                         vocab_size=o.vocab_size, kind=o.kind, model=o.tokenizer_model,
                         lowercase=o.lowercase)
  except toklib.TokenizerError as e:
    raise PrepareError(str(e)) from None
  dataset.atomic_write_bytes(path, tok.to_str().encode())
  return tok


# ----------------------------------------------------------------------------- finalize
def _finalize(o: Options, work: str, result: dict, extract_stats: dict, t0: float,
              workers: int) -> dict:
  name = "binary_code" if o.kind == "binary" else "text_corpus"
  splits = {}
  for split, shards in result["splits"].items():
    infos = []
    for i, info in enumerate(shards):
      final = dataset.shard_filename(name, split, i, len(shards))
      src = os.path.join(work, "shards", f"{split}-{i:05d}.array_record")
      if os.path.exists(src):  # absent if an interrupted finalize already moved it
        os.replace(src, os.path.join(o.output, final))
      infos.append({"file": final, **info})
    splits[split] = infos
  shutil.copyfile(os.path.join(work, dataset.TOKENIZER), os.path.join(o.output, dataset.TOKENIZER))

  st, wall = result["stats"], time.time() - t0
  seqs = sum(s["sequences"] for s in st.values())
  tokens = sum(s["tokens"] for s in st.values())
  out_bytes = sum(x["bytes"] for v in splits.values() for x in v)
  unit = "functions" if o.kind == "binary" else "documents"
  measured = extract_stats["code_bytes"] if o.kind == "binary" else extract_stats["input_bytes"]
  val = st["validation"]
  stats = {
      "kind": o.kind, "packing": o.packing, "seq_len": o.seq_len,
      "vocab_size": result["vocab_size"],
      "input_files": extract_stats["input_files"],
      "input_bytes": extract_stats["input_bytes"],
      "output_bytes": out_bytes,
      "reduction_pct": round(100 * (1 - out_bytes / max(1, extract_stats["input_bytes"])), 3),
      f"{unit}_seen": extract_stats["seen"],
      f"{unit}_kept": extract_stats["kept"],
      f"{unit}_deduplicated": extract_stats["deduplicated"],
      f"{unit}_per_split": {s: v["items"] for s, v in st.items()},
      "sequences": {s: v["sequences"] for s, v in st.items()},
      "tokens": tokens,
      "content_tokens": sum(s["content_tokens"] for s in st.values()),
      "pad_fraction": round(1 - tokens / max(1, seqs * o.seq_len), 6),
      "unk_rate_validation": round(val["unk"] / max(1, val["content_tokens"]), 6),
      "unk_rate_train": round(st["train"]["unk"] / max(1, st["train"]["content_tokens"]), 6),
      "files_skipped": extract_stats["files_skipped"],
      "wall_seconds": round(wall, 2),
      "stage_seconds": result["stage_seconds"],  # of this run (a resume skips finished work)
      "workers": workers,
      "mb_per_s_per_core": round(measured / 1e6 / wall / workers, 3),
  }
  if o.kind == "binary":
    stats["code_bytes"] = extract_stats["code_bytes"]
    stats["functions_partially_decoded"] = extract_stats["partially_decoded"]
  dataset.atomic_write_json(os.path.join(o.output, dataset.STATS), stats)
  dataset.finalize(o.output, name=name, seq_len=o.seq_len, vocab_size=stats["vocab_size"],
              special_ids=result["special"], splits=splits,
              extra={"kind": o.kind, "packing": o.packing, "tokens": tokens})
  shutil.rmtree(work)
  return stats


def prepare(o: Options) -> dict:
  """Runs (or resumes) a preparation; returns the stats written to stats.json."""
  t0 = time.time()
  _check_options(o)
  workers = o.workers or os.cpu_count() or 1
  o = dataclasses.replace(o, workers=workers)
  resumed = _open_output(o)
  work = os.path.join(o.output, WORK)
  if resumed and o.progress:
    print(f"resuming the unfinished preparation in {o.output}")
  stages = {}
  t = time.time()
  chunks = corpus_extract.extract(o, work)
  extract_stats = corpus_extract.chunks(work)[-1][1]["stats"]
  stages["extract"], t = round(time.time() - t, 2), time.time()
  tok = _tokenizer(o, work, chunks)
  stages["tokenizer"], t = round(time.time() - t, 2), time.time()
  result = shard_writer.write_shards(o, work, chunks, tok)
  stages["tokenize_pack_write"] = round(time.time() - t, 2)
  result["stage_seconds"] = stages
  return _finalize(o, work, result, extract_stats, t0, workers)
