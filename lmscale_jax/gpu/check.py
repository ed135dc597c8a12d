"""The GPU self-check behind ``lmscale gpu-check``: is this install right, and is it fast?

What it reports (:func:`run` → one JSON-able dict; every value that could not be had is
``None`` with its reason under ``reasons``):

* ``devices``: what JAX runs on (id, kind, platform, memory), the backend (:mod:`gpu_env`);
* ``versions``: Python, jax/jaxlib, the CUDA plugin, the NVIDIA driver
  (``/proc/driver/nvidia/version`` or ``nvidia-smi``), the CUDA runtime and driver API, cuDNN
  (as JAX's CUDA plugin loaded them), NCCL (the pip wheel JAX loads);
* ``attention``: cuDNN attention against XLA attention (``model.dot_product_attention``, the
  model's own paths) on the same bf16 inputs with trailing padding of several lengths and,
  where the model has them, segment masks; output and gradients, within bf16 tolerance.
  Without a GPU the model's explicit-softmax path stands in for cuDNN, so the comparison code
  still runs (``candidate`` says which);
* ``steps``: the config's real training step (``mlm.build_steps``, timed by
  ``autotune.time_steps``) on synthetic padded, MLM-masked batches at a small and at the
  default per-device batch: samples/s, MFU (useful FLOPs, ``flops.py``, over the device peak
  table or ``metrics.peak_tflops``), the allocator's peak memory;
* ``allreduce``: with more than one local device, a ``psum`` of the gradient's size over all
  of them: time, algorithm and bus bandwidth (nccl-tests' convention, the input the scaling
  model needs for intra-node links);
* ``result``: "PASS" or "FAIL" and ``reason``.
"""

from __future__ import annotations

import copy
import datetime
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from lmscale_jax.config import modes
from lmscale_jax.gpu import env as gpu_env
from lmscale_jax.input import autotune, masking
from lmscale_jax.model import bert as model_lib
from lmscale_jax.model import flops as flops_lib
from lmscale_jax.store import dataset
from lmscale_jax.pretrain import trainer
from lmscale_jax.train import manual_grads, sharding
from lmscale_jax.pretrain import mlm

# Largest |candidate - reference| over the largest |reference|, per tensor: ~5 bf16 ulps
# (2^-8 each) at the largest magnitude; the fused kernels reorder the bf16 sums.
ATTENTION_TOLERANCE = 2e-2


# --------------------------------------------------------------------------- attention
PAD_ID = dataset.SPECIAL_TOKENS.index("[PAD]")
CLS_ID = dataset.SPECIAL_TOKENS.index("[CLS]")


