"""The plot of benchmarks/quality_curve.py: per task (a column), the scores of both starts
(top) and the pretraining gain with its fitted line and 95% band (bottom) against pretraining
FLOPs on a log axis; one colour per model, one marker per fine-tuning seed, the line through
each cell's mean. A task no cell measured says so in its panel."""

from __future__ import annotations

import io
import math

import matplotlib

matplotlib.use("Agg")  # files only: no display on the study's machines
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks import quality_fit  # noqa: E402
from lmscale_jax.store import file_io  # noqa: E402


def plot(cells: list[dict], fits: list[dict], tasks: list[tuple[str, str]], path: str,
         tool: str) -> None:
  fig, axes = plt.subplots(2, len(tasks), figsize=(4.2 * len(tasks), 7.5), squeeze=False)
  colours = {v: f"C{i}" for i, v in enumerate(sorted({c["variant"] for c in cells}))}
  for col, (task, label) in enumerate(tasks):
    top, bottom = axes[0][col], axes[1][col]
    have = [c for c in cells if task in c["tasks"]]
    for variant, colour in colours.items():
      mine = [c for c in have if c["variant"] == variant]
      scores(top, mine, task, variant, colour)
      gains(bottom, mine, task, variant, colour)
      trend(bottom, [f for f in fits if (f["variant"], f["task"]) == (variant, task)], colour)
    baseline(top, [c["baselines"][task] for c in cells if task in c.get("baselines", {})])
    decorate(top, bottom, label, bool(have), cells)
  axes[0][0].legend(fontsize=7, loc="best")
  fig.suptitle("Downstream quality against pretraining FLOPs (CPU cells; issue 59)")
  fig.tight_layout()
  png = io.BytesIO()
  fig.savefig(png, format="png", dpi=110, metadata={"Software": tool})
  plt.close(fig)
  file_io.atomic_write_bytes(path, png.getvalue())  # temp, then rename: never half a picture


def scores(ax, cells: list[dict], task: str, variant: str, colour: str) -> None:
  for what, style, name in (("pretrained_ft", "-", "pretrained + FT"),
                            ("random_ft", ":", "random init + FT")):
    xs = [c["pretraining_flops"] for c in cells]
    for c in cells:
      ys = c["tasks"][task][what]
      ax.scatter([c["pretraining_flops"]] * len(ys), ys, color=colour, s=12,
                 marker="o" if what == "pretrained_ft" else "x")
    if cells:
      ax.plot(xs, [mean(c["tasks"][task][what]) for c in cells], style, color=colour,
              label=f"{variant}: {name}")


def gains(ax, cells: list[dict], task: str, variant: str, colour: str) -> None:
  for c in cells:
    ys = c["tasks"][task]["gain"]
    ax.scatter([c["pretraining_flops"]] * len(ys), ys, color=colour, s=14)
  if cells:
    ax.plot([c["pretraining_flops"] for c in cells],
            [mean(c["tasks"][task]["gain"]) for c in cells], "-", color=colour, alpha=0.5,
            label=variant)


def baseline(ax, values: list[float]) -> None:
  """TF-IDF + logistic regression, the issue's bar for provenance (one split: one value)."""
  if values:
    line = ax.axhline(mean(values), color="grey", ls="--", lw=1,
                      label="TF-IDF + logistic regression")
    ax.legend(handles=[line], fontsize=7, loc="lower right")


def trend(ax, fits: list[dict], colour: str) -> None:
  """The fitted line over the measured FLOPs (the extrapolation is the table's, not drawn),
  only where it is a trend (≥ 3 budgets)."""
  for f in fits:
    g = f["gain"]
    if not g["trend"]:
      continue
    lo, hi = g["x_range"]
    xs = [lo + (hi - lo) * i / 20 for i in range(21)]
    preds = [quality_fit.predict(g, x) for x in xs]
    ax.plot([10 ** x for x in xs], [p["mean"] for p in preds], "--", color=colour, lw=1)
    if preds[0]["interval"]:
      ax.fill_between([10 ** x for x in xs], [p["interval"][0] for p in preds],
                      [p["interval"][1] for p in preds], color=colour, alpha=0.12)


def decorate(top, bottom, label: str, measured: bool, cells: list[dict]) -> None:
  """Every panel on one FLOPs axis, ticked at the cells (budget and FLOPs), so the tasks
  line up and a cell a task lacks shows as a gap."""
  top.set_title(label, fontsize=9)
  top.set_ylabel("score")
  bottom.set_ylabel("pretraining gain (pretrained − random)")
  bottom.axhline(0, color="grey", lw=0.5)
  ticks = sorted({c["pretraining_flops"]: budget(c) for c in cells}.items())
  lo, hi = ticks[0][0], ticks[-1][0]
  for ax in (top, bottom):
    ax.set_xscale("log")
    ax.set_xlim(lo / 1.15, hi * 1.15)
    ax.set_xticks([f for f, _ in ticks], [f"{b}\n{f:.2g}" for f, b in ticks], fontsize=7)
    ax.minorticks_off()
    ax.set_xlabel("pretraining FLOPs (budget on this CPU)", fontsize=8)
    if not measured:
      ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center", va="center")


def budget(cell: dict) -> str:
  s = cell["budget_s"]
  return f"{s / 3600:g} h" if s >= 3600 else f"{s / 60:g} min"


def mean(values: list[float]) -> float:
  return math.fsum(values) / len(values)
