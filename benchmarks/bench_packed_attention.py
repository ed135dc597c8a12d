"""model.packed_attention "cross" vs "segment": what each trains to, and what a step costs.

  python benchmarks/bench_packed_attention.py --packed DATA_GREEDY --single DATA_NONE \
      [--steps 800] [--eval-batches 32] [--seed N] [--work DIR] [--time-rounds 5] [--out FILE]

``--packed``: a dataset prepared with ``--packing greedy`` (tools/prepare_binary.py);
``--single``: the same inputs prepared with ``--packing none --tokenizer PACKED/tokenizer.json``
(its validation split holds the same functions, one per sequence: prepare splits by a hash of
each function). Both must be dataset format 2 (a [CLS] per packed function).

1. Trains configs/tiny.py on ``--packed`` twice, ``packed_attention=cross`` and ``=segment``,
   the same seeds and steps (two ``python -m lmscale_jax.main`` runs started together, so both
   see the same machine load).
2. Evaluates each final checkpoint (tools/evaluate.py: training's deterministic eval masks)
   on (a) the packed validation split and (b) the one-function-per-sequence validation split,
   ``--eval-batches`` batches of train.batch_size each: MLM loss and accuracy.
3. Times the train step of both modes in one process, alternating modes every round on the
   same batches (the machine is shared: the ratio of medians, not the absolute times, is the
   result).

Prints a table; appends one JSON line per (mode, split) and one for the timing to ``--out``
(default ``benchmarks/results/<date>-cpu-packed-attention.jsonl``), with date, device and
``loadavg_1m``.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import _host  # noqa: E402
from lmscale_jax.errors import UserError  # noqa: E402
from lmscale_jax.cli.args import Parser, guarded, number  # noqa: E402

MODES = ("cross", "segment")
_RUN_TIMEOUT_S = 4 * 3600


def parser() -> Parser:
  p = Parser(description=__doc__.splitlines()[0])
  p.add_argument("--packed", required=True, help="dataset prepared with --packing greedy")
  p.add_argument("--single", required=True,
                 help="the same inputs prepared with --packing none and --packed's tokenizer")
  p.add_argument("--steps", type=number(int, 1, 1 << 30), default=800,
                 help="training steps of each mode (configs/tiny.py: 800)")
  p.add_argument("--eval-batches", type=number(int, 1, 1 << 20), default=32)
  p.add_argument("--seed", type=number(int, 0, 1 << 31), default=None,
                 help="train.seed and data.seed of both runs (default: configs/tiny.py's)")
  p.add_argument("--work", default="/tmp/bench_packed_attention",
                 help="directory for the two runs' workdirs (replaced)")
  p.add_argument("--time-rounds", type=number(int, 1, 1000), default=5,
                 help="alternating timing rounds of --time-steps steps per mode")
  p.add_argument("--time-steps", type=number(int, 1, 10000), default=10)
  p.add_argument("--out", default=os.path.join(
      ROOT, "benchmarks", "results",
      f"{datetime.date.today().isoformat()}-cpu-packed-attention.jsonl"))
  return p


def _env() -> dict:
  return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")


def check_datasets(a) -> None:
  from lmscale_jax.store import dataset

  packed, single = dataset.DatasetMeta.load(a.packed), dataset.DatasetMeta.load(a.single)
  for meta, flag, packing in ((packed, "--packed", "greedy"), (single, "--single", "none")):
    if meta.raw.get("packing") != packing or meta.raw.get("format") != dataset.FORMAT:
      raise dataset.DatasetError(
          f"{flag} {meta.path}: packing {meta.raw.get('packing')!r}, format "
          f"{meta.raw.get('format')!r}; expected packing {packing!r}, format {dataset.FORMAT!r}")
  with open(os.path.join(a.packed, dataset.TOKENIZER), "rb") as f1, \
      open(os.path.join(a.single, dataset.TOKENIZER), "rb") as f2:
    if f1.read() != f2.read():
      raise dataset.DatasetError(f"--single {a.single}: another tokenizer than --packed's; "
                                 f"prepare it with --tokenizer {a.packed}/tokenizer.json")


def train_both(a) -> dict[str, str]:
  """Both modes' runs, started together; returns mode -> workdir."""
  import shutil

  shutil.rmtree(a.work, ignore_errors=True)
  procs = {}
  for mode in MODES:
    workdir = os.path.join(a.work, mode)
    os.makedirs(workdir)
    cmd = [sys.executable, "-m", "lmscale_jax.main", f"--config={ROOT}/configs/tiny.py",
           f"--workdir={workdir}", f"--config.data.path={a.packed}",
           f"--config.train.steps={a.steps}", f"--config.model.packed_attention={mode}",
           f"--config.checkpoint.every={a.steps}"]
    if a.seed is not None:
      cmd += [f"--config.train.seed={a.seed}", f"--config.data.seed={a.seed}"]
    log = open(os.path.join(a.work, f"{mode}.log"), "w")
    procs[mode] = (subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=log, stderr=log), log,
                   workdir)
  for mode, (p, log, workdir) in procs.items():
    rc = p.wait(timeout=_RUN_TIMEOUT_S)
    log.close()
    if rc != 0:
      raise UserError(f"the {mode} run failed (rc {rc}): see {a.work}/{mode}.log")
  return {mode: workdir for mode, (_, _, workdir) in procs.items()}


