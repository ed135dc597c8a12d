"""lmscale sweep and lmscale report end to end: a real grid of launch/local.sh runs (1 and 2
CPU processes) on a real dataset, one row per point (a failing point is a row, the sweep goes
on), a rerun that skips finished points, the plots from its results; the Slurm commands it
would submit; bad grids and flags as one line."""

from __future__ import annotations

import glob
import json
import os
import signal
import struct
import subprocess
import time

import pytest

from tests.helpers import ROOT, lmscale, make_synthetic_dataset
from tests.test_faults import FAST_XLA
from tests.test_process_cleanup import kill_all, left_of, process_tree, wait_until_gone

SWEEP = lmscale("sweep")
REPORT = lmscale("report")
# The tests' small model (tests/helpers.small_train_config: the default config, 2 × 64).
CONFIG = "from tests.helpers import small_train_config\n\n\ndef get_config():\n" \
         "  return small_train_config('')\n"


def tool(script, *args, timeout=120, **env):
  return subprocess.run([*script, *map(str, args)], cwd=ROOT,
                        env={**os.environ, "JAX_PLATFORMS": "cpu", **env}, capture_output=True,
                        text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def read(path):
  return [json.loads(line) for line in open(path)]


def png_size(path):
  with open(path, "rb") as f:
    head = f.read(24)
  assert head[:8] == b"\x89PNG\r\n\x1a\n"
  return struct.unpack(">II", head[16:24])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  base = tmp_path_factory.mktemp("sweep")
  make_synthetic_dataset(str(base / "ds"), seq_len=64, vocab_size=128, n_train=128, n_val=16)
  (base / "small.py").write_text(CONFIG)
  return base


def grid_args(base, out):
  return ["--data", base / "ds", "--output", out, "--config", base / "small.py",
          "--processes", "1,2",
          "--workers", "0", "--batch", "4", "--steps", "6", "--log-every", "2",
          "--timeout", "120", "--runs", base / "runs"]


def test_grid_records_a_row_per_point_resumes_and_reports(setup, tmp_path):
  out = setup / "results.jsonl"
  r = tool(SWEEP, *grid_args(setup, out), timeout=300)
  assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
  rows = {x["processes"]: x for x in read(out)}
  assert sorted(rows) == [1, 2]
  for p, row in rows.items():
    assert row["status"] == "ok" and row["reason"] is None, row
    assert row["model"] == "small" and row["devices"] == p and row["global_batch"] == 4 * p
    assert row["windows"] == 2  # windows at steps 4 and 6: the first (step 2) is not measured
    assert row["samples_per_sec"] > 0 and row["tokens_per_sec"] > 0 and row["step_time"] > 0
    assert 0 <= row["input_wait_frac"] <= 1 and row["mfu"] is None  # no peak known on CPU
    assert row["peak_bytes"] > 0 and row["param_count"] > 0
    assert row["date"] and row["device"].startswith("cpu")
  # The medians are those of the run's own metrics.jsonl windows after the first.
  metrics = [m for m in read(os.path.join(rows[2]["workdir"], "metrics.jsonl"))
             if "samples_per_sec" in m]
  assert [m["step"] for m in metrics] == [2, 4, 6]
  measured = sorted(m["samples_per_sec"] for m in metrics[1:])
  assert measured[0] <= rows[2]["samples_per_sec"] <= measured[-1]

  again = tool(SWEEP, *grid_args(setup, out), timeout=120)
  assert again.returncode == 0, again.stderr[-2000:]
  assert "2 point(s), 2 already in" in again.stdout and "compiling" not in again.stdout
  assert read(out) == list(rows.values())  # nothing rerun, nothing rewritten

  plots = tmp_path / "plots"
  rep = tool(REPORT, out, "--output", plots, "--storage")
  assert rep.returncode == 0, rep.stderr[-2000:]
  assert png_size(plots / "scaling.png") == (600, 400)
  assert "| small w0 b4 k1 | 2 |" in rep.stdout and "efficiency" in rep.stdout
  assert "workers.png: skipped" in rep.stdout and "storage.png: skipped" in rep.stdout
  assert (plots / "report.md").read_text().startswith("## All runs")


def test_a_launch_failure_is_a_row_and_the_sweep_goes_on(setup):
  out = setup / "launch-failed.jsonl"
  r = tool(SWEEP, "--data", setup / "ds", "--output", out, "--config", setup / "small.py",
           "--processes", "1,2", "--steps", "4", "--log-every", "2", "--no-probe",
           "--env", "PYTHON=/nonexistent/python", "--runs", setup / "runs-failed")
  assert r.returncode == 0, r.stderr[-2000:]
  rows = read(out)
  assert [x["processes"] for x in rows] == [1, 2]
  for x in rows:
    assert x["status"] == "failed" and x["reason"].startswith("launch failed (exit 127)"), x
    assert "/nonexistent/python" in x["reason"]


def restore_ctrl_c():
  """A process started from a script's background inherits SIGINT ignored (and Python keeps
  it so): a test that sends Ctrl-C gives it back its default."""
  signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("how", ["kill -9", "Ctrl-C"])
def test_a_running_point_ends_with_the_sweep(setup, tmp_path, how):
  """The sweep killed (kill -9, the OOM killer) or interrupted while a point runs: the point's
  launcher, training process, Grain workers and resource tracker all end too (they lived on
  under ppid 1 and kept the CPUs from the rerun, which starts the point afresh). kill -9: the
  launcher gets SIGTERM from the kernel and stops its processes as it does for any SIGTERM
  (checkpoint, exit); Ctrl-C: the sweep stops the point, then exits 130."""
  runs, log = tmp_path / "runs", tmp_path / "sweep.log"
  cmd = [*SWEEP, "--data", setup / "ds", "--output", tmp_path / "out.jsonl",
         "--config", setup / "small.py", "--workers", "2", "--batch", "4", "--steps", "100000",
         "--log-every", "1", "--timeout", "600", "--no-probe", "--runs", runs]
  # STOP_S: launch/_procs.sh's wait between its SIGTERM and SIGKILL, for which it also stays
  # (60 s by default).
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": FAST_XLA, "STOP_S": "3",
         "JAX_COMPILATION_CACHE_DIR": str(setup / "xla_cache")}
  p = subprocess.Popen(list(map(str, cmd)), cwd=ROOT, env=env, stdout=open(log, "w"),
                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                       start_new_session=True, preexec_fn=restore_ctrl_c)
  tree = {}
  try:
    deadline = time.monotonic() + 240
    while not any(len(open(m).readlines()) >= 2 for m in glob.glob(f"{runs}/*/metrics.jsonl")):
      assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
      time.sleep(0.1)
    tree = process_tree(p.pid)
    commands = "\n".join(left_of(tree))
    assert "lmscale_jax.main" in commands and commands.count("--multiprocessing-fork") == 2
    if how == "kill -9":
      os.kill(p.pid, signal.SIGKILL)
    else:
      os.killpg(p.pid, signal.SIGINT)  # a terminal's Ctrl-C: the sweep's group, not the run's
    p.wait(timeout=60)
    left, took = wait_until_gone(tree, timeout=60)
    print(f"{how}: every process of the sweep gone {took:.1f} s after it ended")
    assert left == [], "\n".join(left)
  finally:
    kill_all(tree)
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
  if how == "kill -9":  # the launcher's SIGTERM reached the training process (not its kill)
    assert "SIGTERM received" in open(glob.glob(f"{runs}/*/sweep.log")[0]).read()
  else:
    assert p.returncode == 130
    assert log.read_text().strip().splitlines()[-1] == (
        "error: interrupted; rerun the same command: finished points are kept and skipped")


