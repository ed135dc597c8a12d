"""The cluster model's algebra (lmscale_jax/study/cluster_*.py): its limits, its invariances, and
each new term against the formula its docstring states. No timings: arithmetic only."""

from __future__ import annotations

import json
import math

import ml_collections
import pytest

from lmscale_jax.study.cluster_model import collectives as coll
from lmscale_jax.study.cluster_model import links
from lmscale_jax.study.cluster_model import overlap as ov
from lmscale_jax.study.cluster_model import step_time as cm
from tests.test_scaling_model import BERT_BASE, one_error_line, tool

NODES = (1, 2, 4, 16, 128)


def net(gbit: float, latency_us: float = 0.0, nics: int = 1, transport=links.LINE_RATE):
  return links.network(links.link("test NIC", gbit * 1e9 / 8, latency_us * 1e-6), nics,
                       transport)


def bert_large():
  return ml_collections.ConfigDict(dict(hidden=1024, ffn=4096, layers=24, vocab_size=30522,
                                        seq_len=512, type_vocab_size=2, positions="absolute",
                                        norm="post"))


def table(c, cluster, **kw):
  return cm.predict(c, BERT_BASE, cluster, nodes=NODES, **kw)["rows"]


# ----------------------------------------------------------------------------- limits
def test_free_network_and_no_jitter_give_one_hundred_percent_everywhere():
  free = cm.Cluster(net(1e12), links.Link("free intra", 1e22, 0.0))
  c = cm.compute(0.129, fixed=0.02, profile=ov.UNIFORM)
  for algorithm in ("flat", "hierarchical", "tree", "in-network", "best"):
    cluster = cm.Cluster(free.network, free.intra, 8, algorithm)
    rows = table(c, cluster, k={1: 1, 16: 4})
    assert all(r["efficiency"] == pytest.approx(1, abs=1e-6) for r in rows)
    assert all(r["efficiency_vs_node"] == pytest.approx(1, abs=1e-6)
               for r in table(c, cluster, k=2))
    # a larger k amortises the fixed cost: per-GPU throughput above one node's at k = 1
    assert all(r["efficiency_vs_node"] == pytest.approx((4 / (0.02 + 4 * 0.109)) / (1 / 0.129))
               for r in rows if r["nodes"] >= 16)


@pytest.mark.parametrize("algorithm", coll.ALGORITHMS)
def test_one_node_has_no_network_term(algorithm):
  intra = links.NVLINK_BRIDGE
  for network in (net(25, 10), net(1, 1000, nics=4)):
    assert coll.network_s(4e8, 1, 2, network, intra, algorithm) == 0.0
    assert coll.allreduce_s(4e8, 1, 2, network, intra, algorithm) == coll.ring_allreduce_s(
        4e8, 2, intra.latency, intra.bandwidth)
  slow, fast = (cm.Cluster(n, intra, 2, algorithm) for n in (net(1, 1000), net(400, 1)))
  c = cm.compute(0.5, fixed=0.01, jitter=0.005)
  assert [r["step_s"] for r in cm.predict(c, BERT_BASE, slow, nodes=(1,))["rows"]] == [
      r["step_s"] for r in cm.predict(c, BERT_BASE, fast, nodes=(1,))["rows"]]


@pytest.mark.parametrize("algorithm", ("flat", "hierarchical", "tree", "in-network"))
def test_doubling_the_link_rate_halves_the_network_time(algorithm):
  for nodes in (2, 16, 128):
    one = coll.network_s(4e8, nodes, 2, net(25), links.NVLINK_BRIDGE, algorithm)
    two = coll.network_s(4e8, nodes, 2, net(50), links.NVLINK_BRIDGE, algorithm)
    assert two == pytest.approx(one / 2, rel=1e-12)
    # and two NICs of the same rate are the same as one of twice the rate
    assert coll.network_s(4e8, nodes, 2, net(25, nics=2), links.NVLINK_BRIDGE,
                          algorithm) == pytest.approx(two, rel=1e-12)


