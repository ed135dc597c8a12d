"""Loading a trained model for inference: the parameters only (``trained_model.from_workdir``:
the model's init under ``jax.eval_shape`` as the restore target, Orbax's partial restore of
``state.params``) against the full TrainState restore the tools did before (the training
step's ``abstract_state``, optimizer built, Adam moments read, parameters kept), on a
configs/bert120m.py run and on a fine-tuned run.

  python benchmarks/bench_model_load.py --dir /tmp/lmscale-bench-load [--repeats 5] [--out F]

The runs are made once under --dir (reused): bert120m trained by the real trainer for one
step (batch 2, seq 512, vocabulary 30,522 on a generated dataset: Adam's moments are a real
step's, not zeros that Orbax's compression would shrink), and a copy of
tests/data/pre_layout's fine-tuned run (a 1 × 32 encoder with its projection head). Each load
runs in a fresh subprocess (alternating the order of the two paths each repeat), which reports
the seconds from its first read of the run to the parameters on the host, and its peak RSS
(``ru_maxrss``) after its imports and after the load; the medians over the repeats are the
result. Both paths verify the checkpoint against its manifests first (SHA-256 of every file
of the step, optimizer's included: the OCDBT files hold both): that share is measured alone
too (``verify``). Writes one JSON document (date, device, per-load rows, medians, ratios)
atomically to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import _host  # noqa: E402
from lmscale_jax.cli import args as cli_args  # one line and exit 1 for a bad argument

PATHS = ("full_state", "params_only")


def _peak_rss_bytes() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


# --------------------------------------------------------------------------- the two loads
def load_full_state(workdir: str, tokenizer: str):
  """The load as it was before params-only restore: the run's optimizer built for the
  TrainState's shapes, the whole state restored (params, step, Adam's mu and nu), the
  parameters kept."""
  import jax
  import orbax.checkpoint as ocp
  from absl import logging

  from lmscale_jax.finetune import finetune_state
  from lmscale_jax.inference import model_dir
  from lmscale_jax.pretrain import mlm
  from lmscale_jax.train import checkpoint as ckpt_lib

  read = model_dir.read_run(workdir, tokenizer)
  run_config, cfg = read.run_config, read.cfg
  if model_dir.is_finetuned(run_config):
    target = finetune_state.abstract_state(run_config, cfg)
  else:
    target = mlm.build_steps(run_config, cfg, 1).abstract_state
  logging.set_verbosity(logging.ERROR)
  manager = ocp.CheckpointManager(ckpt_lib.checkpoints_dir(workdir), item_names=ckpt_lib.ITEMS,
                                  options=ocp.CheckpointManagerOptions(
                                      create=False, read_only=True,
                                      step_name_format=ckpt_lib.STEP_NAMES))
  try:
    step = ckpt_lib._verified_step(workdir, manager, manager.latest_step(), None)
    state = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target)))["state"]
  finally:
    manager.close()
  return jax.device_get(state.params)


def load_params_only(workdir: str, tokenizer: str):
  from lmscale_jax.inference import trained_model

  model = trained_model.from_workdir(workdir, tokenizer_path=tokenizer)
  if model.head is None:
    return model.params
  return {"bert": model.params, "projection": model.head["projection"]}  # as the full path's


def verify_only(workdir: str, tokenizer: str):
  from lmscale_jax.train import checkpoint as ckpt_lib
  from lmscale_jax.train import checkpoint_manifest

  step = ckpt_lib.latest_complete_step(workdir)
  assert checkpoint_manifest.verify(ckpt_lib.step_dir(workdir, step)) == []


def child(path: str, workdir: str, tokenizer: str) -> None:
  """One load in this (fresh) process: prints {"load_s", "rss_after_imports", "peak_rss"}."""
  import jax  # noqa: F401  (imports before the baseline: the same for both paths)
  import orbax.checkpoint  # noqa: F401

  from lmscale_jax.inference import trained_model  # noqa: F401
  from lmscale_jax.finetune import finetune_state  # noqa: F401
  from lmscale_jax.pretrain import mlm  # noqa: F401
  from lmscale_jax.train import steps  # noqa: F401

  base = _peak_rss_bytes()
  fn = {"full_state": load_full_state, "params_only": load_params_only,
        "verify": verify_only}[path]
  t0 = time.perf_counter()
  params = fn(workdir, tokenizer)
  seconds = time.perf_counter() - t0
  n = 0 if params is None else sum(x.size for x in jax.tree.leaves(params))
  print(json.dumps({"load_s": seconds, "rss_after_imports": base, "peak_rss": _peak_rss_bytes(),
                    "params": int(n)}))


def run_child(path: str, workdir: str, tokenizer: str) -> dict:
  r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", path,
                      "--workdir", workdir, "--tokenizer", tokenizer],
                     capture_output=True, text=True, timeout=1800,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"))
  if r.returncode != 0:
    raise SystemExit(f"error: the {path} load of {workdir} failed: {r.stderr[-2000:]}")
  return json.loads(r.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- the runs
def bert120m_run(base: str) -> tuple[str, str]:
  """configs/bert120m.py, one real training step (batch 2) on a generated dataset."""
  from lmscale_jax.train import checkpoint as ckpt_lib
  from lmscale_jax.store.synthetic_dataset import write_synthetic_dataset

  data, workdir = os.path.join(base, "bert120m-data"), os.path.join(base, "bert120m-run")
  if ckpt_lib.latest_complete_step(workdir) is not None:
    return workdir, ""
  shutil.rmtree(workdir, ignore_errors=True)
  if not os.path.isdir(data):
    write_synthetic_dataset(data, seq_len=512, vocab_size=30522, n_train=16, n_val=8, shards=1)
  overrides = {"data.path": data, "data.workers": 1, "train.batch_size": 2, "train.steps": 1,
               "train.warmup_steps": 1, "train.eval_every": 1000, "train.eval_batches": 1,
               "train.log_every": 1, "checkpoint.every": 1}
  r = subprocess.run([sys.executable, "-m", "lmscale_jax.main",
                      f"--config={ROOT}/configs/bert120m.py", f"--workdir={workdir}",
                      *(f"--config.{k}={v}" for k, v in overrides.items())],
                     cwd=ROOT, capture_output=True, text=True,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=3600)
  if r.returncode != 0:
    raise SystemExit(f"error: training the bert120m run failed: {r.stderr[-3000:]}")
  return workdir, ""


def finetuned_run(base: str) -> tuple[str, str]:
  workdir = os.path.join(base, "finetuned-run")
  if not os.path.isdir(workdir):
    shutil.copytree(os.path.join(ROOT, "tests", "data", "pre_layout", "finetune"), workdir)
  return workdir, ""


# --------------------------------------------------------------------------- the measurement
def measure(workdir: str, tokenizer: str, repeats: int) -> dict:
  rows = []
  for r in range(repeats):
    for path in (PATHS if r % 2 == 0 else PATHS[::-1]) + ("verify",):
      row = {"repeat": r, "path": path, **run_child(path, workdir, tokenizer),
             "loadavg_1m": os.getloadavg()[0]}
      rows.append(row)
      print(json.dumps(row), flush=True)
  med = {p: {k: statistics.median(x[k] for x in rows if x["path"] == p)
             for k in ("load_s", "rss_after_imports", "peak_rss")} for p in (*PATHS, "verify")}
  old, new = med["full_state"], med["params_only"]
  return {"workdir": workdir, "checkpoint_bytes": _checkpoint_bytes(workdir),
          "params": rows[0]["params"], "rows": rows, "median": med,
          "load_time_ratio_full_over_params_only": old["load_s"] / new["load_s"],
          "peak_rss_ratio_full_over_params_only": old["peak_rss"] / new["peak_rss"],
          "load_rss_ratio_full_over_params_only":
              (old["peak_rss"] - old["rss_after_imports"])
              / max(new["peak_rss"] - new["rss_after_imports"], 1)}


def _checkpoint_bytes(workdir: str) -> int:
  from lmscale_jax.train import checkpoint as ckpt_lib

  return ckpt_lib.dir_bytes(ckpt_lib.step_dir(workdir, ckpt_lib.latest_complete_step(workdir)))


def report(name: str, m: dict) -> None:
  mb = 1 << 20
  print(f"\n{name}: {m['params']:,} parameters, checkpoint {m['checkpoint_bytes'] / 1e9:.3f} GB")
  for path in (*PATHS, "verify"):
    x = m["median"][path]
    print(f"  {path:12s} {x['load_s']:7.2f} s  peak RSS {x['peak_rss'] / mb:8.0f} MiB "
          f"(+{(x['peak_rss'] - x['rss_after_imports']) / mb:.0f} over the imports)")
  print(f"  full/params-only: time {m['load_time_ratio_full_over_params_only']:.2f}x, peak RSS "
        f"{m['peak_rss_ratio_full_over_params_only']:.2f}x, RSS added by the load "
        f"{m['load_rss_ratio_full_over_params_only']:.2f}x")


def main(argv=None) -> int:
  p = cli_args.Parser(description=__doc__.splitlines()[0])
  p.add_argument("--dir", help="scratch directory for the runs (~2 GB; reused)")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--out", default="", help="write the JSON result here (atomically)")
  p.add_argument("--child", choices=(*PATHS, "verify"), help=argparse.SUPPRESS)
  p.add_argument("--workdir", help=argparse.SUPPRESS)
  p.add_argument("--tokenizer", default="", help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  if a.child:
    child(a.child, a.workdir, a.tokenizer)
    return 0
  if not a.dir or a.repeats < 1:
    p.error("--dir is required and --repeats must be >= 1")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.makedirs(a.dir, exist_ok=True)
  runs = {"bert120m": bert120m_run(a.dir), "finetuned_tiny": finetuned_run(a.dir)}
  results = {name: measure(*run, a.repeats) for name, run in runs.items()}
  for name, m in results.items():
    report(name, m)
  doc = {"date": datetime.date.today().isoformat(), "device": _host.cpu_name(),
         "host": _host.host_description(a.dir), "code": _host.code_version(),
         "repeats": a.repeats, "cpus": os.cpu_count(),
         "note": "medians over fresh subprocesses; load_s from the first read of the run to "
                 "the parameters on the host (imports excluded); peak_rss = ru_maxrss",
         "runs": results}
  if a.out:
    from lmscale_jax.store import file_io

    file_io.atomic_write_json(a.out, doc)
  return 0


if __name__ == "__main__":
  sys.exit(main())