def test_slurm_commands(setup):
  r = tool(SWEEP, "--data", setup / "ds", "--output", setup / "slurm.jsonl", "--launcher",
           "slurm", "--gpus-per-node", "2", "--processes", "1,4", "--batch", "8",
           "--accum", "2", "--timeout", "900", "--slurm-arg=--partition=gpu", "--dry-run")
  assert r.returncode == 0, r.stderr
  one, four = r.stdout.strip().splitlines()
  assert four.startswith("sbatch --wait --nodes=2 --ntasks-per-node=2 --gpus-per-node=2 "
                         "--time=15 ")
  assert one.startswith("sbatch --wait --nodes=1 --ntasks-per-node=1 --gpus-per-node=1 ")
  assert f"--export=ALL,DATA_SRC={setup / 'ds'} --partition=gpu " in four
  assert f"{ROOT}/launch/slurm.sbatch --config=configs/tiny.py " in four
  assert "--config.train.batch_size=64 --config.train.grad_accum_steps=2" in four  # 8·2·4
  assert "data.path" not in four  # the job stages DATA_SRC and passes its copy
  assert not os.path.exists(setup / "slurm.jsonl")


@pytest.mark.parametrize("args, message", [
    (["--processes", "0,1"], "--processes '0,1': expected comma-separated integers >= 1"),
    (["--workers", "two"], "--workers 'two': expected comma-separated integers >= 0"),
    (["--set", "model.layerz=3"], "'model.layerz' (--set/--model) does not exist in "
                                   "configs/tiny.py; did you mean 'model.layers'?"),
    (["--set", "train.batch_size=4"], "--set train.batch_size: set by the sweep; use --batch"),
    (["--set", "model.layers=two"], "model.layers=two: expected an integer"),
    (["--model", "nolabel"], "--model 'nolabel': expected LABEL:key=value"),
    (["--config", "configs/nope.py"], "--config=configs/nope.py: no such file, and no shipped "
                                       "config of that name"),
    (["--steps", "4", "--log-every", "4"], "need at least two logging windows"),
    (["--launcher", "slurm", "--processes", "3", "--dry-run"], "--processes 3: not a whole "
                                                               "number of nodes"),
])
def test_bad_grid_is_one_line(setup, args, message):
  r = tool(SWEEP, "--data", setup / "ds", "--output", setup / "never.jsonl", *args)
  lines = r.stderr.strip().splitlines()
  assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
  assert message in lines[0]
  assert not os.path.exists(setup / "never.jsonl")