def test_eight_nics_of_25_gbe_are_one_200_gbit_link_in_every_row():
  c = cm.compute(0.129, profile=ov.UNIFORM)
  eight = table(c, cm.Cluster(net(25, 10, nics=8)))
  one = table(c, cm.Cluster(net(200, 10)))
  assert [r["step_s"] for r in eight] == pytest.approx([r["step_s"] for r in one], rel=1e-12)
  assert net(25, 10, nics=8).describe().startswith("8 x 25 Gb/s = 200 Gb/s per node")


# ----------------------------------------------------------------------------- algorithms
def test_tree_beats_the_ring_on_small_messages_at_scale_and_ties_on_large_ones():
  n25, nv = net(25, 10), links.NVLINK_BRIDGE
  assert coll.allreduce_s(1e5, 128, 8, n25, nv, "tree") < coll.allreduce_s(
      1e5, 128, 8, n25, nv, "flat") / 10  # 2*7 latencies instead of 2*1023
  zero = net(25)
  flat = coll.network_s(4e8, 128, 8, zero, nv, "flat")
  tree = coll.network_s(4e8, 128, 8, zero, nv, "tree")
  assert tree == pytest.approx(flat * 1024 / 1023, rel=1e-9)  # 2m vs 2(p-1)/p m
  assert coll.network_s(4e8, 128, 8, zero, nv, "in-network") == pytest.approx(tree / 2)
  best = coll.allreduce_s(1e5, 128, 8, n25, nv, "best")
  assert best == coll.allreduce_s(1e5, 128, 8, n25, nv, "tree")


def test_transport_efficiency_scales_the_bandwidth_term_only():
  curve = links.transport_curve("test", [(1e6, 0.5), (1e8, 1.0)])
  assert curve.at(1e3) == 0.5 and curve.at(1e9) == 1.0
  assert curve.at(1e7) == pytest.approx(0.75)  # log-linear between the points
  lossy, ideal = net(25, 10, transport=curve), net(25, 10)
  for m in (1e5, 1e7, 4e8):
    t_lossy = coll.network_s(m, 16, 1, lossy, links.NVLINK_BRIDGE, "flat")
    t_ideal = coll.network_s(m, 16, 1, ideal, links.NVLINK_BRIDGE, "flat")
    latency = 2 * 15 * 10e-6
    assert t_lossy - latency == pytest.approx((t_ideal - latency) / curve.at(m))
  with pytest.raises(links.ModelError, match="0 < efficiency <= 1.5"):
    links.transport_curve("bad", [(1e6, 0.0)])


# ----------------------------------------------------------------------------- overlap
def test_bucketed_overlap_lies_between_none_and_the_ideal():
  comm = lambda m: 2 * m / 3.125e9  # noqa: E731 - a 25 GbE ring's bandwidth term, no latency
  grad, backward = 4e8, 0.2
  none = ov.exposed_s(comm, grad, backward, "none")[1]
  ideal = ov.exposed_s(comm, grad, backward, "backward")[1]
  for bucket in (1e6, 25 * 2 ** 20, 1e8):
    issued, exposed = ov.exposed_s(comm, grad, backward, "bucketed", bucket_bytes=bucket)
    assert issued == pytest.approx(comm(grad))  # no latency: the same bytes in pieces
    assert ideal <= exposed + 1e-12 and exposed <= none + 1e-12
  # buckets as large as the gradient: one message after backward, as without overlap
  assert ov.exposed_s(comm, grad, backward, "bucketed", bucket_bytes=grad)[1] == none
  # fine buckets on a uniform profile: the ideal plus at most the last bucket's reduction
  fine = ov.exposed_s(comm, grad, backward, "bucketed", bucket_bytes=grad / 1000)[1]
  assert ideal <= fine <= ideal + comm(grad / 1000) + 1e-12


