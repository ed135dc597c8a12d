"""The cluster model (lmscale_jax/study/cluster_model/, lmscale scaling-model), its calibration
from a real 2-process all-reduce (benchmarks/bench_allreduce.py), and the storage model's
measurement of the real loader (lmscale_jax/study/storage_model.py, lmscale storage-model).

No timings are asserted (speed lives in benchmarks/): the formulas against the issue's worked
example and against each other, the fit against points it must reproduce, the tools' outputs
and their one-line errors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lmscale_jax.study.cluster_model import collectives as coll
from lmscale_jax.study.cluster_model import links, measured
from lmscale_jax.study.cluster_model import overlap as ov
from lmscale_jax.study.cluster_model import step_time as cm
from lmscale_jax.study import storage_model as sm
from tests.helpers import ROOT, lmscale, make_config, make_synthetic_dataset

TOOL = lmscale("scaling_model")
STORAGE_TOOL = lmscale("storage_model")
BERT_BASE = 102_949_632  # the H200 anchor's BERT-base (../shared/bench/h200-anchor-*.jsonl)
NET25 = links.network(links.PRESETS["25gbe"])  # one 25 GbE NIC at line rate


def tool(*args, script=TOOL, timeout=120):
  return subprocess.run([*script, *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=timeout, env=dict(os.environ, JAX_PLATFORMS="cpu"))


def one_error_line(result) -> str:
  lines = result.stderr.strip().splitlines()
  assert result.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), (
      result.returncode, result.stderr[-2000:])
  return lines[0]


# ----------------------------------------------------------------------------- formulas
def test_ring_over_128_nodes_of_25gbe_matches_the_issue_example():
  # issue 11: ~0.21 GB of bf16 gradients, 128 nodes x 2 GPUs, 25 GbE: ~0.41 GB per node, ~0.13 s
  grad = BERT_BASE * 2
  comm = coll.allreduce_s(grad, 128, 2, NET25, links.NVLINK_BRIDGE, "flat")
  per_node_traffic = 2 * 255 / 256 * grad
  assert per_node_traffic == pytest.approx(0.41e9, rel=0.01)
  assert comm == pytest.approx(per_node_traffic / (25e9 / 8) + 2 * 255 * 10e-6)
  assert 0.12 < comm < 0.14
  # without overlap the step doubles: about half the cluster's time is waiting
  c = cm.compute(0.129)
  assert cm.efficiency(c, comm, 1) == pytest.approx(0.129 / (0.129 + comm))
  assert cm.efficiency(c, comm, 1) < 0.5


def test_hierarchical_reduction_saves_latency_not_bandwidth():
  net, nv = NET25, links.NVLINK_BRIDGE
  small, large = 1e6, 4e8
  flat_small = coll.allreduce_s(small, 256, 8, net, nv, "flat")
  hier_small = coll.allreduce_s(small, 256, 8, net, nv, "hierarchical")
  assert hier_small < flat_small / 4  # 2*255 instead of 2*2047 network latencies
  # without latencies the two move the same bytes over the network links (to 1%)
  net0 = links.network(links.Link("net", net.nic.bandwidth, 0.0))
  nv0 = links.Link("nv", nv.bandwidth, 0.0)
  flat_large = coll.allreduce_s(large, 256, 8, net0, nv0, "flat")
  hier_large = coll.allreduce_s(large, 256, 8, net0, nv0, "hierarchical")
  assert hier_large == pytest.approx(flat_large, rel=0.01)
  # one node: every algorithm is the intra-node ring
  assert {coll.allreduce_s(large, 1, 2, net, nv, a) for a in coll.ALGORITHMS} == {
      coll.ring_allreduce_s(large, 2, nv.latency, nv.bandwidth)}


def test_overlap_hides_at_most_the_backward_two_thirds_of_a_step():
  def step(t, comm, k, overlap):
    c = cm.compute(t)
    _, exposed = ov.exposed_s(lambda m: comm, 1e6, ov.BACKWARD_FRACTION * c.micro, overlap)
    return cm.step_s(c, exposed, k)

  assert step(0.3, 0.1, 1, "backward") == 0.3  # fully hidden
  assert step(0.3, 0.5, 1, "backward") == pytest.approx(0.3 + 0.5 - 0.2)
  assert step(0.3, 0.5, 4, "none") == pytest.approx(1.2 + 0.5)
  with pytest.raises(cm.ModelError, match="overlap 'always'"):
    step(0.3, 0.5, 1, "always")


@pytest.mark.parametrize("fixed,jitter", [(0.0, 0.0), (0.02, 0.0), (0.02, 0.01)])
def test_recommended_k_is_the_smallest_that_reaches_the_target(fixed, jitter):
  c = cm.compute(0.129, fixed, jitter)
  for exposed in (0.0, 0.01, 0.13, 0.27, 2.0):
    k = cm.smallest_k(c, exposed, 256, 0.95)
    assert cm.efficiency(c, exposed, k, cm.straggler_s(c, 256, k)) >= 0.95
    assert k == 1 or cm.efficiency(c, exposed, k - 1, cm.straggler_s(c, 256, k - 1)) < 0.95


def test_recommendation_prefers_the_smaller_k_then_float32():
  out = cm.predict(0.129, BERT_BASE, cm.Cluster(NET25), nodes=(1, 128))
  rec = {(r["overlap"], r["nodes"]): r for r in out["recommendations"]}
  assert rec["none", 1] == {"overlap": "none", "nodes": 1, "k": 1, "dtype": "float32",
                            "global_batch": None}
  bf16 = next(r for r in out["rows"] if r["dtype"] == "bfloat16" and r["nodes"] == 128
              and r["overlap"] == "none")
  assert rec["none", 128]["dtype"] == "bfloat16" and rec["none", 128]["k"] == bf16[
      "k_for_target"]


def test_fit_recovers_the_link_from_ring_timings():
  alpha, beta = 250e-6, 1.5e9
  points = [(p, n, coll.ring_allreduce_s(n, p, alpha, beta)) for p in (2, 4)
            for n in (1e6, 8e6, 64e6, 256e6)]
  fitted = measured.fit_alpha_beta(points)
  assert fitted == pytest.approx((alpha, beta), rel=1e-9)
  with pytest.raises(cm.ModelError, match="at least two"):
    measured.fit_alpha_beta(points[:1])


# ----------------------------------------------------------------------------- the tool
def test_config_gives_gradient_bytes_comm_and_efficiency_per_node_count():
  from lmscale_jax.config import defaults as config_defaults
  from lmscale_jax.model import flops

  result = tool("--config", "configs/bert120m.py", "--step-time", "0.129", "--json")
  assert result.returncode == 0, result.stderr
  out = json.loads(result.stdout)
  model = config_defaults.bert_config(layers=12, hidden=768, heads=12, ffn=3072).model
  model.vocab_size = 8192
  assert out["params"] == flops.count_params_from_config(model)
  rows = out["batches"][0]["rows"]
  assert sorted({r["nodes"] for r in rows}) == [2 ** i for i in range(11)]
  fp32 = [r for r in rows if r["dtype"] == "float32" and r["overlap"] == "none"]
  assert all(r["grad_bytes"] == 4 * out["params"] for r in fp32)
  assert [r["comm_s"] for r in fp32] == sorted(r["comm_s"] for r in fp32)
  text = tool("--config", "configs/bert120m.py", "--step-time", "0.129", "--nodes", "1,128")
  assert "float32 gradients" in text.stdout and "| 128 | 256 |" in text.stdout
  assert "recommended" in text.stdout


@pytest.mark.parametrize("args,match", [
    (["--network", "40gbe"], "unknown network preset '40gbe': expected one of 10gbe"),
    (["--bandwidth-gbit", "0"], "bandwidth '0': expected a positive number"),
    (["--bandwidth-gbit", "-25"], "bandwidth '-25': expected a positive number"),
    (["--intra-gbyte", "nan"], "intra-node bandwidth 'nan': expected a positive number"),
    (["--step-time", "0"], "step time '0': expected a positive number"),
    (["--step-time", "-0.1"], "step time '-0.1': expected a positive number"),
    (["--target", "1.5"], "target efficiency 1.5: expected a number in \\(0, 1\\)"),
])
def test_bad_values_are_one_line(args, match):
  base = {"--step-time": "0.129", "--params": "1000"}
  for flag in args[::2]:
    base.pop(flag, None)
  argv = [x for kv in base.items() for x in kv] + args
  assert __import__("re").search(match, one_error_line(tool(*argv)))


def test_bad_sources_are_one_line(tmp_path):
  assert "--step-time is required" in one_error_line(tool("--params", "1000"))
  assert "exactly one of" in one_error_line(tool("--step-time", "1"))
  empty = tmp_path / "run"
  empty.mkdir()
  line = one_error_line(tool("--workdir", str(empty)))
  assert f"{empty}/metrics.jsonl has 0 step_time rows" in line
  assert "not a directory" in one_error_line(tool("--workdir", str(tmp_path / "none")))
  line = one_error_line(tool("--step-time", "1", "--params", "9", "--calibration",
                             str(tmp_path / "none.jsonl")))
  assert "--calibration" in line and "cannot read it" in line


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("ds")
  make_synthetic_dataset(str(d), seq_len=64, vocab_size=128, n_train=256, n_val=32, shards=4)
  return str(d)


def test_workdir_of_a_real_run_gives_step_time_and_parameters(dataset_dir, tmp_path):
  from lmscale_jax.model import flops
  from tests.test_distributed import FAST_XLA

  workdir = str(tmp_path / "w")
  # a real run of the trainer (the small test model, 4 steps, a window per step)
  run = subprocess.run(
      [sys.executable, "-m", "lmscale_jax.main", "--config=configs/tiny.py",
       f"--config.data.path={dataset_dir}", f"--workdir={workdir}", "--config.model.hidden=64",
       "--config.model.ffn=128", "--config.train.batch_size=8", "--config.train.steps=4",
       "--config.train.log_every=1", "--config.train.eval_every=4",
       "--config.train.eval_batches=1", "--config.checkpoint.every=4"], cwd=ROOT,
      capture_output=True, text=True, timeout=300,
      env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_XLA))
  assert run.returncode == 0, run.stderr[-2000:]
  got = measured.workdir_step(workdir)
  rows = [json.loads(x) for x in open(os.path.join(workdir, "metrics.jsonl"))]
  times = [r["step_time"] for r in rows if isinstance(r.get("step_time"), float)]
  assert got["windows"] == len(times) - 1 and got["step_time_s"] > 0
  shape = json.load(open(os.path.join(workdir, "config.json")))["model"]
  import ml_collections

  assert got["params"] == flops.count_params_from_config(ml_collections.ConfigDict(shape))
  result = tool("--workdir", workdir, "--network", "hdr", "--nodes", "1,2", "--json")
  assert result.returncode == 0, result.stderr
  assert json.loads(result.stdout)["batches"][0]["step_time_s"] == pytest.approx(got["step_time_s"])


def test_calibration_from_a_real_two_process_allreduce(tmp_path):
  out = tmp_path / "allreduce.jsonl"
  bench = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "bench_allreduce.py"), "--processes",
       "2", "--sizes-mb", "0.25,16", "--repeats", "3", "--leaves", "3", "--out", str(out)],
      cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert bench.returncode == 0, bench.stderr[-2000:]
  rows = [json.loads(x) for x in open(out)]
  points = [r for r in rows if r["kind"] == "point"]
  assert sorted((r["processes"], r["bytes"], r["leaves"]) for r in points) == [
      (2, 250_000, 1), (2, 250_000, 3), (2, 16_000_000, 1), (2, 16_000_000, 3)]
  assert all(len(r["seconds"]) == 3 and r["page_faults_per_call"] >= 0 for r in points)
  # The same bytes as 3 arrays in one call: reported beside the one array, never fitted.
  assert "| processes | MB | leaves |" in bench.stdout
  assert all("fits" in r for r in points if r["leaves"] == 1)
  assert not any("fits" in r for r in points if r["leaves"] == 3)
  fit = next(r for r in rows if r["kind"] == "fit" and r["fit_of"] == "all")
  assert fit["beta_bytes_per_s"] > 0 and fit["alpha_s"] >= 0
  link = measured.load_calibration(str(out))
  assert (link.bandwidth, link.latency) == (fit["beta_bytes_per_s"], fit["alpha_s"])
  result = tool("--step-time", "0.1", "--params", "500000", "--calibration", str(out),
                "--gpus-per-node", "1", "--nodes", "1,2", "--json")
  two = [r for r in json.loads(result.stdout)["batches"][0]["rows"] if r["nodes"] == 2]
  assert two[0]["comm_s"] == pytest.approx(coll.ring_allreduce_s(
      2_000_000, 2, fit["alpha_s"], fit["beta_bytes_per_s"]))  # 500,000 float32 parameters


# ----------------------------------------------------------------------------- storage
def test_loader_opens_each_shard_once_and_reads_every_record(dataset_dir):
  from lmscale_jax.store import dataset

  meta = dataset.DatasetMeta.load(dataset_dir)
  config = make_config(dataset_dir, train=dict(batch_size=16))
  got = sm.measure_loader(config, meta, batches=20)
  assert got["records"] == 320 and got["shards"] == 4
  assert got["shard_opens"] == 4  # lazily, once each, kept open
  assert got["bytes_per_record"] >= got["record_payload_bytes"] == 128
  assert got["read_calls_per_record"] > 0


def test_shared_storage_limits_input_and_staging_pays_once():
  demand = sm.Demand(records_per_s=1000, bytes_per_record=8192, read_calls_per_record=1,
                     opens=400)
  storage = sm.Storage(bandwidth=1e9, read_ops=1e9, metadata_ops=1000)
  rows = sm.compare([1, 64], 2, demand, storage, link_bytes=3.125e9, dataset_bytes=25e9,
                    stage_bytes_per_s=200e6, step_s=0.1)
  one, many = rows
  assert one["input_efficiency"] == 1 and one["stage_pays_after_steps"] is None
  assert many["bytes_per_s"] == 128 * 1000 * 8192
  assert many["input_efficiency"] == pytest.approx(1e9 / many["bytes_per_s"])
  assert many["stage_s"] == pytest.approx(25e9 / (1e9 / 64))  # the FS shared by 64 copies
  assert many["stage_pays_after_steps"] == pytest.approx(
      many["stage_s"] / (0.1 / many["input_efficiency"] - 0.1))
  assert many["startup_open_s"] == 128 * 400 / 1000


def test_storage_tool_models_a_measurement_and_rejects_bad_files(dataset_dir, tmp_path):
  io = tmp_path / "io.jsonl"
  io.write_text(json.dumps({"bench": "loader-io", "date": "2026-12-01", "seq_len": 512,
                            "bytes_per_record": 9000.0, "read_calls_per_record": 1.0,
                            "record_payload_bytes": 1024, "records_per_s": 5e4}) + "\n")
  result = tool("--io-file", str(io), "--nodes", "1,128", "--stage-mbyte", "200", "--json",
                script=STORAGE_TOOL)
  assert result.returncode == 0, result.stderr
  rows = json.loads(result.stdout)["rows"]
  assert rows[1]["records_per_s"] == pytest.approx(256 * 184 / 0.129)
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"bench": "stage"}\n')
  assert "no loader-io row" in one_error_line(tool("--io-file", str(bad),
                                                   script=STORAGE_TOOL))
  assert "storage bandwidth '0'" in one_error_line(tool("--fs-gbyte", "0",
                                                        script=STORAGE_TOOL))


def test_calibration_ignores_fits_of_page_faulting_runs(tmp_path):
  path = tmp_path / "cal.jsonl"
  fit = {"bench": "allreduce", "kind": "fit", "fit_of": "all", "alpha_s": 1e-4}
  path.write_text("".join(json.dumps(r) + "\n" for r in (
      {**fit, "heap": "keep", "beta_bytes_per_s": 7e8},
      {**fit, "heap": "default", "beta_bytes_per_s": 2e8})))
  assert measured.load_calibration(str(path)).bandwidth == 7e8
  path.write_text(json.dumps({**fit, "heap": "default", "beta_bytes_per_s": 2e8}) + "\n")
  with pytest.raises(cm.ModelError, match="no fit line with fit_of='all' of a heap=keep run"):
    measured.load_calibration(str(path))
