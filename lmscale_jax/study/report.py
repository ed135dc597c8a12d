"""The tables and plots of lmscale report: lmscale sweep's results (one JSON row per sweep
point; only the latest row of each point counts) as markdown tables and small PNGs (600×400),
and the storage model's rows (lmscale storage-model --json) as staged vs shared storage.

matplotlib is imported only when a plot is drawn (Agg: files, no display).
"""

from __future__ import annotations

import glob
import json
import os

from lmscale_jax.errors import UserError
from lmscale_jax.store import file_io
from lmscale_jax.study.host import ROOT


SIZE = (6, 4)  # inches at 100 dpi: 600 × 400 pixels
STORAGE_GLOB = "benchmarks/results/*-cpu-storage*.jsonl"


class ReportError(UserError):
  """A results or storage file that cannot be read as one: one line naming it."""


def read_jsonl(path: str) -> list[dict]:
  return file_io.read_jsonl(path, "a results file (lmscale sweep's output)", ReportError)


def latest(rows: list[dict]) -> list[dict]:
  by_key = {}
  for r in rows:
    by_key[r["key"]] = r
  return list(by_key.values())


def fmt(v, spec="{:.3g}"):
  return "–" if v is None else spec.format(v)


def markdown(header: list[str], body: list[list]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
  return "\n".join(lines)


# ----------------------------------------------------------------------------- tables
def runs_table(rows: list[dict]) -> str:
  body = []
  for r in sorted(rows, key=lambda r: (r["model"], r["batch"], r["accum"], r["workers"],
                                       r["processes"])):
    peak = r.get("peak_bytes")
    label = r["model"] + (f" [{r['tag']}]" if r.get("tag") else "")
    body.append([label, r["processes"], r["devices"], r["workers"], r["batch"], r["accum"],
                 r["global_batch"], r["status"], fmt(r.get("samples_per_sec"), "{:.1f}"),
                 fmt(r.get("tokens_per_sec"), "{:.0f}"), fmt(r.get("step_time"), "{:.4f}"),
                 fmt(r.get("input_wait_frac"), "{:.1%}"), fmt(r.get("mfu"), "{:.1%}"),
                 fmt(peak / 2**30 if peak else None),
                 "–" if not r.get("load_avg") else "→".join(f"{x:.1f}" for x in r["load_avg"]),
                 r.get("reason") or ""])
  return markdown(["model", "processes", "devices", "workers", "batch/device", "accum",
                   "global batch", "status", "samples/s", "tokens/s", "step s", "input wait",
                   "MFU", "peak GiB/device", "load", "reason"], body)


def series(rows: list[dict], axis: str, fixed: tuple) -> dict:
  """ok rows grouped by the ``fixed`` fields, each group {axis value: row}, ≥ 2 values."""
  groups = {}
  for r in rows:
    if r["status"] == "ok" and r.get("samples_per_sec") is not None:
      groups.setdefault(tuple(r.get(f, "") for f in fixed), {})[r[axis]] = r
  return {k: dict(sorted(v.items())) for k, v in groups.items() if len(v) >= 2}


def label(fixed: tuple, values: tuple) -> str:
  short = {"tag": "", "model": "", "workers": "w", "batch": "b", "accum": "k",
           "processes": "p"}
  return " ".join(f"{short[f]}{v}" for f, v in zip(fixed, values) if v != "")


SCALING = ("tag", "model", "workers", "batch", "accum")
WORKERS = ("tag", "model", "processes", "batch", "accum")


def scaling_rows(rows):
  out = []
  for key, points in series(rows, "processes", SCALING).items():
    base = next(iter(points.values()))
    for p, r in points.items():
      ideal = base["samples_per_sec"] * r["devices"] / base["devices"]
      out.append((key, p, r, ideal, r["samples_per_sec"] / ideal))
  return out


def scaling_table(rows) -> str:
  return markdown(["series", "processes", "samples/s", "ideal", "efficiency", "step s"],
                  [[label(SCALING, k), p, f"{r['samples_per_sec']:.1f}", f"{ideal:.1f}",
                    f"{eff:.0%}", f"{r['step_time']:.4f}"]
                   for k, p, r, ideal, eff in scaling_rows(rows)])


def workers_table(rows) -> str:
  return markdown(["series", "workers", "input wait", "step s", "samples/s"],
                  [[label(WORKERS, k), w, fmt(r["input_wait_frac"], "{:.1%}"),
                    f"{r['step_time']:.4f}", f"{r['samples_per_sec']:.1f}"]
                   for k, points in series(rows, "workers", WORKERS).items()
                   for w, r in points.items()])


def model_rows(rows) -> list[dict]:
  """Per model swept over >= 2 batches: the largest per-device batch that ran, its best
  throughput, the first that failed (at the fewest processes swept for that model)."""
  out = []
  for model in sorted({r["model"] for r in rows}):
    mine = [r for r in rows if r["model"] == model]
    least = min(r["processes"] for r in mine)
    mine = [r for r in mine if r["processes"] == least]
    ok = [r for r in mine if r["status"] == "ok"]
    if not ok or len({r["batch"] for r in mine}) < 2:  # no batch axis: no "largest" to find
      continue
    top = max(r["batch"] for r in ok)
    best = max((r for r in ok if r["batch"] == top), key=lambda r: r["samples_per_sec"])
    failed = sorted((r for r in mine if r["status"] != "ok" and r["batch"] > top),
                    key=lambda r: r["batch"])
    out.append({"model": model, "params": best.get("param_count"), "processes": least,
                "largest_batch": top, "samples_per_sec": best["samples_per_sec"],
                "tokens_per_sec": best["tokens_per_sec"], "peak_bytes": best.get("peak_bytes"),
                "next": failed[0] if failed else None})
  return out


def models_table(rows) -> str:
  body = []
  for m in model_rows(rows):
    nxt = m["next"]
    body.append([m["model"], fmt(m["params"] / 1e6 if m["params"] else None), m["processes"],
                 m["largest_batch"], f"{m['samples_per_sec']:.1f}",
                 f"{m['tokens_per_sec']:.0f}",
                 fmt(m["peak_bytes"] / 2**30 if m["peak_bytes"] else None),
                 f"{nxt['batch']}: {nxt['reason']}" if nxt else "none swept"])
  return markdown(["model", "params (M)", "processes", "largest batch/device that ran",
                   "samples/s at it", "tokens/s at it", "peak GiB/device", "next batch"], body)


# ----------------------------------------------------------------------------- plots
def figure():
  import matplotlib

  matplotlib.use("Agg")  # files only, no display
  import matplotlib.pyplot as plt

  return plt


def save(fig, out_dir: str, name: str) -> str:
  path = os.path.join(out_dir, name)
  fig.tight_layout()
  fig.savefig(path + ".tmp.png", dpi=100)
  os.replace(path + ".tmp.png", path)  # a reader never sees half a PNG
  figure().close(fig)
  return path


def plot_scaling(rows, out_dir: str) -> str:
  found = scaling_rows(rows)
  if not found:
    return "scaling.png: skipped (needs ok rows at >= 2 process counts for one series)"
  plt = figure()
  fig, ax = plt.subplots(figsize=SIZE)
  for key in dict.fromkeys(k for k, *_ in found):
    pts = [(p, r["samples_per_sec"], ideal, eff) for k, p, r, ideal, eff in found if k == key]
    line, = ax.plot([p for p, *_ in pts], [s for _, s, *_ in pts], "o-", label=label(SCALING,
                                                                                       key))
    ax.plot([p for p, *_ in pts], [i for *_, i, _ in pts], "--", color=line.get_color(),
            alpha=0.6)
    for p, s, _, eff in pts[1:]:  # the first is 100% by definition
      ax.annotate(f"{eff:.0%}", (p, s), textcoords="offset points", xytext=(4, -12),
                  fontsize=8)
  ax.plot([], [], "k--", alpha=0.6, label="ideal (linear)")
  ax.set(xlabel="processes", ylabel="samples/s (global)",
         title="Throughput vs processes (labels: efficiency vs ideal)")
  ax.set_xticks(sorted({p for _, p, *_ in found}))
  ax.set_ylim(bottom=0)
  ax.legend(fontsize=7, loc="upper left")
  ax.grid(alpha=0.3)
  return save(fig, out_dir, "scaling.png")


def plot_workers(rows, out_dir: str) -> str:
  found = series(rows, "workers", WORKERS)
  if not found:
    return "workers.png: skipped (needs ok rows at >= 2 loader-worker counts for one series)"
  plt = figure()
  fig, (left, right) = plt.subplots(1, 2, figsize=SIZE)
  for key, points in found.items():
    ws = list(points)
    left.plot(ws, [points[w]["input_wait_frac"] * 100 for w in ws], "o-",
              label=label(WORKERS, key))
    right.plot(ws, [points[w]["step_time"] * 1000 for w in ws], "o-")
  for ax, what in ((left, "input wait (% of wall time)"), (right, "step time (ms)")):
    ax.set(xlabel="loader workers (data.workers)", ylabel=what)
    ax.set_xticks(sorted({w for p in found.values() for w in p}))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
  left.legend(fontsize=7)
  fig.suptitle("Loader workers: input wait and step time")
  return save(fig, out_dir, "workers.png")


def plot_models(rows, out_dir: str) -> str:
  found = [m for m in model_rows(rows) if m["params"]]
  if len(found) < 2:
    return "models.png: skipped (needs >= 2 models with an ok row and a parameter count)"
  plt = figure()
  fig, (left, right) = plt.subplots(1, 2, figsize=SIZE)
  for m in found:
    mine = sorted((r for r in rows if r["model"] == m["model"]
                   and r["processes"] == m["processes"]), key=lambda r: r["batch"])
    ok = {}
    for r in mine:  # the best worker count at each batch
      if r["status"] == "ok":
        ok[r["batch"]] = max(ok.get(r["batch"], 0), r["samples_per_sec"])
    line, = left.plot(list(ok), list(ok.values()), "o-", label=m["model"])
    oom = sorted({r["batch"] for r in mine if r["status"] != "ok" and r["batch"] not in ok})
    if oom:
      left.plot(oom, [0] * len(oom), "x", color=line.get_color(), markersize=9, clip_on=False)
  batches = sorted({r["batch"] for r in rows if r["model"] in {m["model"] for m in found}})
  left.set(xlabel="batch per device", ylabel="samples/s (x: failed, e.g. OOM)", xscale="log")
  left.minorticks_off()
  left.set_xticks(batches, [str(b) for b in batches])
  left.set_ylim(bottom=0)
  left.legend(fontsize=7)
  params = [m["params"] / 1e6 for m in found]
  right.plot(params, [m["largest_batch"] for m in found], "s-")
  for x, m in zip(params, found):
    right.annotate(f"{m['samples_per_sec']:.0f}/s", (x, m["largest_batch"]),
                   textcoords="offset points", xytext=(4, 4), fontsize=8)
  right.set(xlabel="parameters (M)", ylabel="largest batch per device that ran",
            xscale="log")
  right.minorticks_off()
  right.set_xticks(params, [f"{p:.3g}" for p in params])
  right.set_xlim(min(params) / 1.5, max(params) * 1.5)
  right.set_ylim(bottom=0)
  for ax in (left, right):
    ax.grid(alpha=0.3)
  fig.suptitle("Model size vs largest batch vs throughput")
  return save(fig, out_dir, "models.png")


# ----------------------------------------------------------------------------- storage
MODE_KEYS = ("mode", "storage", "reads", "source", "scheme")


def read_storage(path: str) -> list[dict]:
  """Rows with "nodes" from a storage-model file: lmscale storage-model --json (one JSON
  document whose "rows" are per node count), or JSON lines of such documents or of rows."""
  if not os.path.isfile(path):
    raise ReportError(f"--storage {path}: no such file")
  text = open(path).read()
  try:
    docs = [json.loads(text)]
  except ValueError:
    docs = []
    for n, line in enumerate(text.splitlines(), 1):
      try:
        docs.append(json.loads(line)) if line.strip() else None
      except ValueError:
        raise ReportError(f"{path}:{n}: neither a JSON document nor JSON lines") from None
  rows = []
  for d in (x for doc in docs for x in (doc if isinstance(doc, list) else [doc])):
    if isinstance(d, dict):
      rows += [r for r in d.get("rows", [d]) if isinstance(r, dict) and "nodes" in r]
  return rows


def storage_series(rows: list[dict]) -> dict:
  """{quantity: {"staged": {nodes: v}, "shared": {nodes: v}}}. The storage model's rows
  (lmscale_jax/study/storage_model.compare) give the step time reading from shared storage
  (shared_step_s = step / input_efficiency) against the step from a staged copy, and the
  one-off costs: staging the dataset against opening every shard on the shared system. Other
  files: a mode field (staged|local vs shared) beside numbers, or staged_*/shared_* pairs."""
  out = {}

  def put(quantity, side, nodes, v):
    if isinstance(v, (int, float)) and not isinstance(v, bool):
      out.setdefault(quantity, {}).setdefault(side, {})[nodes] = v

  for r in rows:
    n = r["nodes"]
    if "shared_step_s" in r and "input_efficiency" in r:
      put("step time (s)", "staged", n, r["shared_step_s"] * r["input_efficiency"])
      put("step time (s)", "shared", n, r["shared_step_s"])
      put("one-off start-up (s)", "staged", n, r.get("stage_s"))
      put("one-off start-up (s)", "shared", n, r.get("startup_open_s"))
      continue
    mode = next((str(r[k]).lower() for k in MODE_KEYS if k in r), "")
    side = ("staged" if "stag" in mode or "local" in mode else
            "shared" if "shared" in mode else None)
    for k, v in r.items():
      if k != "nodes" and side:
        put(k, side, n, v)
      for s in ("staged", "shared"):
        if k.startswith(s + "_"):
          put(k[len(s) + 1:], s, n, v)
  return {k: v for k, v in out.items() if len(v) == 2}


def plot_storage(paths: list[str], out_dir: str) -> tuple[str, str]:
  if not paths:
    return ("storage.png: skipped (no storage-model rows: give lmscale storage-model --json "
            f"output with --storage, or write {STORAGE_GLOB})", "")
  found = storage_series([r for p in paths for r in read_storage(p)])
  if not found:
    return (f"storage.png: skipped ({', '.join(paths)}: no rows with 'nodes' and staged/shared "
            "values)", "")
  plt = figure()
  quantities = list(found)[:2]
  fig, axes = plt.subplots(1, len(quantities), figsize=SIZE, squeeze=False)
  for ax, quantity in zip(axes[0], quantities):
    for side, style in (("staged", "o-"), ("shared", "s--")):
      pts = dict(sorted(found[quantity][side].items()))
      ax.plot(list(pts), list(pts.values()), style, label=side)
    values = [v for side in found[quantity].values() for v in side.values() if v > 0]
    wide = values and max(values) > 20 * min(values)  # log only where linear would hide one
    ax.set(xlabel="nodes", ylabel=quantity, xscale="log", yscale="log" if wide else "linear")
    if not wide:
      ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle("Staged local reads vs shared storage (model)")
  body = [[q, n, fmt(sides["staged"].get(n)), fmt(sides["shared"].get(n))]
          for q, sides in found.items()
          for n in sorted(set(sides["staged"]) | set(sides["shared"]))]
  return save(fig, out_dir, "storage.png"), markdown(["quantity", "nodes", "staged", "shared"],
                                                     body)


# ----------------------------------------------------------------------------- the report
def sweep_rows(paths: list[str]) -> list[dict]:
  """The latest row of each point over ``paths``; a file that is not lmscale sweep's results
  (no 'key'/'status') is refused, naming where storage-model rows go instead."""
  rows = []
  for path in paths:
    for r in read_jsonl(path):
      if "key" not in r or "status" not in r:
        raise ReportError(f"{path}: rows without 'key'/'status': not a lmscale sweep results "
                          "file (storage-model rows go in --storage)")
      rows.append(r)
  return latest(rows)


def write_report(results: list[str], output: str,
                 storage: list[str] | None = None) -> tuple[str, list[str]]:
  """Writes the PNGs and OUTPUT/report.md; returns the markdown and, per plot, the path it
  wrote or the line saying why it was skipped. ``storage`` None: the committed storage-model
  results (:data:`STORAGE_GLOB`) if any."""
  rows = sweep_rows(results)
  if storage is None:
    storage = sorted(glob.glob(os.path.join(ROOT, STORAGE_GLOB)))
  os.makedirs(output, exist_ok=True)
  sections = [("All runs", runs_table(rows)), ("Throughput vs processes", scaling_table(rows)),
              ("Loader workers", workers_table(rows)),
              ("Model size vs largest batch", models_table(rows))]
  made = [plot_scaling(rows, output), plot_workers(rows, output), plot_models(rows, output)]
  line, table = plot_storage(storage, output)
  made.append(line)
  if table:
    sections.append(("Staged vs shared storage (model)", table))
  text = "\n\n".join(f"## {title}\n\n{body}" for title, body in sections)
  from lmscale_jax.store import file_io

  file_io.atomic_write_bytes(os.path.join(output, "report.md"), (text + "\n").encode())
  return text, made