def evaluate(workdir: str, data_dir: str, batches: int) -> dict:
  out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "evaluate.py"),
                        "--workdir", workdir, "--data", data_dir, "--batches", str(batches)],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=3600)
  if out.returncode != 0:
    raise UserError(f"tools/evaluate.py on {workdir} / {data_dir}: {out.stderr[-2000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def time_steps(a) -> dict:
  """Median seconds per train step of each mode, alternating modes round by round."""
  import jax

  from lmscale_jax.input import grain_pipeline
  from lmscale_jax.store import dataset
  from lmscale_jax.pretrain import mlm
  from lmscale_jax.pretrain import trainer as train

  sys.path.insert(0, os.path.join(ROOT, "configs"))
  import tiny  # configs/tiny.py

  meta = dataset.DatasetMeta.load(a.packed)
  built = {}
  for mode in MODES:
    config = tiny.get_config()
    config.data.path, config.model.packed_attention = a.packed, mode
    setup = train.build_setup(config, meta)
    steps = mlm.build_steps(config, setup.model_cfg, setup.predictions)
    state = steps.init(jax.random.key(int(config.train.seed)))
    stream = grain_pipeline.make_dataset(config, meta, "train", train=True)
    batches = [jax.device_put(b, steps.batch_sharding) for _, b in
               zip(range(a.time_steps), stream)]
    state, _ = steps.train_step(state, batches[0])  # compile
    jax.block_until_ready(state)
    built[mode] = [steps, state, batches]
  times = {mode: [] for mode in MODES}
  for _ in range(a.time_rounds):
    for mode in MODES:
      steps, state, batches = built[mode]
      t0 = time.perf_counter()
      for batch in batches:
        state, _ = steps.train_step(state, batch)
      jax.block_until_ready(state)
      times[mode].append((time.perf_counter() - t0) / len(batches))
      built[mode][1] = state
  med = {mode: statistics.median(t) for mode, t in times.items()}
  return {"seconds_per_step": med, "rounds": times,
          "segment_over_cross": med["segment"] / med["cross"]}


def main(argv=None) -> int:
  a = parser().parse_args(argv)

  def go() -> int:
    check_datasets(a)
    t0 = time.time()
    workdirs = train_both(a)
    train_wall = time.time() - t0
    base = {"date": datetime.date.today().isoformat(), "device": _host.cpu_name(),
            "config": "configs/tiny.py", "steps": a.steps, "eval_batches": a.eval_batches,
            "seed": a.seed,
            "packed": os.path.abspath(a.packed), "single": os.path.abspath(a.single),
            "train_wall_s": round(train_wall, 1)}
    rows = []
    for mode, workdir in workdirs.items():
      for split, path in (("packed validation", a.packed),
                          ("one function per sequence", a.single)):
        r = evaluate(workdir, path, a.eval_batches)
        rows.append(dict(base, mode=mode, eval_on=split, loss=r["loss"],
                         accuracy=r["accuracy"], records=r["records"], step=r["step"],
                         loadavg_1m=os.getloadavg()[0]))
    timing = dict(base, kind="step_time", **time_steps(a), loadavg_1m=os.getloadavg()[0])
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "a") as f:
      for row in rows + [timing]:
        f.write(json.dumps(row) + "\n")
    print(f"configs/tiny.py, {a.steps} steps, eval {a.eval_batches} batches × 32 sequences")
    print(f"{'mode':<8} {'evaluated on':<27} {'MLM loss':>9} {'accuracy':>9}")
    for r in rows:
      print(f"{r['mode']:<8} {r['eval_on']:<27} {r['loss']:>9.4f} {r['accuracy']:>9.2%}")
    sps = timing["seconds_per_step"]
    print(f"step time (median of {a.time_rounds} alternating rounds): cross "
          f"{sps['cross'] * 1e3:.1f} ms, segment {sps['segment'] * 1e3:.1f} ms, "
          f"segment/cross {timing['segment_over_cross']:.3f}")
    print(f"appended to {a.out}")
    return 0

  return guarded(go, "nothing was appended")


if __name__ == "__main__":
  sys.exit(main())
