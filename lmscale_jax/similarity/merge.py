"""Several benchmark files (:mod:`lmscale_jax.similarity.function_groups`'s format) as one: one library
per build, merged (``lmscale similarity-build --merge A.jsonl B.jsonl --output C``).

* A group is its source file + function name, the source file named with its library's
  directory (``zlib-1.2.13/adler32.c``), so two libraries' ``util.c:init`` are two groups.
  Where two inputs still hold the same source file (two ``--sources src`` builds of different
  libraries), both inputs' sources are named with their file's stem in front
  (``zlib/src/util.c``), and the header says so.
* The variants are compared across every group, so the inputs must agree on the compilers
  (with their versions), the variants and ``min_instructions``: otherwise one line naming the
  file, the key and both values.
* The header: counters summed, the content's counts recomputed, problems, libraries,
  duplicates dropped and leakage entries (each with the file it came from) kept, and
  ``"merged"``: per input its file, groups, prefix, set and flags.
"""

from __future__ import annotations

import collections
import os

from lmscale_jax.similarity import function_groups

AGREE = ("compilers", "min_instructions")


def merge(paths: list[str]) -> tuple[dict, list[dict]]:
  """→ (header, groups) of the inputs, groups sorted as a build writes them."""
  if len(set(map(os.path.realpath, paths))) < len(paths):
    raise function_groups.FunctionGroupsError(f"--merge {' '.join(paths)}: a file is given twice")
  inputs = [(path, *function_groups.load(path)) for path in paths]
  for path, header, _ in inputs[1:]:
    agree(inputs[0][0], inputs[0][1], path, header)
  prefixes = qualify(inputs)
  groups = sorted((renamed(g, prefixes[path]) for path, _, gs in inputs for g in gs),
                  key=lambda g: (g["source"], g["name"]))
  header = combined(inputs, prefixes)
  function_groups.restat(header, groups)
  return header, groups


def agree(first: str, ours: dict, path: str, theirs: dict) -> None:
  for key in AGREE:
    if theirs.get(key) != ours.get(key):
      raise function_groups.FunctionGroupsError(
          f"--merge {path}: {key} {theirs.get(key)!r} is not {first}'s {ours.get(key)!r} "
          "(functions are compared across variants: rebuild both with the same compilers, "
          "--opt and --min-instructions)")
  if set(theirs["variants"]) != set(ours["variants"]):
    raise function_groups.FunctionGroupsError(
        f"--merge {path}: variants {','.join(theirs['variants'])} are not {first}'s "
        f"{','.join(ours['variants'])} (rebuild both with the same --compilers and --opt)")


def qualify(inputs: list) -> dict[str, str]:
  """Input file → the prefix of its source names: '' unless another input holds one of its
  source files, else its file's stem."""
  holders = collections.defaultdict(set)
  for path, _, groups in inputs:
    for g in groups:
      holders[g["source"]].add(path)
  shared = {p for held in holders.values() if len(held) > 1 for p in held}
  prefixes = {path: _stem(path) if path in shared else "" for path, _, _ in inputs}
  stems = collections.Counter(p for p in prefixes.values() if p)
  if clash := [p for p, n in stems.items() if n > 1]:
    raise function_groups.FunctionGroupsError(
        f"--merge: {' and '.join(x for x in prefixes if prefixes[x] == clash[0])} hold the "
        f"same source files and would both be named {clash[0]}/… (rename one file: its stem "
        "names its sources)")
  return prefixes


def _stem(path: str) -> str:
  return os.path.basename(path).split(".")[0]


def renamed(group: dict, prefix: str) -> dict:
  return {**group, "source": f"{prefix}/{group['source']}"} if prefix else group


def combined(inputs: list, prefixes: dict[str, str]) -> dict:
  first = inputs[0][1]
  header = {"format": function_groups.FORMAT, "variants": first["variants"],
            "compilers": first["compilers"], "min_instructions": first["min_instructions"],
            "cflags": [f for f in first["cflags"] if all(f in h["cflags"] for _, h, _ in inputs)],
            "sources": [_name(prefixes[p], s) for p, h, _ in inputs for s in h["sources"]],
            "stats": summed([h["stats"] for _, h, _ in inputs]),
            "problems": [x for _, h, _ in inputs for x in h.get("problems", [])],
            "merged": [{"file": p, "groups": len(gs), "prefix": prefixes[p],
                        "set": h.get("set"), "specs": h.get("specs", []),
                        "cflags": h["cflags"]} for p, h, gs in inputs]}
  kept = {"libraries": [lib for _, h, _ in inputs for lib in h.get("libraries", [])],
          "duplicates_dropped": [_name(prefixes[p], x) for p, h, _ in inputs
                                 for x in h.get("duplicates_dropped", [])],
          "leakage": [{**x, "in": p} for p, h, _ in inputs for x in h.get("leakage", [])]}
  return {**header, **{k: v for k, v in kept.items() if v}}


def _name(prefix: str, source: str) -> str:
  return f"{prefix}/{source}" if prefix else source


def summed(stats: list[dict]) -> dict:
  """The counters of what was built and dropped, added up (what the file holds is recounted
  by :func:`function_groups.restat`)."""
  out: dict = {}
  for s in stats:
    for key, value in s.items():
      if isinstance(value, int) and not isinstance(value, bool):
        out[key] = out.get(key, 0) + value
  return out
