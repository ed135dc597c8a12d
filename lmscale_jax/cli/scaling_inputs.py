"""``lmscale scaling-model``'s inputs: the flags for one GPU's compute and for the cluster,
checked, turned into the model's objects, each with a line saying where it came from (the
labels print exactly what was given; nothing is silently a default)."""

from __future__ import annotations

import argparse
import math
import os

from lmscale_jax.study.cluster_model import links, measured
from lmscale_jax.study.cluster_model import overlap as ov
from lmscale_jax.study.cluster_model import step_time as cm
from lmscale_jax.study.cluster_model.collectives import ALGORITHMS

PREDICTED_SHARE = 0.15  # masked positions per sequence for --config's head FLOPs (BERT's 15%)


# ----------------------------------------------------------------------------- flag types
def positive(what: str, kind=float):
  def parse(text: str):
    try:
      value = kind(text)
    except ValueError:
      value = None
    if value is None or not (math.isfinite(value) and value > 0):
      raise argparse.ArgumentTypeError(f"{what} {text!r}: expected a positive "
                                       f"{'integer' if kind is int else 'number'}")
    return value
  return parse


def non_negative(what: str, unit: str):
  def parse(text: str) -> float:
    try:
      value = float(text)
    except ValueError:
      value = -1.0
    if not (math.isfinite(value) and value >= 0):
      raise argparse.ArgumentTypeError(f"{what} {text!r}: expected a number >= 0 ({unit})")
    return value
  return parse


def csv(kind, allowed=None, what="value"):
  def parse(text: str):
    items = [x.strip() for x in text.split(",") if x.strip()]
    try:
      values = [kind(x) for x in items]
    except ValueError:
      values = []
    bad = [v for v in values if (allowed is not None and v not in allowed)
           or (kind is int and v < 1)]
    if not values or bad:
      expected = f"one or more of {', '.join(allowed)}" if allowed else "positive integers"
      raise argparse.ArgumentTypeError(f"{what} {text!r}: expected comma-separated {expected}")
    return values
  return parse


def pairs(text: str, what: str, example: str, value_kind) -> list[tuple[int, float]]:
  """``a:b,c:d`` -> [(a, b), (c, d)] with a positive integer a and a positive b."""
  out = []
  for item in (x.strip() for x in text.split(",") if x.strip()):
    left, _, right = item.partition(":")
    try:
      a, b = int(left), value_kind(right)
    except ValueError:
      a, b = 0, 0
    if a < 1 or not (math.isfinite(b) and b > 0):
      raise argparse.ArgumentTypeError(f"{what} {text!r}: expected comma-separated pairs "
                                       f"like {example}")
    out.append((a, b))
  if not out:
    raise argparse.ArgumentTypeError(f"{what} {text!r}: expected pairs like {example}")
  return out


def accumulation(text: str) -> dict[int, int]:
  """``4`` (every node count) or ``1:1,16:2`` (node count: k)."""
  if ":" not in text:
    return {1: positive("accumulation steps", int)(text)}
  return dict(pairs(text, "accumulation steps", "1:1,16:2,64:4", int))


def step_times(text: str) -> list[tuple[int, float]]:
  return pairs(text, "step times", "20:0.53,64:1.2 (batch:seconds)", float)


def network_preset(text: str) -> links.Link:
  try:
    return links.preset(text)
  except links.ModelError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


