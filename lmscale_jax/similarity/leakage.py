"""Leakage between a training pairs file and an evaluation benchmark (both in the format of
:mod:`lmscale_jax.similarity.function_groups`): a model fine-tuned on the same function it is later
asked to find has learnt the answer, not the task.

Two keys, because either can miss what the other finds:

* **digest**: the normalised-text hash of one compiled function (preparation's dedup hash).
  It finds the same machine code under any name or path (a helper copied into two
  libraries), but not the same source compiled differently.
* **name**: source file basename + function name. It finds one library vendored in two
  packages (``lz4-4.3.3/lz4libs/xxhash.c`` and ``xxhash-4.1.0/deps/xxhash/xxhash.c``: other
  paths, maybe another version and other code), but not a renamed copy.

A training group is shared when any of its variants' digests is among the benchmark's, or its
name key is. :func:`without` drops shared groups whole: one of its variants alone would still
pair the leaked function with its other compilations.
"""

from __future__ import annotations

import os

EXAMPLES = 10


def name_key(group: dict) -> tuple[str, str]:
  return os.path.basename(group["source"]), group["name"]


def digests(groups: list[dict]) -> set[str]:
  return {v["digest"] for g in groups for v in g["variants"].values() if v.get("digest")}


def shared(train: list[dict], evaluation: list[dict]) -> tuple[list[int], list[int]]:
  """→ (indices of training groups sharing a digest, … sharing a name key) with ``evaluation``."""
  at_digest, at_name = digests(evaluation), {name_key(g) for g in evaluation}
  by_digest = [i for i, g in enumerate(train)
               if any(v.get("digest") in at_digest for v in g["variants"].values())]
  by_name = [i for i, g in enumerate(train) if name_key(g) in at_name]
  return by_digest, by_name


def report(train: list[dict], evaluation: list[dict]) -> dict:
  """Counts of shared groups by each key (and by either), the training functions whose text
  is in the benchmark, and the first few shared ``source:name`` of each key."""
  return _report(train, evaluation, *shared(train, evaluation))


def without(train: list[dict], evaluation: list[dict]) -> tuple[list[dict], dict]:
  """→ (the training groups that share nothing with ``evaluation``, the report before removal,
  which also lists every group dropped as ``dropped``: ``source:name``)."""
  by_digest, by_name = shared(train, evaluation)
  drop = set(by_digest) | set(by_name)
  rep = _report(train, evaluation, by_digest, by_name)
  rep["dropped"] = [_label(train[i]) for i in sorted(drop)]
  return [g for i, g in enumerate(train) if i not in drop], rep


def _report(train: list[dict], evaluation: list[dict], by_digest: list[int],
            by_name: list[int]) -> dict:
  at_digest = digests(evaluation)
  return {
      "train_groups": len(train), "bench_groups": len(evaluation),
      "shared_by_digest": len(by_digest), "shared_by_name": len(by_name),
      "shared_either": len(set(by_digest) | set(by_name)),
      "train_functions_with_bench_digest": sum(
          v.get("digest") in at_digest for g in train for v in g["variants"].values()),
      "examples_by_digest": [_label(train[i]) for i in by_digest[:EXAMPLES]],
      "examples_by_name": [_label(train[i]) for i in by_name[:EXAMPLES]],
  }


def _label(group: dict) -> str:
  return f"{group['source']}:{group['name']}"


def summary_line(rep: dict) -> str:
  """One line: how many training groups the benchmark shares, by each key, with examples."""
  ex = rep["examples_by_digest"][:3] + rep["examples_by_name"][:3]
  return (f"{rep['shared_by_digest']} training groups share a function text (digest) and "
          f"{rep['shared_by_name']} a source file + function name with the benchmark "
          f"({rep['shared_either']} of {rep['train_groups']} in all)"
          + (f", e.g. {', '.join(dict.fromkeys(ex))}" if ex else ""))


def duplicates(groups: list[dict]) -> list[int]:
  """Indices of groups that share a function text (digest) with an earlier group of the same
  file: one function #included into several sources (pycryptodome's DES3.c includes DES.c).
  Two such groups are the same function under two names, so a contrastive batch holding both
  would push a function away from itself."""
  seen: set[str] = set()
  out = []
  for i, g in enumerate(groups):
    mine = {v["digest"] for v in g["variants"].values() if v.get("digest")}
    if mine & seen:
      out.append(i)
      continue
    seen |= mine
  return out
