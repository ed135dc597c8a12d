"""lmscale gpu-check, the GPU self-check, on the CPU: with --allow-cpu at tiny shapes (every
report field present; what needs a GPU null with its reason; the attention comparison, the
real training steps and the all-reduce over 2 CPU devices measured), and without it (no GPU:
FAIL at once, saying why, measuring nothing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from lmscale_jax.exits import EXIT_USAGE
from lmscale_jax.gpu import check as gpu_check
from lmscale_jax.model import bert as model_lib
from lmscale_jax.store import dataset
from tests.helpers import ROOT, lmscale, make_config

TOOL = lmscale("gpu_check")
TINY = ["--config", "configs/tiny.py", "--set", "model.layers=1", "--set", "model.hidden=32",
        "--set", "model.ffn=64", "--seq", "32", "--vocab", "256", "--small-batch", "1",
        "--batch", "2"]


def run_tool(args, timeout=300, **env):
  full_env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  full_env.update(env)
  return subprocess.run([*TOOL, *args], cwd=ROOT, env=full_env,
                        capture_output=True, text=True, timeout=timeout,
                        stdin=subprocess.DEVNULL)


def null_fields_have_reasons(report):
  for key, value in report["versions"].items():
    if value is None:
      assert report["reasons"][f"versions.{key}"], key
  for key in ("attention", "steps", "allreduce"):
    if report[key] is None:
      assert report["reasons"][key], key


def test_allow_cpu_reports_every_field_and_measures_steps_and_allreduce(tmp_path):
  out = tmp_path / "report.json"
  r = run_tool(["--allow-cpu", *TINY, "--json", str(out)], JAX_PLATFORMS="cpu",
               JAX_NUM_CPU_DEVICES="2")
  assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
  last = r.stdout.strip().splitlines()[-1]
  assert last.startswith("PASS: CPU (--allow-cpu: no GPU was checked)"), last
  report = json.loads(out.read_text())
  assert report["gpu"] is False and report["backend"] == "cpu" and report["result"] == "PASS"
  assert report["device_count"] == 2 and [d["platform"] for d in report["devices"]] == ["cpu"] * 2
  assert set(report["versions"]) == {"python", "jax", "jaxlib", "cuda_plugin", "driver",
                                     "cuda_runtime", "cuda_driver_api", "cudnn", "nccl"}
  assert report["versions"]["jax"] == jax.__version__
  for gpu_only in ("cuda_runtime", "cuda_driver_api", "cudnn"):
    assert report["versions"][gpu_only] is None
  null_fields_have_reasons(report)
  assert "setup.sh --cuda" in report["reasons"]["devices"]

  att = report["attention"]
  assert att["candidate"] == "explicit" and att["reference"] == "xla" and att["ok"]
  assert att["key_lengths"] == [32, 25, 11, 7]
  # Packed-function (segment) masks are compared as soon as the model has them.
  segments = gpu_check.has_segment_masks()
  assert set(att["cases"]) == ({"padding", "segments"} if segments else {"padding"})
  assert segments or att["segments_reason"]
  for case in att["cases"].values():
    assert case["required"] and case["ok"]
    assert set(case["relative_error"]) == {"out", "dq", "dk", "dv"}
    assert case["max_relative_error"] <= case["tolerance"]

  small, default = report["steps"]
  assert (small["batch_per_device"], default["batch_per_device"]) == (1, 2)
  for row in (small, default):
    assert row["ok"] and row["dtype"] == "bfloat16" and row["attention"] == "xla"
    assert row["global_batch"] == 2 * row["batch_per_device"] and row["seq"] == 32
    assert row["samples_per_sec"] == pytest.approx(row["global_batch"] / row["step_s"])
    assert row["mfu"] is None and "metrics.peak_tflops" in row["mfu_reason"]
    assert row["peak_mem_gb"] is None and row["peak_mem_reason"]

  ar = report["allreduce"]
  assert ar["ok"] and ar["devices"] == 2 and ar["dtype"] == "float32"
  assert ar["bytes"] == 4 * small["params"]  # the float32 gradient of the model measured
  assert ar["busbw_gbps"] == pytest.approx(ar["algbw_gbps"])  # 2(n-1)/n = 1 for n = 2
  assert ar["algbw_gbps"] == pytest.approx(ar["bytes"] / ar["seconds"] / 1e9)


def test_without_gpu_fails_at_once_saying_so_and_measures_nothing():
  r = run_tool(["--json"], timeout=60)  # CPU-only jax, JAX_PLATFORMS unset
  assert r.returncode == 1, (r.stdout[-2000:], r.stderr[-2000:])
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith("FAIL: no GPU: ") and "bash tools/setup.sh --cuda" in last, last
  report = json.loads(r.stdout)  # --json alone: stdout is the report only
  assert report["result"] == "FAIL" and report["gpu"] is False and report["devices"] == []
  assert report["attention"] is None and report["steps"] is None and report["allreduce"] is None
  null_fields_have_reasons(report)


def test_misspelt_override_is_one_line_naming_the_key():
  r = run_tool(["--set", "model.layres=2"], timeout=60)
  err = r.stderr.strip()
  assert r.returncode == EXIT_USAGE and err.count("\n") == 0, (r.returncode, err[-2000:])
  assert err.startswith("error: --set 'model.layres=2'") and "model.layers" in err, err


def test_attention_comparison_catches_a_path_that_ignores_padding():
  cfg = model_lib.resolve_model_config(
      make_config(model=dict(layers=1, hidden=32, heads=2, ffn=64)).model,
      dataset.DatasetMeta.synthetic(32, 64))
  (q, k, v, cot), ids = gpu_check.attention_inputs(cfg)
  mask = ids != gpu_check.PAD_ID
  unmasked = jnp.ones_like(mask)
  ref = lambda q, k, v: model_lib.dot_product_attention(q, k, v, mask, impl="xla")
  wrong = lambda q, k, v: model_lib.dot_product_attention(q, k, v, unmasked, impl="explicit")
  result = gpu_check.compare_attention(wrong, ref, q, k, v, cot)
  assert not result["ok"] and result["max_relative_error"] > 10 * result["tolerance"]


@pytest.mark.skipif(os.path.exists("/dev/nvidia0"), reason="on a GPU this would run the bench")
def test_bench_gpu_stops_early_with_the_checks_reason_when_it_fails(tmp_path):
  out = tmp_path / "out"
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "BENCH_SMOKE")}
  env.update(PYTHON=sys.executable, BENCH_WORK=str(tmp_path / "work"))
  r = subprocess.run(["bash", os.path.join(ROOT, "tools", "bench_gpu.sh"), str(out)], cwd=ROOT,
                     env=env, capture_output=True, text=True, timeout=120,
                     stdin=subprocess.DEVNULL)
  assert r.returncode == 1, (r.stdout[-3000:], r.stderr[-3000:])
  stop = [l for l in r.stdout.splitlines() if "stopping: gpu_check failed (exit 1)" in l]
  assert stop and "FAIL: no GPU: " in stop[0], r.stdout[-3000:]
  assert json.loads((out / "gpu_check.json").read_text())["result"] == "FAIL"
  assert (out / "logs.tgz").exists() and "matmul" not in r.stdout  # nothing after the check
