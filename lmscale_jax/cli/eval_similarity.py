"""Is the pretrained model any good? Binary code similarity detection on a benchmark built here.

  lmscale eval-similarity --bench BENCH.jsonl (--workdir DIR[@STEP] | --hf OUT… | --tfidf-only)
      [--pool 100,1000] [--pairs gcc-O0:gcc-O3,…] [--queries K] [--seed 0]
      [--train-elf PATH… [--train-max-bytes N]] [--json OUT.json] [--results FILE.jsonl]
      [--progress | --no-progress]

The jTrans protocol: each function at one compiled variant is a query; its pool holds the same
source function at another variant (the positive) and N−1 other functions of that variant;
the methods rank the pool by cosine similarity. Recall@1 and MRR per pool size and variant pair
(both directions; O0↔O3 is the hard one) and over all pairs. A direction needs N functions
at its pool's side: a pair where only one side has them is scored the other way only, marked †
with its direction in a footnote, and left out of "all", which pools only the pairs scored both
ways (the JSON: each row's "directions", its queries per direction, and "left_out", each with
why). Methods, on the same pools:
bag-of-pretokens TF-IDF, each given model (embeddings as lmscale embed computes them: mean of
the last hidden layer over the function's tokens; a fine-tuned model's own pooling, projection
head and normalisation), and the same architecture with random initial weights (no head).
--workdir and --hf may be given several times (one row each): e.g. a pretraining run and a
lmscale finetune run started from it, side by side. Rows are named after the
directory (and @step); a repeated name gets #2, #3.

--train-elf (with the demo's cap, --train-max-bytes 24000000) lists the pretraining inputs as
prepare does and reports how many benchmark functions its corpus holds verbatim (the same
normalised-text hash as prepare's deduplication): the leakage check. --results appends one
JSON line per number (date, device) to a benchmarks/results file. Each step that can take
minutes (embedding the functions with each model, scoring each method, reading the
pretraining inputs) draws a progress bar with an ETA on stderr where it is a terminal
(--progress: always, --no-progress: never); stdout holds only the report (the tables, the
cut shares, the leakage line).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import numpy as np

from lmscale_jax.cli import args
from lmscale_jax.errors import UserError
from lmscale_jax.evals import retrieval
from lmscale_jax import progress as progress_lib
from lmscale_jax.similarity import function_groups
from lmscale_jax.store import output_marks
from lmscale_jax.study.host import cpu_name  # the host, described as the benchmarks do

TOOL = "lmscale eval-similarity"  # the parser's prog, and the mark its --json carries


def parser():
  p = args.Parser(prog=TOOL, description=__doc__.splitlines()[0])
  p.add_argument("--bench", required=True, type=args.input_file,
                 help="a file lmscale similarity-build wrote")
  p.add_argument("--workdir", action="append", default=[], metavar="DIR[@STEP]",
                 help="a training run (repeatable; @STEP: that checkpoint)")
  p.add_argument("--step", type=args.number(int, 0, 1 << 62), default=None,
                 help="(--workdir) the checkpoint step; default the latest")
  p.add_argument("--tokenizer", default="", type=args.input_file,
                 help="(--workdir) the dataset's tokenizer.json")
  p.add_argument("--hf", action="append", default=[], metavar="OUT",
                 help="a directory lmscale export-hf wrote (repeatable)")
  p.add_argument("--pool", default="100,1000", help="pool sizes, comma-separated")
  p.add_argument("--pairs", default="", help="variant pairs A:B (default: every two levels "
                 "of a compiler, and a level across compilers)")
  p.add_argument("--queries", type=args.number(int, 0, 1 << 30), default=0,
                 help="at most this many queries per pair and direction (0 = all)")
  p.add_argument("--seed", type=args.number(int, 0, 1 << 31), default=0,
                 help="the pools' and the random-init weights' seed")
  p.add_argument("--embed-pool", choices=["mean", "cls"], default="mean",
                 help="the pretrained models' pooling (a fine-tuned one uses its own)")
  p.add_argument("--no-random-init", action="store_true", help="leave the random-init row out")
  p.add_argument("--tfidf-only", action="store_true",
                 help="no model: the TF-IDF baseline alone (a new benchmark's floor)")
  p.add_argument("--train-elf", nargs="+", default=[], metavar="PATH",
                 help="the pretraining inputs, for the leakage check")
  p.add_argument("--train-max-bytes", type=args.number(int, 0, 1 << 62), default=0,
                 help="prepare's --max-input-bytes of that corpus (the demo: 24000000)")
  # Checked as they are parsed: a bad output path fails now, not after the evaluation.
  p.add_argument("--json", default=None, type=args.output_file, metavar="OUT.json",
                 help="write everything as JSON")
  p.add_argument("--results", default=None, type=args.append_file, metavar="FILE.jsonl",
                 help="append JSON lines")
  # A log is no terminal: a 20-minute run drew megabytes of bar frames into one (2026-12-03).
  p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                 help="progress bars on stderr: always / never (default: where stderr is a "
                 "terminal; stdout has only the report)")
  return p


def pool_sizes(text: str) -> list[int]:
  try:
    sizes = [int(x) for x in text.split(",") if x]
  except ValueError:
    sizes = []
  if not sizes or min(sizes) < 2:
    raise UserError(f"--pool {text!r}: expected comma-separated integers >= 2, e.g. 100,1000")
  return sizes


def model_vectors(model, texts: list[str], pool: str, name: str = "",
                  progress: bool = False) -> tuple[np.ndarray, float]:
  """lmscale embed's embedding of each function text (alone, as [CLS] text [SEP]); and the
  share of the texts cut at the model's sequence length (it sees only their beginning).
  ``progress``: a bar over the functions (every function of the benchmark, per model)."""
  # jax: imported once a model is needed
  from lmscale_jax.inference import function_vectors, trained_model

  inputs = ((str(i), "", *trained_model.encode(model, t)) for i, t in enumerate(texts))
  inputs = progress_lib.over(inputs, progress, total=len(texts), unit="function",
                             desc=f"embed {name}")
  pool = None if model.head is not None else pool  # a fine-tuned model pools as it trained
  out = function_vectors.embed(model, inputs, pool)
  return retrieval.normalise(out["embeddings"]), float(out["truncated"].mean())


def random_init(model, seed: int):
  """The same architecture and tokenizer with the initial weights training starts from."""
  from lmscale_jax.inference import trained_model

  return trained_model.random_init(model, seed)


def workdir_step(text: str) -> tuple[str, int | None]:
  """``DIR@STEP`` → (DIR, STEP): one run at two checkpoints, or two runs at the same step."""
  path, at, step = text.rpartition("@")
  if at and step.isdigit() and not os.path.isdir(text):
    return path, int(step)
  return text, None


def label(model, taken=()) -> str:
  name = os.path.basename(os.path.normpath(model.source))
  name = f"{name}@{model.step}" if model.step is not None else name
  unique, n = name, 1
  while unique in taken:
    n += 1
    unique = f"{name}#{n}"
  return unique


def describe(model) -> dict:
  """A model row's method_info: what it is and where it came from."""
  info = {"kind": "pretrained", "source": model.source, "step": model.step,
          "packed_attention": model.cfg.packed_attention,
          "layers": model.cfg.layers, "hidden": model.cfg.hidden}
  if model.head is not None:
    run = model.run_config
    info.update(kind="fine-tuned", pool=model.head["pool"],
                proj_dim=int(model.head["projection"]["kernel"].shape[1]))
    if run is not None:
      info.update(init=f"{run.init.source}:{run.init.path}", pairs=run.data.pairs)
  return info


