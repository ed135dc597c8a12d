"""The trend of benchmarks/quality_curve.py: a score (or the pretraining gain) against
log10(pretraining FLOPs), by ordinary least squares on the per-seed points, with the slope's
standard error and Student-t 95% intervals for the slope and for the fitted mean at a new FLOPs
(the extrapolations to an H200-hour and an H200-day).

What the interval covers: the scatter of the points about the line, i.e. the fine-tuning seeds'
spread and how far the cells' means leave a straight line. It does not cover a second
pretraining run of the same budget (each cell has one), and it assumes the straight line: far
outside the measured FLOPs it is an interval of the line, not of what a run would reach.
"""

from __future__ import annotations

import math

from scipy import stats

LEVEL = 0.95  # the intervals' coverage
MIN_BUDGETS = 3  # distinct FLOPs below this: a line through the cells, no trend claimed


def fit(points: list[tuple[float, float]]) -> dict | None:
  """OLS of y on x over ``points`` ((log10 FLOPs, score) pairs); None with fewer than two
  distinct x. ``se`` and the interval are None when no degree of freedom is left."""
  xs = sorted({x for x, _ in points})
  if len(xs) < 2:
    return None
  n = len(points)
  mx = sum(x for x, _ in points) / n
  my = sum(y for _, y in points) / n
  sxx = sum((x - mx) ** 2 for x, _ in points)
  slope = sum((x - mx) * (y - my) for x, y in points) / sxx
  intercept = my - slope * mx
  dof = n - 2
  rss = sum((y - intercept - slope * x) ** 2 for x, y in points)
  s = math.sqrt(rss / dof) if dof > 0 else None
  se = s / math.sqrt(sxx) if s is not None else None
  t = float(stats.t.ppf(0.5 + LEVEL / 2, dof)) if dof > 0 else None
  return {"n_points": n, "budgets": len(xs), "dof": dof, "slope_per_decade": slope,
          "slope_se": se, "slope_interval": interval(slope, se, t), "intercept": intercept,
          "residual_sd": s, "t": t, "x_mean": mx, "sxx": sxx,
          "x_range": [xs[0], xs[-1]], "trend": len(xs) >= MIN_BUDGETS}


def interval(value: float, se: float | None, t: float | None) -> list[float] | None:
  return None if se is None else [value - t * se, value + t * se]


def predict(f: dict, x: float) -> dict:
  """The fitted mean at ``x`` (log10 FLOPs) with its 95% interval (the line's, not a new
  run's), and how many decades past the largest measured FLOPs it reaches."""
  mean = f["intercept"] + f["slope_per_decade"] * x
  se = None
  if f["residual_sd"] is not None:
    se = f["residual_sd"] * math.sqrt(1 / f["n_points"] + (x - f["x_mean"]) ** 2 / f["sxx"])
  return {"log10_flops": x, "mean": mean, "se": se, "interval": interval(mean, se, f["t"]),
          "decades_beyond_data": x - f["x_range"][1]}
