"""The cluster model against published multi-node tables it was not fitted to
(``benchmarks/published/multinode_tables.json``; ``lmscale scaling-model --validate FILE``).

What the model is given for each table, as a user would measure it: **one node's** published
throughput (the step time of one GPU follows from it: ``t = g·k₁·b / throughput₁`` less the
intra-node reduction), the gradient (the source's parameter count × 4 bytes: float32/TF32
columns only), and the cluster the source or its hardware's documentation states
(:data:`SETUPS`, every value with its reason). It then predicts every other row's throughput.
Where a source states only an efficiency (Horovod), one GPU's step comes from another
published table of the same GPU and model (named), and the predicted efficiency is compared.
Unknown for every published system, so left at 0: the fixed per-step cost and the jitter.

Each row: published, predicted, ratio = predicted / published; rows outside ±15% say so.
"""

from __future__ import annotations

import dataclasses
import json

from lmscale_jax.study.cluster_model import links
from lmscale_jax.study.cluster_model import step_time as cm
from lmscale_jax.study.cluster_model.links import ModelError

TOLERANCE = 0.15
_PCIE3 = links.Link("PCIe 3.0 x16", 12e9, 5e-6)  # 15.75 GB/s line; ~12 GB/s reached (stated)


@dataclasses.dataclass(frozen=True)
class Setup:
  """The cluster of a family of published tables, with why each value is what it is."""
  preset: str
  intra: links.Link
  algorithm: str
  overlap: str
  bucket_mib: float = 25.0
  reason: str = ""
  compute_from: tuple[str, float, int] | None = None  # (where, images/s, batch) of one GPU
  limits: str = ""  # what this setup cannot express: the stated error where it exceeds 15%


SETUPS = {
    "nvidia-dle-tf-bert-dgx2h": Setup(
        "edr", links.Link("NVSwitch (V100: 6 NVLink2 x 25 GB/s)", 150e9, 2e-6), "best",
        "none", reason="Horovod all-reduces the accumulated gradient once per step, after "
        "the last microbatch (no overlap); NCCL >= 2.4 chooses ring or tree"),
    "nvidia-dle-tf-bert-dgxa100": Setup(
        "hdr", links.Link("NVSwitch (A100: 12 NVLink3 x 25 GB/s)", 300e9, 2e-6), "best",
        "none", reason="as on DGX-2H"),
    "nvidia-dle-paddle-bert-dgxa100": Setup(
        "hdr", links.Link("NVSwitch (A100: 12 NVLink3 x 25 GB/s)", 300e9, 2e-6), "best",
        "none", reason="Paddle Fleet all-reduces the accumulated gradient once per step"),
    "tf-benchmarks-aws-p2": Setup(
        "10gbe", _PCIE3, "hierarchical", "backward",
        reason="distributed_replicated: GPUs aggregate on the instance, then each instance "
        "exchanges 2(N-1)/N of the gradient with the co-located parameter servers (the "
        "bytes of a ring between nodes), over gRPC/TCP (NCCL's socket curve stands in); "
        "each tensor is sent as soon as backward makes it (the ideal overlap bound)",
        limits="at 64 GPUs the source ran fewer parameter servers than instances (6 of 8 for "
        "Inception V3 b64, 4 of 8 for ResNet-152 and ResNet-50 b32): those servers carry "
        "more than a ring's 2(N-1)/N of the gradient, which the model cannot express, so it "
        "overestimates throughput there"),
    "horovod-docs-512gpu-inceptionv3": Setup(
        "25gbe", _PCIE3, "flat", "bucketed", 64.0,
        reason="Horovod + NCCL ring over all GPUs, Tensor Fusion's 64 MB buffer "
        "overlapping backward; 4 Pascal GPUs per server on PCIe (not stated)",
        compute_from=("tensorflow/docs site/en/r1/guide/performance/benchmarks.md @62da04c, "
                      "DGX-1 P100, synthetic, 1 GPU, batch 64 (Horovod's own command uses "
                      "--batch_size 64; its GPU model is not stated)", 142.0, 64)),
    "horovod-docs-512gpu-vgg16": Setup(
        "25gbe", _PCIE3, "flat", "bucketed", 64.0, reason="as Inception V3",
        compute_from=("tensorflow/docs site/en/r1/guide/performance/benchmarks.md @62da04c, "
                      "DGX-1 P100, synthetic, 1 GPU, batch 64", 154.0, 64)),
}
SKIPPED_COLUMNS = ("-amp",)  # mixed precision: the gradient dtype of the all-reduce is unstated


def setup_for(source_id: str) -> Setup | None:
  return next((s for prefix, s in SETUPS.items() if source_id.startswith(prefix)), None)


def load(path: str) -> list[dict]:
  try:
    with open(path) as f:
      data = json.load(f)
    return list(data["sources"])
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ModelError(f"--validate {path}: not a published-tables file with 'sources' "
                     f"({type(e).__name__}: {e})") from None


def params_of(source: dict) -> int:
  p = source["setting"]["params"]
  return int(p["value"] if isinstance(p, dict) else p)


def cluster_of(source: dict, setup: Setup, line_rate: bool = False) -> cm.Cluster:
  s = source["setting"]
  nic = links.preset(setup.preset)
  transport = links.LINE_RATE if line_rate else links.default_transport(nic)
  net = links.network(nic, int(s.get("nics_per_node") or 1), transport)
  return cm.Cluster(net, setup.intra, int(s["gpus_per_node"]), setup.algorithm)