def methods(a, items) -> tuple[dict, dict]:
  """→ ({label: vectors}, {label: what it is})."""
  from lmscale_jax.inference import trained_model

  vecs = {"tfidf": retrieval.tfidf_vectors(items.text)}
  info = {"tfidf": {"kind": "bag-of-pretokens TF-IDF, fitted on the benchmark"}}
  models = [trained_model.load(w, "", step if step is not None else a.step, a.tokenizer)
            for w, step in map(workdir_step, a.workdir)]
  models += [trained_model.load("", h) for h in a.hf]
  seen_arch = set()
  for m in models:
    name = label(m, vecs)
    vecs[name], cut = model_vectors(m, items.text, a.embed_pool, name, a.progress)
    info[name] = {**describe(m), "seq_len": m.cfg.seq_len, "cut_frac": cut}
    arch = (m.cfg.layers, m.cfg.hidden, m.cfg.heads, m.cfg.ffn, m.cfg.vocab_size)
    if not a.no_random_init and arch not in seen_arch:
      seen_arch.add(arch)
      name = "random-init" if len(models) == 1 else f"random-init({name})"
      vecs[name], cut = model_vectors(random_init(m, a.seed), items.text, a.embed_pool, name,
                                      a.progress)
      info[name] = {"kind": "random initial weights", "seed": a.seed,
                    "architecture_of": m.source, "seq_len": m.cfg.seq_len, "cut_frac": cut}
  return vecs, info