def test_missing_dataset_and_bad_results_are_one_line(setup, tmp_path):
  r = tool(SWEEP, "--data", tmp_path, "--output", tmp_path / "x.jsonl")
  assert r.returncode == 1 and r.stderr.count("\n") == 1 and "no metadata.json" in r.stderr
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"nodes": 4}\n')
  r = tool(REPORT, bad, "--output", tmp_path / "p")
  assert r.returncode == 1 and r.stderr.count("\n") == 1
  assert "not a lmscale sweep results file" in r.stderr


def test_report_regenerates_the_committed_plots_and_the_storage_models(tmp_path):
  """The committed sweeps (benchmarks/results) through report.py, with the storage model's
  own output (lmscale storage-model --json at its documented defaults)."""
  committed = [os.path.join(ROOT, "benchmarks", "results", f"2026-12-01-cpu-sweep{x}.jsonl")
               for x in ("", "-models")]
  model = tool(lmscale("storage_model"), "--json")
  assert model.returncode == 0, model.stderr[-2000:]
  storage = tmp_path / "storage.json"
  storage.write_text(model.stdout)
  r = tool(REPORT, *committed, "--output", tmp_path / "plots", "--storage", storage)
  assert r.returncode == 0, r.stderr[-2000:]
  for name in ("scaling", "workers", "models", "storage"):
    assert png_size(tmp_path / "plots" / f"{name}.png") == (600, 400), name
  assert "| step time (s) | 128 |" in r.stdout and "| one-off start-up (s) | 1 |" in r.stdout
  assert "skipped" not in r.stdout