def test_bucket_latency_is_paid_per_bucket():
  comm = lambda m: 1e-3 + m / 1e10  # noqa: E731
  issued, _ = ov.exposed_s(comm, 1e8, 0.0, "bucketed", bucket_bytes=1e7)
  assert issued == pytest.approx(10 * 1e-3 + 1e8 / 1e10)


def test_bert_gradients_are_ready_layer_by_layer_with_the_embeddings_last():
  cfg = bert_large()
  profile = ov.bert_profile(cfg, 512, 77)
  sizes, times = profile.ready_fractions()
  assert len(sizes) == 2 + cfg.layers and times[-2] == pytest.approx(1.0) and times[-1] == 1.0
  embeddings = (30522 + 512 + 2) * 1024 + 2 * 1024
  assert 1 - sizes[-2] == pytest.approx(embeddings / sum(p for p, _ in profile.segments))
  assert profile.ready_at(1.0) == 1.0 and profile.ready_at(sizes[0]) == times[0]
  # the encoder layers are equal: equal steps of time between their ends
  steps = [b - a for a, b in zip(times[1:-2], times[2:-1])]
  assert max(steps) == pytest.approx(min(steps))


def test_the_tied_embedding_bucket_cannot_hide():
  cfg = bert_large()
  profile = ov.bert_profile(cfg, 512, 77)
  comm = lambda m: m / 3.125e9  # noqa: E731
  grad = 4 * sum(p for p, _ in profile.segments)
  _, exposed = ov.exposed_s(comm, grad, 10.0, "bucketed", profile, 25 * 2 ** 20)
  embedding_bytes = grad * (1 - profile.ready_fractions()[0][-2])
  # a backward far longer than the reduction still leaves the embeddings' buckets exposed
  assert exposed >= comm(embedding_bytes) - comm(25 * 2 ** 20)


# ----------------------------------------------------------------------------- compute
def test_fixed_cost_is_paid_once_per_step_and_does_not_count_as_waiting():
  c = cm.compute(0.5, fixed=0.1)
  assert cm.step_s(c, 0.0, 4) == pytest.approx(0.1 + 4 * 0.4)
  assert cm.efficiency(c, 0.0, 4) == 1.0
  assert cm.efficiency(c, 0.2, 4) == pytest.approx(1.7 / 1.9)
  with pytest.raises(cm.ModelError, match="must be below the step time"):
    cm.compute(0.5, fixed=0.5)


def test_stragglers_wait_for_the_slowest_of_all_gpus():
  c = cm.compute(0.5, jitter=0.01)
  assert cm.straggler_s(c, 1, 4) == 0.0
  assert cm.expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=0.05)
  assert cm.expected_max_normal(1000) == pytest.approx(3.24, abs=0.03)  # tabulated 3.241
  waits = [cm.straggler_s(c, p, 1) for p in (2, 8, 64, 512)]
  assert waits == sorted(waits) and waits[0] > 0
  assert cm.straggler_s(c, 64, 4) == pytest.approx(2 * cm.straggler_s(c, 64, 1))


def test_step_time_follows_the_per_device_batch():
  curve = cm.step_curve([(4, 0.1 + 4 * 0.02), (8, 0.1 + 8 * 0.02), (16, 0.1 + 16 * 0.02)])
  assert curve.line() == pytest.approx((0.1, 0.02))
  assert curve.at(20) == pytest.approx(0.5)
  assert cm.step_curve([(10, 1.0)]).at(20) == pytest.approx(2.0)  # one point: proportional


def test_accumulation_can_differ_per_node_count():
  k = {1: 1, 16: 2, 64: 8}
  assert [cm.k_for(k, n) for n in (1, 2, 16, 32, 64, 1024)] == [1, 1, 2, 2, 8, 8]
  rows = cm.predict(cm.compute(0.129), BERT_BASE, cm.Cluster(net(25, 10)), nodes=(1, 16, 64),
                    overlaps=("none",), dtypes=("float32",), k=k, per_device_batch=8)["rows"]
  assert [(r["nodes"], r["k"], r["global_batch"]) for r in rows] == [
      (1, 1, 16), (16, 2, 512), (64, 8, 8192)]
  one, sixteen = rows[0], rows[1]
  assert sixteen["efficiency_vs_node"] == pytest.approx(
      (2 / sixteen["step_s"]) / (1 / one["step_s"]))


