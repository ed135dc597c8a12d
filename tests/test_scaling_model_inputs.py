"""``lmscale scaling-model`` as a user of another framework meets it (issue 56, item 10): float16
gradients; "vs node" against 1 node whatever --nodes lists; one warning line where a table takes
a step time that was not measured at its batch; --transport with a wrong name lists the names;
the fixed per-step cost derived from step times at two or more batches (the intercept). Each
through the installed command."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

INSTALLED = os.path.join(os.path.dirname(sys.executable), "lmscale")
BASE = ["--params", "102949632", "--network", "25gbe"]


def scaling(*argv) -> subprocess.CompletedProcess:
  return subprocess.run([INSTALLED, "scaling-model", *map(str, argv)], cwd=ROOT,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                        text=True, timeout=120, stdin=subprocess.DEVNULL)


def result(*argv) -> tuple[dict, list[str]]:
  """The --json result and the stderr's warning lines."""
  r = scaling(*argv, "--json")
  assert r.returncode == 0, r.stderr[-2000:]
  return json.loads(r.stdout), [x for x in r.stderr.splitlines() if x.startswith("warning:")]


def test_float16_gradients_are_a_dtype():
  out, _ = result(*BASE, "--step-time", "0.129", "--dtype", "float16", "--nodes", "2")
  rows = out["batches"][0]["rows"]
  assert {r["dtype"] for r in rows} == {"float16"}
  assert {r["grad_bytes"] for r in rows} == {2 * 102949632}


def test_vs_node_is_against_one_node_even_when_nodes_leaves_it_out():
  listed, _ = result(*BASE, "--step-time", "0.129", "--nodes", "1,16,128")
  left_out, _ = result(*BASE, "--step-time", "0.129", "--nodes", "16,128")
  key = lambda r: (r["dtype"], r["overlap"], r["nodes"])  # noqa: E731
  want = {key(r): r["efficiency_vs_node"] for r in listed["batches"][0]["rows"]}
  rows = left_out["batches"][0]["rows"]
  assert all(r["reference_nodes"] == 1 for r in rows)
  assert {key(r): r["efficiency_vs_node"] for r in rows} == pytest.approx(
      {k: v for k, v in want.items() if k[2] != 1})
  assert all(r["efficiency_vs_node"] < 1 for r in rows)  # 25 GbE costs 16 nodes something


def test_one_step_time_for_several_batches_is_one_warning():
  _, warnings = result(*BASE, "--step-time", "0.129", "--per-device-batch", "92,184",
                       "--nodes", "2")
  assert warnings == [
      "warning: one step time, 0.129 s (--step-time), serves every --per-device-batch (92, "
      "184): each table takes the same step time; give --step-times B:S,… for one per batch"]
  _, alone = result(*BASE, "--step-time", "0.129", "--per-device-batch", "92", "--nodes", "2")
  assert alone == []


def test_step_times_outside_the_measured_batches_are_one_warning():
  _, warnings = result(*BASE, "--step-times", "92:0.07,184:0.129", "--per-device-batch",
                       "64,92,128,256", "--nodes", "2")
  assert len(warnings) == 1, warnings
  assert warnings[0].startswith("warning: --per-device-batch 64, 256: outside the measured "
                                "batches 92–184 (line through --step-times): step times "
                                "extrapolated along the line")
  _, inside = result(*BASE, "--step-times", "92:0.07,184:0.129", "--per-device-batch",
                     "92,128,184", "--nodes", "2")
  assert inside == []
  _, one_point = result(*BASE, "--step-times", "92:0.07", "--per-device-batch", "184",
                        "--nodes", "2")
  assert len(one_point) == 1 and "only batch 92 was measured" in one_point[0]


def test_a_wrong_transport_name_lists_the_names():
  r = scaling(*BASE, "--step-time", "0.129", "--transport", "foo")
  assert r.returncode == 1 and r.stdout == ""
  assert r.stderr.splitlines() == [
      "error: --transport foo: neither a transport (line-rate, nccl-ib, nccl-roce, "
      "nccl-socket) nor a file; give one of those names, or the output of "
      "benchmarks/bench_allreduce.py"]


def test_the_fixed_cost_is_the_intercept_of_step_times_at_two_batches():
  # t(b) = 0.04 + 0.02·b: 40 ms do not grow with the batch.
  out, _ = result(*BASE, "--step-times", "8:0.2,16:0.36", "--per-device-batch", "8,16",
                  "--nodes", "1,2")
  assert [b["fixed_s"] for b in out["batches"]] == pytest.approx([0.04, 0.04])
  assert ("fixed per-step cost: 40 ms, the intercept of the line through --step-times (its "
          "step time at batch 0; --fixed-ms replaces it)") in out["given"]
  given, _ = result(*BASE, "--step-times", "8:0.2,16:0.36", "--per-device-batch", "8",
                    "--fixed-ms", "10", "--nodes", "1")
  assert given["batches"][0]["fixed_s"] == pytest.approx(0.01)
