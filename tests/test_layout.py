"""The package's floor plan: which subpackage may import which, no import cycles, and
docs/design.md naming exactly the modules that exist.

Read with the standard library's ``ast`` only (nothing is imported): every ``import`` counts,
also those inside functions and under ``if TYPE_CHECKING:`` — a lazy import that closes a cycle
is still a cycle a reader has to hold in their head.
"""

from __future__ import annotations

import ast
import os
import re

from tests.helpers import ROOT

PACKAGE = os.path.join(ROOT, "lmscale_jax")

# Who may import whom, lowest layer first. A subpackage imports only the ones listed for it
# (and itself); the top-level modules are the base (``errors``, ``child_process``) and the two
# entry points.
ALLOWED = {
    "errors": set(),
    # A base like errors: that the processes a layer starts end with it (prep's pool, Grain's
    # workers, a sweep's runs); one mechanism, so it sits below every layer that starts any.
    "child_process": set(),
    "config": {"errors"},
    "store": {"errors", "config"},
    "cluster": {"errors", "config", "store", "child_process"},
    "prep": {"errors", "store", "child_process"},
    "input": {"errors", "config", "store", "cluster", "child_process"},
    "model": {"errors", "config", "store"},
    "train": {"errors", "config", "store", "cluster", "input", "model"},
    "inference": {"errors", "config", "store", "model", "train"},
    "similarity": {"errors", "store", "prep"},
    "finetune": {"errors", "config", "store", "cluster", "model", "train", "inference",
                 "similarity"},
    "evals": {"errors", "store", "prep", "inference", "similarity"},
    "study": {"errors", "config", "store", "cluster", "input", "model", "train",
              "child_process"},
    "gpu": {"errors", "config", "store", "input", "model", "train"},
    "run_state": {"cluster"},
    # The ``lmscale`` command: the top floor, above every library layer (nothing imports it).
    "cli": {"errors", "child_process", "config", "store", "cluster", "prep", "input", "model",
            "train", "inference", "similarity", "finetune", "evals", "study", "gpu"},
    "main": {"errors", "config", "store", "cluster", "input", "train"},
}


def modules() -> dict[str, str]:
  """``{"lmscale_jax.train.steps": path}`` for every module of the package."""
  found = {}
  for folder, _, files in os.walk(PACKAGE):
    for name in files:
      if name.endswith(".py"):
        rel = os.path.relpath(os.path.join(folder, name), ROOT)[:-3].replace(os.sep, ".")
        found[rel.removesuffix(".__init__")] = os.path.join(folder, name)
  return found


def imports_of(path: str, known: set[str]) -> set[str]:
  """The package's modules that ``path`` imports, anywhere in the file."""
  out = set()
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lmscale_jax"):
      assert node.level == 0, f"{path}: use absolute imports"
      for alias in node.names:  # "from lmscale_jax.train import steps" imports a module
        full = f"{node.module}.{alias.name}"
        out.add(full if full in known else node.module)
    elif isinstance(node, ast.Import):
      out |= {a.name for a in node.names if a.name.startswith("lmscale_jax")}
  return out - {"lmscale_jax"}


def graph() -> dict[str, set[str]]:
  found = modules()
  return {name: imports_of(path, set(found)) for name, path in found.items()}


def group(module: str) -> str:
  """``lmscale_jax.train.steps`` -> ``train``; ``lmscale_jax.errors`` -> ``errors``."""
  return module.split(".")[1]


def test_every_subpackage_is_on_the_table():
  assert {group(m) for m in modules() if m != "lmscale_jax"} == set(ALLOWED)


def test_imports_between_subpackages_go_only_the_allowed_directions():
  wrong = sorted(f"{m} imports {dep}" for m, deps in graph().items() if m != "lmscale_jax"
                 for dep in deps
                 if group(dep) != group(m) and group(dep) not in ALLOWED[group(m)])
  assert not wrong, "\n".join(wrong)


def test_the_import_graph_has_no_cycle():
  edges, state, cycles = graph(), {}, []

  def visit(node, path):
    state[node] = "open"
    for dep in sorted(edges.get(node, ())):
      if state.get(dep) == "open":
        cycles.append(" -> ".join(path[path.index(dep):] + [dep]))
      elif dep not in state:
        visit(dep, path + [dep])
    state[node] = "done"

  for node in sorted(edges):
    if node not in state:
      visit(node, [node])
  assert not cycles, "\n".join(cycles)


def test_design_md_names_every_module_and_only_modules_that_exist():
  text = open(os.path.join(ROOT, "docs", "design.md")).read()
  table = text.split("## Modules", 1)[1].split("\n## ", 1)[0]
  named = {m.removeprefix("lmscale_jax/")
           for m in re.findall(r"`((?:lmscale_jax/)?(?:[a-z_]+/)*[a-z_]+\.py)`", table)
           if not m.startswith(("tools/", "benchmarks/", "tests/"))}  # files the rows mention
  on_disk = {os.path.relpath(p, PACKAGE).replace(os.sep, "/") for p in modules().values()}
  on_disk = {p for p in on_disk if not p.endswith("__init__.py")}
  assert not on_disk - named, f"docs/design.md does not describe {sorted(on_disk - named)}"
  assert not named - on_disk, f"docs/design.md names modules that do not exist: " \
                              f"{sorted(named - on_disk)}"