# ----------------------------------------------------------------------------- the command
def test_labels_say_exactly_what_was_given():
  out = tool("--params", "1000000", "--step-times", "8:0.2,16:0.36", "--per-device-batch",
             "8,12", "--network", "25gbe", "--nics", "2", "--bandwidth-gbit", "100",
             "--fixed-ms", "20", "--accum-steps", "1:1,4:2", "--nodes", "1,4", "--json")
  assert out.returncode == 0, out.stderr
  result = json.loads(out.stdout)
  given = "\n".join(result["given"])
  assert "rate 100 Gb/s (--bandwidth-gbit)" in given and "overridden" not in given
  assert "NICs per node: 2 (--nics)" in given and "2 x 100 Gb/s = 200 Gb/s per node" in given
  assert "fixed per-step cost: 20 ms (--fixed-ms)" in given and "jitter: 0 (not given)" in given
  assert "accumulation: 1+ nodes: k=1, 4+ nodes: k=2" in given
  assert [b["step_time_s"] for b in result["batches"]] == pytest.approx([0.2, 0.28])


@pytest.mark.parametrize("args,match", [
    (["--accum-steps", "1:0"], "accumulation steps '1:0': expected comma-separated pairs"),
    (["--step-times", "8:x"], "step times '8:x': expected comma-separated pairs"),
    (["--nics", "0"], "NICs per node '0': expected a positive integer"),
    (["--fixed-ms", "200"], "fixed per-step cost 0.2 s: must be below the step time 0.1 s"),
    (["--transport", "/nonexistent.jsonl"], "/nonexistent.jsonl: cannot read it .*of --transport"),
    (["--overlap", "sometimes"], "overlap 'sometimes': expected comma-separated one or more of none"),
])
def test_bad_new_values_are_one_line(args, match):
  import re

  assert re.search(match, one_error_line(tool("--step-time", "0.1", "--params", "1000", *args)))


# ----------------------------------------------------------------------------- validation
PUBLISHED = "benchmarks/published/multinode_tables.json"


def test_published_tables_are_predicted_within_15_percent_or_the_error_is_stated():
  from lmscale_jax.study.cluster_model import validation as v

  result = v.validate(PUBLISHED)
  rows = result["rows"]
  families = {next(p for p in v.SETUPS if r["source"].startswith(p)) for r in rows}
  assert len({f.split("-")[0] + f.split("-")[1] for f in families}) >= 3  # nvidia, tf, horovod
  ethernet = [r for r in rows if r["setup"]["network"].endswith(("10gbe", "25gbe"))]
  assert ethernet and any(r["nodes"] > 1 for r in ethernet)
  for r in rows:
    assert r["ratio"] == pytest.approx(r["predicted"] / r["published"])
    assert r["within_tolerance"] == (abs(r["ratio"] - 1) <= 0.15)
    assert r["within_tolerance"] or r["stated_error"].startswith(f"model {r['ratio'] - 1:+.0%}")
    if r.get("reference_nodes") == r["nodes"]:
      assert r["ratio"] == pytest.approx(1.0)  # the one node the model is given
  assert sum(r["within_tolerance"] for r in rows) >= 0.9 * len(rows)
  out = tool("--validate", PUBLISHED)
  assert out.returncode == 0 and "| horovod-docs-512gpu-vgg16 | 128 | 512 |" in out.stdout
  assert "not validated: horovod-docs-512gpu-resnet101" in out.stdout