def attention_inputs(model_cfg, batch: int = 4, seed: int = 0):
  """bf16 q, k, v, cotangent [B,S,N,D] at the model's head shape, and token ids [B,S] whose
  rows hold 3 [CLS]-started segments then trailing padding, lengths S, ~3S/4, ~S/2 and 7 (a
  nearly empty row): the layout of packed prepared datasets."""
  s, n = model_cfg.seq_len, model_cfg.heads
  d = model_cfg.hidden // n
  keys = jax.random.split(jax.random.key(seed), 4)
  tensors = tuple(jax.random.normal(key, (batch, s, n, d), jnp.bfloat16) for key in keys)
  lengths = np.clip([s, 3 * s // 4 + 1, s // 2 - 5, 7][:batch] + [s] * max(0, batch - 4), 1, s)
  ids = np.full((batch, s), CLS_ID + 8, np.int32)  # any non-special id
  for row, length in enumerate(lengths):
    ids[row, [0, length // 3, 2 * length // 3]] = CLS_ID
    ids[row, length:] = PAD_ID
  return tensors, jnp.asarray(ids)


def _relative_error(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-6))


def compare_attention(fn_candidate, fn_reference, q, k, v, cot) -> dict:
  """Output and q/k/v gradients (for cotangent ``cot``) of two attention functions
  ``(q, k, v) -> out``: the relative error of each against the reference."""
  def fwd_bwd(fn):
    def both(q, k, v, cot):  # arguments, not captured constants of the compiled program
      out, vjp = jax.vjp(fn, q, k, v)
      return (out, *vjp(cot))
    return jax.jit(both)(q, k, v, cot)

  got, want = fwd_bwd(fn_candidate), fwd_bwd(fn_reference)
  errors = {name: _relative_error(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), got,
                                                               want)}
  return {"relative_error": errors, "max_relative_error": max(errors.values()),
          "tolerance": ATTENTION_TOLERANCE,
          "ok": all(np.isfinite(e) and e <= ATTENTION_TOLERANCE for e in errors.values())}


def has_segment_masks() -> bool:
  """Whether ``model.dot_product_attention`` takes per-segment masks (packed functions)."""
  import inspect

  return hasattr(model_lib, "segment_ids") and (
      "segments" in inspect.signature(model_lib.dot_product_attention).parameters)


def attention_cases(ids, gpu: bool) -> dict:
  """name → (candidate fn, reference fn, required): every mask training uses, each on the
  fast path against XLA. ``required`` False marks opt-in paths (Pallas): reported, not a FAIL.

  Segment masks (several functions packed in a row, each attending only to itself) are
  compared whenever the model has them (:func:`has_segment_masks`); a new mask or path of
  ``model.dot_product_attention`` gets its case here.
  """
  attend = model_lib.dot_product_attention
  key_mask = ids != PAD_ID
  xla = lambda q, k, v: attend(q, k, v, key_mask, impl="xla")
  if not gpu:  # the model's explicit softmax path stands in for the GPU kernels
    cases = {"padding": (lambda q, k, v: attend(q, k, v, key_mask, impl="explicit"), xla, True)}
  else:
    cases = {f"cudnn/padding/{m}": (lambda q, k, v, m=m: attend(
        q, k, v, key_mask, impl="cudnn", cudnn_mask=m), xla, True) for m in model_lib.CUDNN_MASKS}
  if not has_segment_masks():
    return cases
  segments = model_lib.segment_ids(ids, CLS_ID, PAD_ID)
  by_segment = lambda impl, seg: (lambda q, k, v: attend(q, k, v, key_mask, impl=impl,
                                                         segments=seg))
  if not gpu:
    cases["segments"] = (by_segment("explicit", segments), by_segment("xla", segments), True)
    return cases
  cases["cudnn/segments"] = (by_segment("cudnn", segments), by_segment("xla", segments), True)
  if "pallas" in modes.ATTENTION_IMPLS:
    # Pallas treats padding as a segment of its own ([PAD] attends to [PAD]): compared with
    # XLA under that same mask.
    pad_as_segment = key_mask.astype(jnp.int32)
    cases["pallas/padding"] = (lambda q, k, v: attend(q, k, v, key_mask, impl="pallas"),
                               by_segment("xla", pad_as_segment), False)
    cases["pallas/segments"] = (by_segment("pallas", segments), by_segment("xla", segments),
                                False)
  return cases


def check_attention(model_cfg, gpu: bool) -> dict:
  (q, k, v, cot), ids = attention_inputs(model_cfg)
  report = {"candidate": "cudnn" if gpu else "explicit", "reference": "xla",
            "shape": list(q.shape), "key_lengths": [int(x) for x in np.asarray(
                (ids != PAD_ID).sum(-1))], "segments_per_row": 3, "cases": {}}
  if not gpu:
    report["note"] = "no GPU: the model's explicit softmax path stands in for cuDNN"
  if not has_segment_masks():
    report["segments_reason"] = "model.dot_product_attention has no segment masks"
  for name, (fn, ref, required) in attention_cases(ids, gpu).items():
    try:
      case = compare_attention(fn, ref, q, k, v, cot)
    except Exception as e:  # e.g. cuDNN missing or refusing the shape: a FAIL, with its words
      case = {"ok": False, "error": gpu_env.one_line(e)}
    report["cases"][name] = {**case, "required": required}
  report["ok"] = all(c["ok"] for c in report["cases"].values() if c["required"])
  return report


# --------------------------------------------------------------------------- steps
def synthetic_batch(meta: dataset.DatasetMeta, config, rows: int, seed: int = 0) -> dict:
  """``rows`` sequences ``[CLS] random ids [SEP] [PAD]…`` with lengths from S/2 to S,
  masked by the loader's own masker (so the step sees padding, as on real data)."""
  rng = np.random.default_rng(seed)
  s, ids = meta.seq_len, meta.special_ids
  first = len(ids)
  x = rng.integers(first, meta.vocab_size, (rows, s), dtype=np.int64)
  lengths = rng.integers(s // 2, s + 1, rows)
  x[:, 0] = ids["[CLS]"]
  x[np.arange(rows), lengths - 1] = ids["[SEP]"]
  x[np.arange(s)[None, :] >= lengths[:, None]] = ids["[PAD]"]
  masker = masking.Masker(ids, meta.vocab_size, config.data.mask_prob,
                          config.data.max_predictions, s)
  return masker.with_generator(x.astype(np.uint16), rng)


def measure_step(config, meta, per_device_batch: int, n: int) -> dict:
  """The config's compiled training step at ``per_device_batch`` sequences per device."""
  c = copy.deepcopy(config)
  devices = jax.device_count()
  c.train.batch_size = per_device_batch * devices
  row = {"batch_per_device": per_device_batch, "global_batch": c.train.batch_size,
         "seq": meta.seq_len}
  try:
    s = trainer.build_setup(c, meta)
    st = mlm.build_steps(c, s.model_cfg, s.predictions)
    host = synthetic_batch(meta, c, c.train.batch_size)
    t0 = time.perf_counter()
    step_s = autotune.time_steps(st, host, int(c.train.seed), n=n)
    first_s = time.perf_counter() - t0 - n * step_s
  except Exception as e:
    oom = "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()
    why = (f"out of memory at {per_device_batch} sequences per device (try --batch, "
           "train.remat=dots or train.grad_accum_steps; lmscale max-batch)" if oom else "")
    return {**row, "ok": False, "error": why or gpu_env.one_line(e)}
  kind = jax.devices()[0].device_kind
  peak = flops_lib.device_peak_flops(kind, float(c.metrics.peak_tflops), dtype=s.model_cfg.dtype)
  achieved = s.flops_per_step / step_s
  stats = jax.devices()[0].memory_stats() or {}
  peak_mem = stats.get("peak_bytes_in_use")
  row.update({
      "ok": True, "dtype": s.model_cfg.dtype, "steps_timed": n, "step_s": step_s,
      "compile_and_first_step_s": first_s, "samples_per_sec": c.train.batch_size / step_s,
      "tokens_per_sec": c.train.batch_size * meta.seq_len / step_s,
      "model_tflops_per_device": achieved / devices / 1e12,
      "peak_tflops": None if peak is None else peak / 1e12,
      "mfu": None if peak is None else achieved / (peak * devices),
      "attention": model_lib.attention_impl(s.model_cfg, deterministic=False),
      "peak_mem_gb": None if peak_mem is None else peak_mem / 2**30,
      "params": s.param_count})
  if peak is None:
    row["mfu_reason"] = (f"no peak for device kind {kind!r} in flops.DEVICE_PEAK_TFLOPS; "
                         "set --set metrics.peak_tflops=T")
  if peak_mem is None:
    row["peak_mem_reason"] = f"the {jax.default_backend()} backend reports no memory stats"
  return row


# --------------------------------------------------------------------------- all-reduce
def measure_allreduce(num_floats: int, dtype=jnp.float32, repeats: int = 10) -> dict:
  """``psum`` of ``num_floats`` elements (the gradient) over every local device: median time
  of ``repeats`` after a warm-up; bus bandwidth = algbw · 2(n-1)/n (nccl-tests' convention:
  the bytes each link carries in a ring all-reduce)."""
  devices = jax.local_devices()
  n = len(devices)
  mesh = sharding.data_mesh(devices)
  spec = jax.sharding.PartitionSpec(sharding.AXIS)
  x = jax.jit(lambda: jnp.ones((n, num_floats), dtype),
              out_shardings=jax.sharding.NamedSharding(mesh, spec))()
  reduce = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, sharding.AXIS), mesh=mesh,
                                 in_specs=spec, out_specs=spec))
  out = reduce(x).block_until_ready()
  if not np.allclose(np.asarray(out[0, :8], np.float32), n):  # every device added its ones
    return {"ok": False, "error": f"psum over {n} devices returned {np.asarray(out[0, :8])}"}
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    reduce(x).block_until_ready()
    times.append(time.perf_counter() - t0)
  t = float(np.median(times))
  nbytes = num_floats * jnp.dtype(dtype).itemsize
  algbw = nbytes / t / 1e9
  return {"ok": True, "devices": n, "bytes": nbytes, "dtype": jnp.dtype(dtype).name,
          "seconds": t, "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (n - 1) / n,
          "repeats": repeats}


