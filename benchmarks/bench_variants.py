"""What model.positions (absolute | segment | instruction) × model.norm (post | pre) cost per
train step: the six variants paired in one process, on the same batches.

  python benchmarks/bench_variants.py --shapes tiny:128,tiny:256,tiny:512,base:128 \
      [--base-batch 2] [--rounds 5] [--steps 2] [--out FILE]

A shape is ``NAME:SEQ``: ``tiny`` = configs/tiny.py (2 × 128, batch 32), ``base`` =
configs/bert120m.py's encoder (12 × 768, BERT-base) at ``--base-batch`` sequences; float32
compute for both (CPUs have no fast bfloat16 matmuls), dropout as the config. The step is the
real one (``mlm.build_steps``: jitted, donated) on synthetic packed rows of functions made of
[NEXT]-separated instructions (``[CLS] i1 [NEXT] i2 … [SEP]``, 1-8 instructions of 1-4
tokens, [PAD] after the last function that fits), so segment windows and instruction indices
see what a binary dataset gives them; ``ceil(0.15 × seq)`` predictions per row.

For each shape the six steps are compiled, then timed in ``--rounds`` rounds; each round runs
``--steps`` steps of every variant in turn (the machine is shared: the ratio of medians to
segment + post, the default, is the result, not the absolute times).

Appends one JSON line per (shape, variant) to ``--out`` (default
``benchmarks/results/<date>-cpu-variants-step.jsonl``): date, host, shape, variant,
median seconds per step, its ratio to segment + post's, the paired ratio (each round's time
over segment + post's in that round, median over rounds), the rounds, parameters, compile
seconds, ``loadavg_1m``.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import _host  # noqa: E402
from lmscale_jax.cli.args import Parser, guarded, number  # noqa: E402
from lmscale_jax.errors import UserError  # noqa: E402

POSITIONS = ("absolute", "segment", "instruction")
NORMS = ("post", "pre")
BASELINE = ("segment", "post")
CONFIGS = {"tiny": "configs/tiny.py", "base": "configs/bert120m.py"}


def parser() -> Parser:
  p = Parser(description=__doc__.splitlines()[0])
  # Required: the whole run is minutes of a busy CPU, never what a bare invocation starts.
  p.add_argument("--shapes", required=True,
                 help="comma-separated NAME:SEQ, NAME one of " + ", ".join(CONFIGS)
                 + " (docs/training.md: tiny:128,tiny:256,tiny:512,base:128)")
  p.add_argument("--base-batch", type=number(int, 1, 1 << 20), default=4,
                 help="global batch of the base shape (tiny: its config's 32)")
  p.add_argument("--rounds", type=number(int, 1, 1000), default=5)
  p.add_argument("--steps", type=number(int, 1, 1000), default=3, help="steps per round")
  p.add_argument("--out", default=os.path.join(
      ROOT, "benchmarks", "results",
      f"{datetime.date.today().isoformat()}-cpu-variants-step.jsonl"))
  return p


def parse_shapes(text: str) -> list[tuple[str, int]]:
  shapes = []
  for item in text.split(","):
    name, _, seq = item.strip().partition(":")
    if name not in CONFIGS or not seq.isdigit() or int(seq) < 16:
      raise UserError(f"--shapes item {item!r}: expected NAME:SEQ with NAME one of "
                      f"{sorted(CONFIGS)} and SEQ an integer >= 16")
    shapes.append((name, int(seq)))
  return shapes


def packed_rows(rng, batch: int, seq: int, special: dict, vocab: int):
  """[batch, seq] int32 rows of whole synthetic functions (see the module docstring)."""
  import numpy as np

  cls, sep, pad, nxt = (special[t] for t in ("[CLS]", "[SEP]", "[PAD]", "[NEXT]"))
  rows = np.full((batch, seq), pad, np.int32)
  for row in rows:
    at = 0
    while True:
      parts = [rng.integers(len(special), vocab, int(rng.integers(1, 5))).tolist() + [nxt]
               for _ in range(int(rng.integers(1, 9)))]
      ids = [cls, *sum(parts, [])[:-1], sep]
      if at + len(ids) > seq:
        break
      row[at:at + len(ids)] = ids
      at += len(ids)
  return rows


def make_batch(rng, rows, predictions: int) -> dict:
  import numpy as np

  real = rows != 0
  keys = np.where(real, rng.random(rows.shape), 2.0)  # [PAD] last: never drawn while real remain
  pos = np.sort(np.argsort(keys, axis=1)[:, :predictions], axis=1).astype(np.int32)
  labels = np.take_along_axis(rows, pos, axis=1)
  weights = np.take_along_axis(real, pos, axis=1).astype(np.float32)
  return {"input_ids": rows, "mlm_positions": pos, "mlm_labels": labels,
          "mlm_weights": weights}


def build(name: str, seq: int, positions: str, norm: str, base_batch: int, vocab: int):
  """(compiled step, state, param count, compile seconds) of one variant."""
  import jax

  from lmscale_jax.config import loader
  from lmscale_jax.model import flops as flops_lib
  from lmscale_jax.store import dataset
  from lmscale_jax.pretrain import mlm
  from lmscale_jax.pretrain import trainer

  config = loader.load(os.path.join(ROOT, CONFIGS[name]))
  config.model.vocab_size = config.model.seq_len = 0  # from the synthetic metadata
  config.model.update(dtype="float32", positions=positions, norm=norm)
  config.train.memory_check = False
  if name != "tiny":
    config.train.batch_size = base_batch
  s = trainer.build_setup(config, dataset.DatasetMeta.synthetic(seq, vocab))
  st = mlm.build_steps(config, s.model_cfg, s.predictions)
  abstract = flops_lib.abstract_batch(config.train.batch_size, seq, s.predictions,
                                      st.batch_sharding)
  t0 = time.perf_counter()
  step = st.train_step.lower(st.abstract_state, abstract).compile()
  compile_s = time.perf_counter() - t0
  state = st.init(jax.random.key(0))
  return step, state, s.param_count, compile_s, config.train.batch_size, s.predictions


def measure_shape(a, name: str, seq: int, vocab: int = 512) -> list[dict]:
  import jax
  import numpy as np

  from lmscale_jax.store import dataset

  special = dataset.DatasetMeta.synthetic(seq, vocab).special_ids
  built, batches = {}, None
  for positions in POSITIONS:
    for norm in NORMS:
      step, state, params, compile_s, batch, predictions = build(
          name, seq, positions, norm, a.base_batch, vocab)
      if batches is None:
        rng = np.random.default_rng(0)
        batches = [jax.device_put(make_batch(rng, packed_rows(rng, batch, seq, special, vocab),
                                             predictions)) for _ in range(2)]
      state, m = step(state, batches[0])  # warm: the first call allocates
      jax.block_until_ready(m)
      built[(positions, norm)] = [step, state, params, compile_s, batch]
  times = {k: [] for k in built}
  for _ in range(a.rounds):
    for key, entry in built.items():
      step, state = entry[0], entry[1]
      t0 = time.perf_counter()
      for i in range(a.steps):
        state, m = step(state, batches[i % 2])
      jax.block_until_ready(m)
      times[key].append((time.perf_counter() - t0) / a.steps)
      entry[1] = state
  medians = {k: statistics.median(v) for k, v in times.items()}
  # Paired: each round's time over the baseline's in the same round (the load the other jobs
  # put on the machine moves both), then the median over rounds.
  paired = {k: statistics.median(t / b for t, b in zip(v, times[BASELINE]))
            for k, v in times.items()}
  base = {"date": datetime.date.today().isoformat(), "device": _host.cpu_name(),
          "host": _host.host_description(ROOT), "config": CONFIGS[name], "shape": name,
          "seq": seq, "batch": built[BASELINE][4], "dtype": "float32", "rounds": a.rounds,
          "steps_per_round": a.steps}
  return [dict(base, positions=p, norm=n, params=built[(p, n)][2],
               seconds_per_step=medians[(p, n)],
               ratio_to_segment_post=medians[(p, n)] / medians[BASELINE],
               paired_ratio_to_segment_post=paired[(p, n)],
               min_seconds_per_step=min(times[(p, n)]),
               round_seconds=times[(p, n)], compile_s=round(built[(p, n)][3], 2),
               loadavg_1m=os.getloadavg()[0])
          for p, n in built]


def main(argv=None) -> int:
  a = parser().parse_args(argv)

  def go() -> int:
    shapes = parse_shapes(a.shapes)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    print(f"{'shape':<6} {'seq':>4} {'positions':<12} {'norm':<5} {'ms/step':>9} "
          f"{'vs segment+post':>16} {'paired':>7}")
    for name, seq in shapes:
      rows = measure_shape(a, name, seq)
      with open(a.out, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
      for r in rows:
        print(f"{name:<6} {seq:>4} {r['positions']:<12} {r['norm']:<5} "
              f"{r['seconds_per_step'] * 1e3:>9.1f} {r['ratio_to_segment_post']:>16.3f} "
              f"{r['paired_ratio_to_segment_post']:>7.3f}",
              flush=True)
    print(f"appended to {a.out}")
    return 0

  return guarded(go, "nothing more was appended")


if __name__ == "__main__":
  sys.exit(main())