def test_a_file_that_is_not_published_tables_is_one_line(tmp_path):
  bad = tmp_path / "t.json"
  bad.write_text("[1, 2]")
  assert f"--validate {bad}: not a published-tables file" in one_error_line(
      tool("--validate", str(bad)))


def test_step_times_come_from_a_sweep_file_of_one_model():
  sweep = "benchmarks/results/2026-12-01-cpu-sweep-models.jsonl"  # tiny/tiny at batch 4, 8, 16
  assert "rows of several models (tiny/tiny, tiny/wide): choose one with --sweep-model" in (
      one_error_line(tool("--step-times-from", sweep, "--params", "526574")))
  rows = [json.loads(x) for x in open(sweep)]
  points = [(r["batch"], r["step_time"]) for r in rows
            if r["model"] == "tiny/tiny" and r["status"] == "ok"]
  out = tool("--step-times-from", sweep, "--sweep-model", "tiny/tiny", "--params", "526574",
             "--per-device-batch", "4,16", "--nodes", "1,2", "--json")
  assert out.returncode == 0, out.stderr
  result = json.loads(out.stdout)
  curve = cm.step_curve(points)
  assert [b["step_time_s"] for b in result["batches"]] == pytest.approx(
      [curve.at(4), curve.at(16)])
  assert f"step time: line through {sweep}" in result["given"]


def test_fixed_cost_and_jitter_come_from_a_step_profile(tmp_path):
  profile = tmp_path / "profile.jsonl"
  profile.write_text(json.dumps({"bench": "step-profile", "kind": "fit", "fixed_s": 0.004,
                                 "jitter_s": 0.002, "batch_points": [[2, 0.01], [8, 0.031]]})
                     + "\n")
  out = tool("--step-profile", str(profile), "--params", "500000", "--per-device-batch", "4",
             "--nodes", "1,64", "--json")
  assert out.returncode == 0, out.stderr
  result = json.loads(out.stdout)
  part = result["batches"][0]
  assert (part["fixed_s"], part["jitter_s"]) == (0.004, 0.002)
  assert part["step_time_s"] == pytest.approx(0.017)  # the line through (2, 0.010), (8, 0.031)
  assert f"fixed per-step cost: 4 ms (--step-profile {profile})" in result["given"]
  wait = [r["straggler_s"] for r in part["rows"] if r["nodes"] == 64][0]
  assert wait == pytest.approx(0.002 * cm.expected_max_normal(128))
  profile.write_text('{"bench": "allreduce", "kind": "fit"}\n')
  assert "no step-profile fit row" in one_error_line(
      tool("--step-profile", str(profile), "--params", "9", "--per-device-batch", "4"))


def test_a_measured_transport_curve_is_read_from_bench_allreduce_output(tmp_path):
  measured = tmp_path / "allreduce.jsonl"
  row = {"bench": "allreduce", "kind": "transport-curve", "fit_of": "all", "heap": "keep",
         "date": "2026-12-05", "points": [[2e6, 0.5], [3.2e7, 0.9]]}
  measured.write_text(json.dumps({**row, "points": [[1e6, 0.1]]}) + "\n" + json.dumps(row) + "\n")
  curve = links.load_transport(str(measured))  # the last curve of the file
  assert curve.points == ((2e6, 0.5), (3.2e7, 0.9)) and curve.at(8e6) == pytest.approx(0.7)
  out = tool("--step-time", "0.1", "--params", "1000000", "--transport", str(measured),
             "--nodes", "1,4", "--algorithm", "tree", "--json")
  assert out.returncode == 0, out.stderr
  result = json.loads(out.stdout)
  assert f"transport: measured (allreduce.jsonl) (--transport {measured})" in result["given"]
  assert "all-reduce: tree" in result["given"]
  measured.write_text(json.dumps({**row, "heap": "default"}) + "\n")
  assert "no transport-curve row of a heap=keep run" in one_error_line(
      tool("--step-time", "0.1", "--params", "9", "--transport", str(measured)))
