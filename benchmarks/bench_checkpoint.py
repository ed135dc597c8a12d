"""The cost of checkpoint manifests: a save of configs/bert120m's train state (params + Adam
moments, ~1.3 GB with a 30,522 vocabulary) through ``checkpoint.Checkpointer`` (Orbax + the
SHA-256 manifest) against the same Orbax ``CheckpointManager`` save without one, same run.

  python benchmarks/bench_checkpoint.py --dir /tmp/lmscale-bench-ckpt [--rounds 3] [--out F]

Each round, in alternating order: a synchronous save (save + wait) by plain Orbax and by the
Checkpointer, each into a fresh directory under --dir (removed after); then, on the
Checkpointer's checkpoint, the manifest alone (``write_part``: SHA-256 of every file), the
same bytes through ``zlib.crc32`` (the cheapest stdlib checksum, for comparison), and
``verify`` (what a resume reads). The files were just written, so the hashes read them from
the page cache: the numbers are the CPU cost of hashing, not the disk's. Prints a table and
one JSON line per measurement (--out appends them to a file).
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import statistics
import sys
import time
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import _host  # noqa: E402
from lmscale_jax.cli import args as cli_args  # one line and exit 1 for a bad argument


def bert120m_state(vocab_size: int):
  """The real TrainState of configs/bert120m.py (float32 params, Adam mu and nu) on CPU."""
  import importlib.util

  import jax

  from lmscale_jax.input import masking
  from lmscale_jax.model import bert as model_lib
  from lmscale_jax.store import dataset
  from lmscale_jax.pretrain import mlm

  spec = importlib.util.spec_from_file_location("bert120m", f"{ROOT}/configs/bert120m.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  meta = dataset.DatasetMeta.synthetic(seq_len=512, vocab_size=vocab_size)
  model_cfg = model_lib.resolve_model_config(config.model, meta)
  predictions = masking.num_predictions(config.data.mask_prob, config.data.max_predictions, 512)
  st = mlm.build_steps(config, model_cfg, predictions)
  state = st.init(jax.random.key(0))
  # Adam's moments start at zero, which Orbax's compression shrinks to nothing; after
  # training they are as incompressible as the weights: random values of their shapes.
  keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(state.opt_state))))
  opt_state = jax.tree.map(
      lambda x: (jax.random.normal(next(keys), x.shape, x.dtype) * 1e-3
                 if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) and x.ndim else x),
      state.opt_state)
  state = state.replace(opt_state=opt_state)
  jax.block_until_ready(state)
  return state


def crc32_files(step_dir: str) -> int:
  crc = 0
  for root, _, files in os.walk(step_dir):
    for name in sorted(files):
      with open(os.path.join(root, name), "rb") as f:
        while block := f.read(1 << 22):
          crc = zlib.crc32(block, crc)
  return crc


def timed(fn) -> float:
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


def one_round(state, data_iter, base: str, order: tuple[str, str]) -> dict:
  import orbax.checkpoint as ocp
  import grain

  from lmscale_jax.train import checkpoint, checkpoint_manifest

  out = {}
  for system in order:
    workdir = os.path.join(base, system)
    shutil.rmtree(workdir, ignore_errors=True)
    if system == "orbax":
      manager = ocp.CheckpointManager(
          checkpoint.checkpoints_dir(workdir), item_names=("state", "data"),
          options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True,
                                               step_name_format=checkpoint.STEP_NAMES))

      def save():
        manager.save(1, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=grain.checkpoint.CheckpointSave(data_iter)), force=True)
        manager.wait_until_finished()
    else:
      manager = checkpoint.Checkpointer(workdir, keep=1, use_async=False)

      def save():
        manager.save(1, state, data_iter)
    out[f"{system}_save_s"] = timed(save)
    manager.close()
    if system == "lmscale":
      step_dir = checkpoint.step_dir(workdir, 1)
      out["checkpoint_bytes"] = checkpoint.dir_bytes(step_dir)
      out["manifest_sha256_s"] = timed(lambda: checkpoint_manifest.write_part(step_dir, 0, 1, 1))
      out["crc32_s"] = timed(lambda: crc32_files(step_dir))
      problems: list = []
      out["verify_s"] = timed(lambda: problems.extend(checkpoint_manifest.verify(step_dir)))
      assert not problems, problems
    shutil.rmtree(workdir)
  return out


def main(argv=None) -> int:
  p = cli_args.Parser(description=__doc__.splitlines()[0])
  p.add_argument("--dir", required=True, help="scratch directory for the checkpoints (~3 GB)")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--vocab-size", type=int, default=30522,
                 help="bert120m's vocabulary comes from the dataset; 30522 = BERT's")
  p.add_argument("--out", default="", help="append JSON lines here")
  a = p.parse_args(argv)
  if a.rounds < 1 or a.vocab_size < 7:
    p.error("--rounds must be >= 1 and --vocab-size >= 7")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import grain
  import jax

  state = bert120m_state(a.vocab_size)
  state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  data_iter = iter(grain.MapDataset.range(16).to_iter_dataset())
  os.makedirs(a.dir, exist_ok=True)
  results = []
  for r in range(a.rounds):
    order = ("orbax", "lmscale") if r % 2 == 0 else ("lmscale", "orbax")
    row = one_round(state, data_iter, a.dir, order)
    row.update(round=r, state_bytes=state_bytes, loadavg_1m=os.getloadavg()[0])
    results.append(row)
    print(json.dumps(row), flush=True)
  med = {k: statistics.median(r[k] for r in results) for k in results[0] if k.endswith("_s")}
  gb = results[0]["checkpoint_bytes"] / 1e9
  summary = {
      "date": datetime.date.today().isoformat(), "device": _host.cpu_name(),
      "config": "configs/bert120m.py", "vocab_size": a.vocab_size, "rounds": a.rounds,
      "state_bytes": state_bytes, "checkpoint_bytes": results[0]["checkpoint_bytes"],
      **{f"median_{k}": v for k, v in med.items()},
      # per round, then the median: the machine's load moves both saves of a round alike
      "manifest_overhead_ratio": statistics.median(
          r["lmscale_save_s"] / r["orbax_save_s"] for r in results),
      "sha256_gb_s": gb / med["manifest_sha256_s"], "crc32_gb_s": gb / med["crc32_s"],
      "verify_gb_s": gb / med["verify_s"],
  }
  print(f"\nbert120m train state {state_bytes / 1e9:.2f} GB, checkpoint {gb:.2f} GB, "
        f"{a.rounds} rounds (median):")
  print(f"  Orbax save (sync)            {med['orbax_save_s']:7.2f} s")
  print(f"  Checkpointer save + manifest {med['lmscale_save_s']:7.2f} s  "
        f"({summary['manifest_overhead_ratio']:.2f}x)")
  print(f"  manifest alone (sha256)      {med['manifest_sha256_s']:7.2f} s  "
        f"({summary['sha256_gb_s']:.2f} GB/s)")
  print(f"  zlib.crc32 of the same files {med['crc32_s']:7.2f} s  "
        f"({summary['crc32_gb_s']:.2f} GB/s)")
  print(f"  verify (resume)              {med['verify_s']:7.2f} s")
  if a.out:
    with open(a.out, "a") as f:
      for row in results:
        f.write(json.dumps({"date": summary["date"], "device": summary["device"], **row}) + "\n")
      f.write(json.dumps({"summary": True, **summary}) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
