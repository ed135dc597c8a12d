"""The package's floor plan: which subpackage may import which, no import cycles, and
docs/design.md naming exactly the modules that exist and only config keys that exist.

The imports are read with the standard library's ``ast`` only (nothing is imported): every
``import`` counts, also those inside functions and under ``if TYPE_CHECKING:`` — a lazy import
that closes a cycle is still a cycle a reader has to hold in their head.
"""

from __future__ import annotations

import ast
import os
import re

from tests.helpers import ROOT

PACKAGE = os.path.join(ROOT, "lmscale_jax")

# Who may import whom, lowest layer first: exactly the edges that exist (a new one is a decision,
# made here; an unused one is removed). A subpackage imports only the ones listed for it (and
# itself); the top-level modules are the base (``errors``, ``child_process``, ``progress``) and
# the entry point. ``prep.elf`` (ELF files → functions → pretoken text) is its own group: the
# only part of preparation that the similarity data and the evaluation import.
ALLOWED = {
    "errors": set(),
    # A base like errors: that the processes a layer starts end with it (prep's pool, Grain's
    # workers, a sweep's runs); one mechanism, so it sits below every layer that starts any.
    "child_process": set(),
    # A base too: the progress bars of prep's passes, the similarity build and the evaluation.
    "progress": set(),
    # A base too: how every command ends (exit codes, SIGTERM as Terminated, the error: line),
    # one owner for the tools (cli/args.guarded) and the runs (train/startup.run).
    "exits": {"progress"},
    "config": {"errors"},
    "store": {"errors", "config"},
    "cluster": {"errors", "child_process", "exits"},
    "prep.elf": {"errors", "store"},
    "prep": {"errors", "store", "child_process", "progress", "prep.elf"},
    "input": {"errors", "config", "store", "cluster", "child_process"},
    "model": {"errors", "config", "store"},
    # The run core: loop, step, gradients, checkpoints, workdir, metrics; it names no task.
    "train": {"errors", "exits", "config", "store", "cluster", "model"},
    # similarity: a name's sub-tokens (symbol_names), which a naming model's copy rates read.
    "inference": {"errors", "config", "store", "model", "train", "similarity"},
    # Pretraining, a task on the run core beside finetune/: the MLM task, its steps, its run.
    "pretrain": {"config", "store", "input", "model", "train"},
    "similarity": {"errors", "store", "progress", "prep.elf"},
    "finetune": {"errors", "config", "store", "model", "train", "inference",
                 "similarity", "evals"},  # evals: a classification run's held-out scores
    "evals": {"errors", "progress", "prep.elf", "similarity"},
    # A function index of ELF binaries and exact search over it (lmscale index / search).
    # A model's identity (what an index was built with) is inference's: search reads no checkpoint.
    "search": {"errors", "store", "inference", "prep.elf"},
    # lmscale serve's HTTP API (FastAPI) over the model and an index: above search.
    "serve": {"errors", "store", "inference", "prep.elf", "search"},
    "study": {"errors", "config", "store", "input", "model", "pretrain", "child_process"},
    # The cluster model (lmscale scaling-model) is its own group, like prep.elf: arithmetic over
    # measured inputs, below the study's runs; it imports no training, input or run code.
    "study.cluster_model": {"errors", "config", "store", "model"},
    "gpu": {"config", "store", "input", "model", "train", "pretrain"},
    "main": {"errors", "exits", "config", "cluster", "input", "train", "pretrain"},
    # The ``lmscale`` command: the top floor (nothing imports it). A subcommand's module is
    # imported by its name when it runs (cli/lmscale.py's table): ``run-state``'s
    # ``lmscale_jax.cluster.run_state`` is no edge, and the batch node needs no cli/ for it.
    "cli": {"errors", "exits", "progress", "config", "store", "prep.elf", "prep", "input", "model",
            "train", "pretrain", "inference", "similarity", "finetune", "evals", "search", "serve", "study",
            "study.cluster_model", "gpu",
            "main"},
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
  """``lmscale_jax.train.steps`` -> ``train``; ``lmscale_jax.errors`` -> ``errors``;
  ``lmscale_jax.prep.elf.elf_corpus`` -> ``prep.elf`` (a subpackage with its own row)."""
  parts = module.split(".")
  return ".".join(parts[1:3]) if ".".join(parts[1:3]) in ALLOWED else parts[1]


def edges() -> dict[str, set[str]]:
  """``{"train": {"model", …}}``: which groups import which, from the modules on disk."""
  out = {g: set() for g in ALLOWED}
  for m, deps in graph().items():
    if m != "lmscale_jax":
      out[group(m)] |= {group(d) for d in deps if group(d) != group(m)}
  return out


def test_every_subpackage_is_on_the_table():
  assert {group(m) for m in modules() if m != "lmscale_jax"} == set(ALLOWED)


def test_imports_between_subpackages_go_only_the_allowed_directions():
  wrong = sorted(f"{m} imports {dep}" for m, deps in graph().items() if m != "lmscale_jax"
                 for dep in deps
                 if group(dep) != group(m) and group(dep) not in ALLOWED[group(m)])
  assert not wrong, "\n".join(wrong)


def test_every_allowed_import_is_one_that_exists():
  found = edges()
  unused = sorted(f"{g} -> {dep}" for g, deps in ALLOWED.items() for dep in deps - found[g])
  assert not unused, "ALLOWED lists imports no module makes (remove them):\n" + "\n".join(unused)


def test_similarity_and_evals_import_only_the_elf_part_of_prep():
  wrong = sorted(f"{m} imports {dep}" for m, deps in graph().items() if m != "lmscale_jax"
                 and group(m) in ("similarity", "evals") for dep in deps if group(dep) == "prep")
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


def config_keys_in_design_md() -> set[str]:
  """The keys docs/design.md's "## Config" blocks name: ``data.path`` starts a line, and a line
  like ``train.steps, learning_rate, schedule ("linear"|"cosine"), …`` names more keys of the
  same section; a line starting with a bare word (``init_from``) names a top-level key."""
  text = open(os.path.join(ROOT, "docs", "design.md")).read()
  section = text.split("\n## Config", 1)[1].split("\n## ", 1)[0]
  named = set()
  for block in section.split("```")[1::2]:
    for line in block.strip().splitlines():
      first = re.match(r"(\w+)(?:\.(\w+))?(?:\s*\([^)]*\))?", line)
      prefix = f"{first[1]}." if first[2] else ""
      named.add(first[1] + (f".{first[2]}" if first[2] else ""))
      rest = line[first.end():]
      while prefix and (more := re.match(r",\s*(\w+)(?:\s*\([^)]*\))?", rest)):
        named.add(prefix + more[1])
        rest = rest[more.end():]
  return named


def test_design_md_config_names_only_keys_that_exist_and_every_section():
  from lmscale_jax.config import defaults, finetune

  configs = [defaults.get_base_config(), finetune.get_config()]
  named = config_keys_in_design_md()

  def exists(key: str) -> bool:
    section, _, name = key.partition(".")
    return any(section in c and (not name or (hasattr(c[section], "keys") and name in c[section]))
               for c in configs)

  unknown = sorted(k for k in named if not exists(k))
  assert not unknown, f"docs/design.md's config names keys that do not exist: {unknown}"
  sections = {k for c in configs for k in c.keys()}
  missing = sections - {k.partition(".")[0] for k in named}
  assert not missing, f"docs/design.md's config does not describe {sorted(missing)}"