def main(argv=None) -> int:
  parser_ = parser()
  a = parser_.parse_args(argv)
  a.progress = a.progress if a.progress is not None else sys.stderr.isatty()
  if not a.workdir and not a.hf and not a.tfidf_only:
    parser_.error("give a model: --workdir DIR (a training run) or --hf OUT (an export), "
                  "or --tfidf-only")
  if a.tfidf_only and (a.workdir or a.hf):
    parser_.error("--tfidf-only scores no model: leave out --workdir and --hf")

  def go() -> int:
    sizes = pool_sizes(a.pool)
    header, groups = function_groups.load(a.bench)
    items = retrieval.Items.from_groups(groups)
    pairs = retrieval.parse_pairs(a.pairs, header["variants"])
    vecs, info = methods(a, items)
    results = retrieval.evaluate(items, vecs, pairs, sizes, seed=a.seed, max_queries=a.queries,
                                 progress=a.progress)
    leak = None
    if a.train_elf:
      digests, files = retrieval.training_digests(a.train_elf, a.train_max_bytes,
                                                  a.progress)
      leak = {"train_files": files, **retrieval.overlap(items, digests)}
    print(f"{a.bench}: {len(groups)} functions, {len(items)} compiled variants "
          f"({', '.join(header['variants'])})")
    print(retrieval.table(results))
    print(cut_lines(info, len(items)))
    if leak is not None:
      print(f"leakage: {leak['in_training_corpus']} of {leak['functions']} benchmark functions "
            f"are in the pretraining corpus verbatim ({leak['train_files']} files; "
            f"{leak['groups_touched']} groups touched)")
    doc = {"bench": a.bench, "bench_stats": header["stats"], "variants": header["variants"],
           "compilers": header["compilers"], "methods": info, "overlap": leak,
           "results": [r.row() for r in results]}
    if a.json:
      output_marks.write_json(a.json, TOOL, doc)
    if a.results:
      append_results(a.results, doc)
    return 0

  return args.guarded(go, "nothing was written")


def cut_lines(info: dict, functions: int) -> str:
  """How much of the benchmark each model sees: one line per sequence length."""
  by_len: dict = {}
  for name, m in info.items():
    if "seq_len" in m:
      by_len.setdefault((m["seq_len"], m["cut_frac"]), []).append(name)
  return "\n".join(
      f"cut at sequence length {n}: {cut:.1%} of the {functions:,} compiled functions (a model "
      f"sees their first {n - 2} tokens): {', '.join(names)}"
      for (n, cut), names in sorted(by_len.items()))


def append_results(path: str, doc: dict) -> None:
  base = {"date": datetime.date.today().isoformat(), "device": cpu_name(),
          "bench": doc["bench"], "groups": doc["bench_stats"]["groups"],
          "functions": doc["bench_stats"]["functions"],
          "leakage_fraction": doc["overlap"]["fraction"] if doc["overlap"] else None}
  lines = [json.dumps({**base, **r, "method_info": doc["methods"][r["method"]]})
           for r in doc["results"]]
  with open(path, "a") as f:  # appended whole lines, as the other benchmarks' results files
    f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  sys.exit(main())
