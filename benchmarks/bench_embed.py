"""What sorting functions by length and padding each batch to its bucket buys the embedder
(``function_vectors``: WINDOW batches sorted together, BUCKETS lengths), against padding every
batch to ``seq_len`` (BUCKETS = 1, what it did before), in the same process, A B A B:

  python benchmarks/bench_embed.py --workdir RUN --bench BENCH.jsonl [--functions 4096]
      [--rounds 3] [--out benchmarks/results/DATE-cpu-embed-buckets.json]

The first N compiled functions of a similarity benchmark (``lmscale similarity-build``'s file),
embedded as ``lmscale eval-similarity`` embeds them, by the model of a training or fine-tuning
run. Each mode is run once first, not timed (JAX compiles one program per batch length); then
--rounds pairs. Reported: functions/s per mode (median), the ratio pair by pair, the share of
the tokens sent to the model that are padding, and the largest difference between the two
modes' vectors (the padding is masked, so it should be float rounding at most).
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import _host  # noqa: E402
from lmscale_jax.cli.args import Parser  # noqa: E402
from lmscale_jax.errors import UserError  # noqa: E402
from lmscale_jax.evals import retrieval  # noqa: E402
from lmscale_jax.similarity import function_groups  # noqa: E402


def parser() -> Parser:
  p = Parser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workdir", required=True, help="a training or fine-tuning run's directory")
  p.add_argument("--bench", required=True, help="a similarity benchmark (.jsonl)")
  p.add_argument("--functions", type=int, default=4096, help="the first N compiled functions")
  p.add_argument("--rounds", type=int, default=3, help="timed pairs of the two modes")
  p.add_argument("--out", default="", help="append the result here (.json: one list)")
  return p


def timed(model, inputs, buckets: int) -> tuple[float, np.ndarray]:
  """Seconds to embed ``inputs`` with BUCKETS = ``buckets``, and the vectors."""
  from lmscale_jax.inference import function_vectors

  function_vectors.BUCKETS = buckets
  start = time.perf_counter()
  out = function_vectors.embed(model, inputs)["embeddings"]
  return time.perf_counter() - start, out


def count_into(sent: list) -> None:
  """Wrap function_vectors.forward to append (tokens, padding) of each forward pass to
  ``sent`` (a comparison and a sum per batch: the same small cost in both modes)."""
  from lmscale_jax.inference import function_vectors

  forward = function_vectors.forward

  def wrapped(model, ids, where):
    sent.append((ids.size, int((ids == model.special_ids["[PAD]"]).sum())))
    return forward(model, ids, where)

  function_vectors.forward = wrapped


def measure(a) -> dict:
  from lmscale_jax.inference import function_vectors, trained_model

  _, groups = function_groups.load(a.bench)
  texts = retrieval.Items.from_groups(groups).text[:a.functions]
  model = trained_model.load(a.workdir)
  inputs = [(str(i), "", *trained_model.encode(model, t)) for i, t in enumerate(texts)]
  modes = {"buckets": function_vectors.BUCKETS, "seq_len": 1}
  sent, tokens, vectors = [], {}, {}
  count_into(sent)
  for mode, buckets in modes.items():  # warm-up: compiles, and counts the tokens once
    sent.clear()
    vectors[mode] = timed(model, inputs, buckets)[1]
    tokens[mode] = list(sent)
  seconds: dict = {m: [] for m in modes}
  for _ in range(a.rounds):
    for mode, buckets in modes.items():
      seconds[mode].append(timed(model, inputs, buckets)[0])
  function_vectors.BUCKETS = modes["buckets"]
  ratios = [s / b for s, b in zip(seconds["seq_len"], seconds["buckets"])]
  return {
      "date": datetime.date.today().isoformat(), "host": _host.cpu_name(),
      "code": _host.code_version(), "workdir": a.workdir, "bench": a.bench,
      "functions": len(inputs), "seq_len": int(model.cfg.seq_len),
      "window": function_vectors.WINDOW, "buckets": modes["buckets"],
      "cut": float(np.mean([c for *_, c in inputs])),
      **{f"{m}_functions_per_s": round(len(inputs) / statistics.median(s), 1)
         for m, s in seconds.items()},
      **{f"{m}_seconds": [round(x, 2) for x in s] for m, s in seconds.items()},
      **{f"{m}_padding_share": round(sum(p for _, p in tokens[m]) / sum(t for t, _ in tokens[m]),
                                     3) for m in modes},
      "speedup_pair_by_pair": [round(r, 2) for r in ratios],
      "speedup_median": round(statistics.median(ratios), 2),
      "largest_vector_difference": float(np.abs(vectors["buckets"] - vectors["seq_len"]).max()),
  }


def main(argv=None) -> int:
  a = parser().parse_args(argv)
  try:
    row = measure(a)
  except UserError as e:  # a missing run or benchmark: one line
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(json.dumps(row, indent=1))
  if a.out:
    _host.append_result(a.out, row)
  return 0


if __name__ == "__main__":
  sys.exit(main())
