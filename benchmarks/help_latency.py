"""How long each ``lmscale X --help`` takes: the installed command run as a subprocess, RUNS
times per subcommand; with --before DIR, interleaved with an older tree of the package (a
``git archive REV lmscale_jax | tar -x -C DIR``, its C extensions copied in) put first on
PYTHONPATH. Prints one line per subcommand and writes the medians and minima as JSON.

  python benchmarks/help_latency.py --output OUT.json [--runs 5] [--before DIR]

What the issue measured as 2-4 s for ten subcommands (issue 56, item 8); the test that keeps
JAX out of every help is tests/test_help_is_light.py (no timing in it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _host  # noqa: E402
from lmscale_jax.cli.lmscale import MODULES  # noqa: E402

INSTALLED = os.path.join(os.path.dirname(sys.executable), "lmscale")


def seconds(name: str, env: dict) -> float:
  start = time.perf_counter()
  r = subprocess.run([INSTALLED, name, "--help"], env=env, capture_output=True, cwd="/",
                     stdin=subprocess.DEVNULL)
  took = time.perf_counter() - start
  if r.returncode != 0:
    sys.exit(f"error: lmscale {name} --help exited {r.returncode}: {r.stderr[-300:]!r}")
  return took


def measure(runs: int, before: str | None) -> dict:
  base = dict(os.environ, JAX_PLATFORMS="cpu")
  trees = {"after": base} if before is None else {
      "before": dict(base, PYTHONPATH=before), "after": base}
  rows = {}
  for name in MODULES:
    times: dict[str, list[float]] = {k: [] for k in trees}
    for _ in range(runs):
      for tree, env in trees.items():
        times[tree].append(seconds(name, env))
    rows[name] = {k: {"min_s": round(min(v), 3), "median_s": round(statistics.median(v), 3)}
                  for k, v in times.items()}
    print(name, json.dumps(rows[name]), flush=True)
  return rows


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python benchmarks/help_latency.py",
                              description=__doc__.splitlines()[0])
  p.add_argument("--output", required=True, metavar="OUT.json")
  p.add_argument("--runs", type=int, default=5)
  p.add_argument("--before", default=None, metavar="DIR",
                 help="an older lmscale_jax tree to time beside the installed one")
  a = p.parse_args(argv)
  if a.before and not os.path.isdir(os.path.join(a.before, "lmscale_jax")):
    p.error(f"--before {a.before}: no lmscale_jax/ in it (git archive REV lmscale_jax | tar -x)")
  rows = measure(a.runs, a.before)
  worst = {k: max(r[k]["median_s"] for r in rows.values()) for k in next(iter(rows.values()))}
  result = {"date": time.strftime("%Y-%m-%d"), "device": _host.host_description(os.path.dirname(INSTALLED)),
            "load_avg_at_end": os.getloadavg(), "runs": a.runs, "before": a.before,
            "worst_median_s": worst, "subcommands": rows}
  with open(a.output, "w") as f:
    json.dump(result, f, indent=1)
  print(json.dumps(worst))
  return 0


if __name__ == "__main__":
  sys.exit(main())