# ----------------------------------------------------------------------------- flags
def add_compute_flags(src) -> None:
  src.add_argument("--step-time", type=positive("step time"), metavar="S",
                   help="seconds of one training step on one GPU at --per-device-batch, no "
                   "communication")
  src.add_argument("--step-times", type=step_times, metavar="B:S,…",
                   help="step times at several per-device batches (a line through them gives "
                   "the step time at each --per-device-batch)")
  src.add_argument("--step-times-from", metavar="SWEEP.jsonl",
                   help="the same from a `lmscale sweep` results file (1-process rows)")
  src.add_argument("--sweep-model", default="", help="with --step-times-from: its model name")
  src.add_argument("--step-profile", metavar="FILE", help="fixed cost, jitter and step times "
                   "by batch from benchmarks/bench_step_profile.py")
  src.add_argument("--fixed-ms", type=non_negative("fixed per-step cost", "ms"), metavar="MS",
                   help="per-step cost that does not repeat under accumulation (optimizer "
                   "update, launch, host work), ms; part of the step time (default 0)")
  src.add_argument("--jitter-ms", type=non_negative("jitter", "ms"), metavar="MS",
                   help="standard deviation of one microbatch's time on one GPU, ms "
                   "(stragglers; default 0)")
  src.add_argument("--params", type=positive("parameter count", int), metavar="N",
                   help="gradient elements (the model's parameter count)")
  src.add_argument("--grad-mb", type=positive("gradient size"), metavar="MB",
                   help="float32 gradient size in MB (instead of --params)")
  src.add_argument("--config", metavar="configs/X.py", help="count the parameters of this "
                   "config's model, and take when its gradients are ready from its layers")
  src.add_argument("--vocab-size", type=positive("vocab size", int), default=8192,
                   help="with --config: the vocabulary (the configs take it from the dataset; "
                   "default 8192, lmscale prepare binary's)")
  src.add_argument("--seq-len", type=positive("seq len", int), default=512,
                   help="with --config, if the config leaves it to the dataset (default 512)")
  src.add_argument("--workdir", metavar="DIR", help="a run's workdir: step time from its "
                   "metrics.jsonl (median after the first window), the model from config.json")
  src.add_argument("--per-device-batch", type=csv(int, what="per-device batch"), default=[],
                   help="sequences per GPU per microbatch, one or several (with --step-times* "
                   "each gets its own step time)")


def add_cluster_flags(net) -> None:
  net.add_argument("--network", type=network_preset, default=None,
                   help=f"NIC preset: {', '.join(links.PRESETS)} (default 25gbe)")
  net.add_argument("--nics", type=positive("NICs per node", int), default=None,
                   help="network ports per node, each at the preset's rate (default 1)")
  net.add_argument("--bandwidth-gbit", type=positive("bandwidth"), metavar="GBIT_S",
                   help="one NIC's rate, Gbit/s per direction (replaces the preset's)")
  net.add_argument("--latency-us", type=non_negative("latency", "microseconds"), metavar="US",
                   help="network latency per message, microseconds (replaces the preset's)")
  net.add_argument("--transport", default=None, metavar="NAME|FILE",
                   help=f"transport efficiency by message size: {', '.join(links.TRANSPORTS)}, "
                   "or a benchmarks/bench_allreduce.py output (default: the preset's NCCL "
                   "transport)")
  net.add_argument("--calibration", metavar="FILE", help="use the α, β fitted by "
                   "benchmarks/bench_allreduce.py as the network link")
  net.add_argument("--calibration-fit", default="all",
                   help="which fit of that file: all (default) or a process count")
  net.add_argument("--gpus-per-node", type=positive("GPUs per node", int), default=2)
  net.add_argument("--intra-gbyte", type=positive("intra-node bandwidth"), metavar="GB_S",
                   default=None, help="intra-node link, GB/s per direction (default 300: the "
                   "NVLink bridge of two H100 NVL)")
  net.add_argument("--intra-latency-us", type=non_negative("intra-node latency", "microseconds"),
                   metavar="US", default=None)
  net.add_argument("--algorithm", "--scheme", dest="algorithm", choices=ALGORITHMS,
                   default="flat", help="flat ring over all GPUs (default), hierarchical ring, "
                   "tree (NCCL's double binary tree), in-network (switch reduction), best "
                   "(the faster of flat and tree per message)")


# ----------------------------------------------------------------------------- compute
def inputs(a) -> dict:
  """Step time(s), parameter count and gradient profile from the flags, with their sources."""
  sources = [x for x in ("params", "grad_mb", "config", "workdir") if getattr(a, x)]
  if len(sources) != 1:
    raise cm.ModelError("give exactly one of --params, --grad-mb, --config, --workdir "
                        f"(got {', '.join('--' + s.replace('_', '-') for s in sources) or 'none'})")
  out = model_inputs(a)
  out.update(step_inputs(a, out))
  return out


def model_inputs(a) -> dict:
  if a.workdir:
    got = measured.workdir_step(a.workdir)
    return {"params": got["params"], "profile": got["profile"], "workdir_step": got,
            "given": [f"model: {got['params']:,} parameters from {a.workdir}/config.json; "
                      f"gradients ready {got['profile'].name}"]}
  if a.config:
    params, profile = config_model(a.config, a.vocab_size, a.seq_len)
    return {"params": params, "profile": profile,
            "given": [f"model: {params:,} parameters from --config {a.config} (vocab "
                      f"{a.vocab_size}, seq {a.seq_len}); gradients ready {profile.name}"]}
  params = a.params or int(round(a.grad_mb * 1e6 / 4))
  flag = f"--params {a.params}" if a.params else f"--grad-mb {a.grad_mb:g}"
  return {"params": params, "profile": ov.UNIFORM,
          "given": [f"model: {params:,} parameters ({flag}); {ov.UNIFORM.name}"]}