def micro_batch(source: dict, r: dict) -> float:
  b = source["setting"].get("per_gpu_batch")
  return float(b) if b else r["global_batch"] / (r["gpus"] * r.get("accumulation", 1))


def validate_source(source: dict) -> list[dict]:
  """Predicted vs published rows of one source ([] when it is not validated, with why)."""
  setup = setup_for(source["id"])
  if setup is None or source["id"].endswith(SKIPPED_COLUMNS):
    return []
  if setup.compute_from:
    return efficiency_rows(source, setup)
  return throughput_rows(source, setup)


def node_rows(source: dict) -> list[dict]:
  g = int(source["setting"]["gpus_per_node"])
  return [r for r in source["rows"] if r["gpus"] == r["nodes"] * g and r.get("throughput")]


def throughput_rows(source: dict, setup: Setup) -> list[dict]:
  rows = node_rows(source)
  one = min(rows, key=lambda r: r["nodes"])
  models = [model_for(source, setup, one, line_rate) for line_rate in (False, True)]
  out = []
  for r in rows:
    predicted, at_line_rate = (predicted_throughput(source, setup, r, *m) for m in models)
    out.append(result(source, setup, r, "throughput", r["throughput"], predicted,
                      reference_nodes=one["nodes"],
                      ratio_at_line_rate=at_line_rate / r["throughput"]))
  return out


def model_for(source: dict, setup: Setup, one: dict, line_rate: bool):
  """(one GPU's compute, the cluster) the model is given for a table: once per table."""
  cluster = cluster_of(source, setup, line_rate)
  return one_gpu(source, setup, cluster, params_of(source), one), cluster


def predicted_throughput(source: dict, setup: Setup, r: dict, c: cm.Compute,
                         cluster: cm.Cluster) -> float:
  k = int(r.get("accumulation", 1))
  pred = cm.predict(c, params_of(source), cluster, nodes=(r["nodes"],), dtypes=("float32",),
                    overlaps=(setup.overlap,), k=k, bucket_bytes=setup.bucket_mib * 2 ** 20)
  return r["gpus"] * k * micro_batch(source, r) / pred["rows"][0]["step_s"]


def one_gpu(source: dict, setup: Setup, cluster: cm.Cluster, params: int, one: dict
            ) -> cm.Compute:
  """One GPU's microbatch time from the smallest node count's published throughput: that
  row's step less its (intra-node) reduction, which the model adds back."""
  k = int(one.get("accumulation", 1))
  b = micro_batch(source, one)
  step = one["gpus"] * k * b / one["throughput"]
  comm = cm.reduction(cm.compute(step / k), cluster, params * 4, one["nodes"], setup.overlap,
                      setup.bucket_mib * 2 ** 20)[1]
  return cm.compute((step - comm) / k)


def efficiency_rows(source: dict, setup: Setup) -> list[dict]:
  where, per_s, batch = setup.compute_from
  c = cm.compute(batch / per_s)
  params = params_of(source)
  out = []
  for r in source["rows"]:
    predicted, at_line_rate = (cm.predict(
        c, params, cluster_of(source, setup, line_rate), nodes=(r["nodes"],),
        dtypes=("float32",), overlaps=(setup.overlap,),
        bucket_bytes=setup.bucket_mib * 2 ** 20)["rows"][0]["efficiency"]
        for line_rate in (False, True))
    out.append(result(source, setup, r, "efficiency vs 1 GPU", r["efficiency_stated"],
                      predicted, compute_from=where,
                      ratio_at_line_rate=at_line_rate / r["efficiency_stated"]))
  return out


def result(source, setup, r, what, published, predicted, **extra) -> dict:
  ratio = predicted / published
  inside = abs(ratio - 1) <= TOLERANCE
  return {"source": source["id"], "where": source["where"], "nodes": r["nodes"],
          "gpus": r["gpus"], "k": int(r.get("accumulation", 1)), "what": what,
          "published": published, "predicted": predicted, "ratio": ratio,
          "within_tolerance": inside,
          "stated_error": None if inside else f"model {ratio - 1:+.0%}: {setup.limits}",
          "setup": {"network": f"{source['setting'].get('nics_per_node') or 1} x "
                    f"{setup.preset}", "algorithm": setup.algorithm, "overlap": setup.overlap,
                    "bucket_mib": setup.bucket_mib, "intra": setup.intra.name,
                    "reason": setup.reason}, **extra}


def validate(path: str) -> dict:
  """Every validated row of the file, and the sources left out with the reason."""
  sources = load(path)
  rows, skipped = [], []
  for source in sources:
    got = validate_source(source)
    rows += got
    if not got:
      skipped.append({"source": source["id"], "why": skip_reason(source)})
  return {"file": path, "tolerance": TOLERANCE, "rows": rows, "skipped": skipped}


def skip_reason(source: dict) -> str:
  if source["id"].endswith(SKIPPED_COLUMNS):
    return "mixed precision: the all-reduce's gradient dtype is not stated"
  if setup_for(source["id"]) is None:
    return "no stated per-GPU compute for this model (no table of its single-GPU throughput)"
  return "no rows with throughput"