# --------------------------------------------------------------------------- the check
def _verdict(report: dict, gpu: bool, allow_cpu: bool) -> tuple[str, str]:
  if not gpu and not allow_cpu:
    return "FAIL", f"no GPU: {report['reasons']['devices']}"
  problems = []
  notes = []
  for name, case in report["attention"]["cases"].items():
    if not case["ok"]:
      (problems if case["required"] else notes).append(f"attention {name}: " + case.get(
          "error", f"differs from xla by {case['max_relative_error']:.3g} "
                   f"(> {case['tolerance']})"))
  for row in report["steps"]:
    if not row["ok"]:
      problems.append(f"step at batch {row['batch_per_device']}/device: {row['error']}")
  ar = report["allreduce"]
  if ar is not None and not ar["ok"]:
    problems.append(f"all-reduce: {ar['error']}")
  if problems:
    return "FAIL", "; ".join(problems)
  best = report["steps"][-1]  # the default per-device batch (the largest measured)
  mfu = "MFU unknown" if best["mfu"] is None else f"MFU {best['mfu']:.1%}"
  where = (f"{report['device_count']} x {report['device_kind']}" if gpu
           else "CPU (--allow-cpu: no GPU was checked)")
  note = f" (opt-in paths: {'; '.join(notes)})" if notes else ""
  return "PASS", (f"{where}: attention within bf16 tolerance, "
                  f"{best['samples_per_sec']:.1f} samples/s at {best['batch_per_device']}/device,"
                  f" {mfu}{note}")