def step_inputs(a, model: dict) -> dict:
  """The step time or curve, fixed cost and jitter, each from the first flag that gives it."""
  profile = measured.load_step_profile(a.step_profile) if a.step_profile else {}
  curve, where = step_curve(a, profile)
  step_time = a.step_time
  if curve is None and step_time is None and "workdir_step" in model:
    w = model["workdir_step"]
    step_time, where = w["step_time_s"], f"{a.workdir}'s metrics.jsonl ({w['windows']} windows)"
  if curve is None and step_time is None:
    raise cm.ModelError("--step-time is required with --params, --grad-mb or --config (or "
                        "give --step-times, --step-times-from, --step-profile or --workdir)")
  fixed = pick(a.fixed_ms, profile, "fixed_s", "--fixed-ms", a.step_profile)
  if fixed[1] == NOT_GIVEN and curve is not None:
    fixed = intercept(curve, where)
  jitter = pick(a.jitter_ms, profile, "jitter_s", "--jitter-ms", a.step_profile)
  return {"step_time": step_time, "curve": curve, "fixed": fixed[0], "jitter": jitter[0],
          "given": [f"step time: {where}", f"fixed per-step cost: {fixed[1]}",
                    f"jitter: {jitter[1]}"]}


def step_curve(a, profile: dict):
  if a.step_time is not None:
    return None, f"{a.step_time:g} s (--step-time)"
  if a.step_times:
    return cm.step_curve(a.step_times, "--step-times"), "line through --step-times"
  if a.step_times_from:
    points = measured.sweep_step_points(a.step_times_from, a.sweep_model)
    return cm.step_curve(points, a.step_times_from), f"line through {a.step_times_from}"
  if profile.get("batch_points"):
    return (cm.step_curve(profile["batch_points"], a.step_profile),
            f"line through {a.step_profile}'s batch points")
  return None, ""


NOT_GIVEN = "0 (not given)"


def pick(flag_ms, profile: dict, key: str, flag: str, path) -> tuple[float, str]:
  if flag_ms is not None:
    return flag_ms / 1e3, f"{flag_ms:g} ms ({flag})"
  if key in profile:
    return max(0.0, float(profile[key])), f"{profile[key] * 1e3:.3g} ms (--step-profile {path})"
  return 0.0, NOT_GIVEN


def intercept(curve: cm.StepCurve, where: str) -> tuple[float, str]:
  """The fixed per-step cost as the least-squares intercept of step time against batch (what
  does not grow with the batch), for step times measured in any framework; 0 where the
  batches do not show one (one batch, a line that does not rise or meets 0 above batch 0)."""
  t0 = curve.intercept()
  if t0 is None:
    return 0.0, f"{NOT_GIVEN}; step times at two or more batches give it (the intercept)"
  if t0 <= 0 or curve.line()[1] <= 0:
    return 0.0, (f"0 (the intercept of the {where} is {t0 * 1e3:.3g} ms: no fixed part to "
                 "see; --fixed-ms gives one)")
  return t0, (f"{t0 * 1e3:.3g} ms, the intercept of the {where} (its step time at batch 0; "
              "--fixed-ms replaces it)")


def batch_warnings(given: dict, batches: list[int]) -> list[str]:
  """What a table takes that was not measured: one step time serving several batches, or a
  line's step time at a batch outside the measured ones (one line each)."""
  curve, source = given["curve"], given["given"][0].removeprefix("step time: ")
  if curve is None:
    if len(batches) < 2:
      return []
    return [f"one step time, {source}, serves every --per-device-batch "
            f"({', '.join(map(str, batches))}): each table takes the same step time; give "
            "--step-times B:S,… for one per batch"]
  outside = [b for b in batches if curve.extrapolates(b)]
  if not outside:
    return []
  lo, hi = curve.measured()
  times = ", ".join(f"{curve.at(b):.4g} s" for b in outside)
  head = f"--per-device-batch {', '.join(map(str, outside))}: "
  if lo == hi:
    return [head + f"only batch {lo} was measured ({source}): the step time is taken as "
            f"proportional to the batch ({times}); measure two or more batches"]
  return [head + f"outside the measured batches {lo}–{hi} ({source}): step times "
          f"extrapolated along the line ({times})"]


def compute_at(given: dict, batch: int) -> cm.Compute:
  """The compute of one GPU at ``batch`` (the step time itself when no curve was given)."""
  t = given["step_time"]
  if given["curve"] is not None:
    if not batch:
      raise cm.ModelError("step times by batch need --per-device-batch (which batch to model)")
    t = given["curve"].at(batch)
  return cm.compute(t, given["fixed"], given["jitter"], given["profile"])


def config_model(path: str, vocab_size: int, seq_len: int):
  """(parameter count, gradient profile) of a config file's model (or a shipped config's:
  ``config.loader``, whose one line names a file that does not load)."""
  from lmscale_jax.config import loader
  from lmscale_jax.model import flops

  model = loader.load(path).model
  model.vocab_size = model.vocab_size or vocab_size
  model.seq_len = model.seq_len or seq_len
  predictions = max(1, round(PREDICTED_SHARE * model.seq_len))
  return (flops.count_params_from_config(model),
          ov.bert_profile(model, model.seq_len, predictions))


# ----------------------------------------------------------------------------- cluster
def cluster(a) -> tuple[cm.Cluster, list[str]]:
  nic, given = nic_link(a)
  nics = a.nics or 1
  given.append(f"NICs per node: {nics} ({'--nics' if a.nics else 'default'})")
  transport, how = transport_curve(a, nic)
  net = links.network(nic, nics, transport)
  intra = links.NVLINK_BRIDGE
  if a.intra_gbyte is not None or a.intra_latency_us is not None:
    intra = links.link("intra-node (--intra-*)",
                       (a.intra_gbyte or intra.bandwidth / 1e9) * 1e9,
                       (a.intra_latency_us if a.intra_latency_us is not None
                        else intra.latency * 1e6) * 1e-6)
  given += [f"transport: {how}", f"network: {net.describe()}",
            f"intra-node: {intra.describe()}, {a.gpus_per_node} GPU(s) per node",
            f"all-reduce: {a.algorithm}"]
  return cm.Cluster(net, intra, a.gpus_per_node, a.algorithm), given


def nic_link(a) -> tuple[links.Link, list[str]]:
  if a.calibration:
    nic = measured.load_calibration(a.calibration, a.calibration_fit)
    how = [f"NIC: the α–β fit of --calibration {a.calibration} (fit of {a.calibration_fit})"]
  else:
    nic = a.network or links.PRESETS["25gbe"]
    how = [f"NIC: {nic.describe()} (preset {'--network' if a.network else 'default'})"]
  if a.bandwidth_gbit or a.latency_us is not None:
    nic = links.link(nic.name, a.bandwidth_gbit * 1e9 / 8 if a.bandwidth_gbit else nic.bandwidth,
                     a.latency_us * 1e-6 if a.latency_us is not None else nic.latency)
    how.append("replaced: " + ", ".join(
        x for x in (a.bandwidth_gbit and f"rate {a.bandwidth_gbit:g} Gb/s (--bandwidth-gbit)",
                    a.latency_us is not None and f"latency {a.latency_us:g} us (--latency-us)")
        if x))
  return nic, how


def transport_curve(a, nic: links.Link) -> tuple[links.TransportCurve, str]:
  if a.transport is None:
    if a.calibration:
      return links.LINE_RATE, "line rate (the calibration's fit is already the transport's)"
    curve = links.default_transport(nic)
    return curve, f"{curve.name}, the default for {nic.name} ({curve.source})"
  if a.transport in links.TRANSPORTS:
    curve = links.TRANSPORTS[a.transport]
    return curve, f"{curve.name} (--transport; {curve.source})"
  if not os.path.exists(a.transport) and not any(c in a.transport for c in "/."):  # a name
    raise cm.ModelError(f"--transport {a.transport}: neither a transport ("
                        f"{', '.join(links.TRANSPORTS)}) nor a file; give one of those names, "
                        "or the output of benchmarks/bench_allreduce.py")
  curve = links.load_transport(a.transport)
  return curve, f"{curve.name} (--transport {a.transport})"


def run_given(a) -> list[str]:
  k = a.accum_steps
  return [f"accumulation: {', '.join(f'{n}+ nodes: k={v}' for n, v in sorted(k.items()))}"
          if len(k) > 1 else f"accumulation: k={k[next(iter(k))]}",
          f"buckets: {a.bucket_mib:g} MiB (--overlap bucketed)"]