def run(config, *, seq_len: int, vocab_size: int, small_batch: int, batch: int,
        allow_cpu: bool, steps_small: int = 10, steps_default: int = 5, log=print) -> dict:
  """The whole check (see the module docstring). ``batch`` 0 = the config's
  ``train.batch_size`` over the local devices; the model runs in bfloat16 unless ``config``
  says otherwise after the caller's overrides."""
  devices, why = gpu_env.gpu_devices()
  gpu = bool(devices)
  report = {"date": datetime.date.today().isoformat(), "host": platform.node(),
            "backend": jax.default_backend() if gpu or allow_cpu else None, "gpu": gpu,
            "reasons": {}}
  if not gpu:
    report["reasons"]["devices"] = why
  shown = devices or (jax.devices() if allow_cpu else [])
  report["devices"] = gpu_env.describe_devices(shown)
  report["device_count"] = len(shown)
  report["device_kind"] = shown[0].device_kind if shown else None
  report["versions"], reasons = gpu_env.versions(gpu)
  report["reasons"].update({f"versions.{k}": v for k, v in reasons.items()})
  log("devices: " + (f"{len(shown)} x {report['device_kind']} ({report['backend']})" if shown
                     else "none (no GPU)") + "; " + ", ".join(
          f"{k} {v}" for k, v in report["versions"].items() if v is not None))
  if not gpu and not allow_cpu:
    for key in ("attention", "steps", "allreduce"):
      report[key] = None
      report["reasons"][key] = gpu_env.NO_GPU
    report["result"], report["reason"] = _verdict(report, gpu, allow_cpu)
    return report

  meta = dataset.DatasetMeta.synthetic(seq_len, vocab_size)
  config = copy.deepcopy(config)
  config.model.vocab_size = config.model.seq_len = 0  # from the synthetic metadata
  model_cfg = model_lib.resolve_model_config(config.model, meta, remat=config.train.remat)
  report["attention"] = check_attention(model_cfg, gpu)
  log(f"attention ({report['attention']['candidate']} vs xla): " + ", ".join(
      f"{n}: " + (f"max relative error {c['max_relative_error']:.2e}" if "error" not in c
                  else c["error"]) for n, c in report["attention"]["cases"].items()))

  default = batch or max(1, config.train.batch_size // jax.device_count())
  report["steps"] = []
  sizes = {min(small_batch, default): steps_small}
  sizes.setdefault(default, steps_default)
  for per_device, n in sorted(sizes.items()):
    row = measure_step(config, meta, per_device, n)
    report["steps"].append(row)
    log(f"step at {per_device}/device: " + (
        f"{row['samples_per_sec']:.1f} samples/s, {row['step_s'] * 1e3:.1f} ms, MFU "
        f"{'-' if row['mfu'] is None else format(row['mfu'], '.1%')}" if row["ok"]
        else row["error"]))

  if jax.local_device_count() > 1:
    grads = flops_lib.count_params_from_config(model_cfg)
    dtype = manual_grads.REDUCE_DTYPES[config.train.grad_allreduce_dtype]
    try:
      report["allreduce"] = measure_allreduce(grads, dtype)
    except Exception as e:
      report["allreduce"] = {"ok": False, "error": gpu_env.one_line(e)}
    if report["allreduce"]["ok"]:
      log(f"all-reduce of {report['allreduce']['bytes'] / 2**20:.1f} MiB over "
          f"{report['allreduce']['devices']} devices: bus bandwidth "
          f"{report['allreduce']['busbw_gbps']:.1f} GB/s")
  else:
    report["allreduce"] = None
    report["reasons"]["allreduce"] = "one local device: nothing to reduce across"
  report["result"], report["reason"] = _verdict(report, gpu, allow_cpu)
  return report
