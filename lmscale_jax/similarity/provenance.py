"""Compiler provenance, a classification task anyone can rebuild: which compiler and
optimisation level (the variant, "gcc-O2") produced a function, from the function-groups files
of the similarity corpora (:mod:`lmscale_jax.similarity.function_groups`), split by library so
that every test function comes from a library the classifier never saw
(``lmscale provenance-build``).

* One example per (group, variant): the variant's pretoken text, labelled with the variant's
  name. The labels are the variants every file holds (or ``variants``, those asked for): a
  label only some files' libraries carry would be told by its library; task.json names the
  variants left out.
* A group's library is the first directory of its ``source``, the directory a build names its
  sources from: a spec build's library root (``lz4-4.3.3/lz4libs/lz4.c`` → ``lz4-4.3.3``), a
  ``--sources DIR`` build's DIR; a merge's file-stem prefix (header ``merged``) is skipped
  first, and a source without a directory is its own library. The same root in two files is
  one library. The header's ``libraries`` give a root its spec name (task.json ``libraries``).
* The split: libraries in the order of sha256("{seed}:{library}"); each goes to the test split
  if that brings the test split's examples nearer ``test_fraction`` of all, else to training
  (the first library in that order to the test split if none did, the last to training if all
  did): no library is on both sides, and a seed gives one split whatever the files' order.
* No function text on both sides: a training example whose digest (the normalised-text hash)
  is also in the test split is dropped (vendored code: xxhash is in lz4 and zstd), as is a
  second example of one (digest, label) within a split; both counted. Training gives the
  text up, not the test split: the test split stays what the library split made it (a
  library that is a copy of a training one would otherwise vanish from it), at the cost of a
  few training examples. A text with several labels
  (gcc-O2 and gcc-O3 emitting the same code) stays: the task is that ambiguous, and task.json
  counts such texts.
* ``max_per_label``: at most that many examples of a label in each split, the first in the
  order of sha256("{seed}:{digest}:{label}:{source}:{name}"); the rest dropped and counted.

The task directory (written atomically, task.json last): ``train.jsonl`` and ``test.jsonl``,
one ``{"text", "label", "library", "function", "binary"}`` per line (``binary``: the source
file whose shared object held the function), sorted by library, source, function and label;
``task.json``: the input files and their sha256, the labels, the split's rule and libraries,
counts per label and split, per library, and of everything dropped. No date: one seed and the
same files give byte-identical directories.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os

from lmscale_jax.prep.elf import elf_corpus
from lmscale_jax.similarity import function_groups
from lmscale_jax.store import file_io

FORMAT = "lmscale_jax.provenance/1"
TEST_FRACTION = 0.25
SPLITS = ("train", "test")
RULE = ("by library (a source's first directory): libraries in the order of "
        "sha256('{seed}:{library}'), each to test if that brings test nearer test_fraction of "
        "the examples; training examples whose text digest is in test dropped, and a repeated "
        "(digest, label) within a split")


class ProvenanceError(function_groups.FunctionGroupsError):
  """Bad input or arguments of a compiler-provenance task's build."""


def _rank(*parts) -> str:
  return hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()


# --------------------------------------------------------------------------- the examples
def library_of(source: str, prefixes: set[str]) -> str:
  """The library of a group's source path (the module docstring's rule)."""
  head, _, rest = source.partition("/")
  if head in prefixes and rest:
    head, _, rest = rest.partition("/")
  return head


def read_inputs(paths: list[str]) -> list[tuple[str, dict, list[dict]]]:
  if len(set(map(os.path.realpath, paths))) < len(paths):
    raise ProvenanceError(f"--bench {' '.join(paths)}: a file is given twice")
  return [(path, *function_groups.load(path)) for path in paths]


def all_variants(inputs: list) -> list[str]:
  return list(dict.fromkeys(v for _, header, _ in inputs for v in header.get("variants", [])))


def common_variants(inputs: list) -> list[str]:
  """The variants every file holds: a label that only some files' libraries can carry would
  be told by its library (the training pairs add -Os, the benchmarks do not)."""
  return [v for v in all_variants(inputs)
          if all(v in header.get("variants", []) for _, header, _ in inputs)]


def examples_of(inputs: list, variants: list[str] | None = None) -> tuple[list[str], list[dict]]:
  """→ (labels, one example per (group, variant) of those labels), with ``library``,
  ``source``, ``digest``."""
  labels = common_variants(inputs)
  if variants:
    if missing := [v for v in variants if v not in all_variants(inputs)]:
      raise ProvenanceError(f"--variants {','.join(missing)}: not among the files' variants "
                            f"{','.join(all_variants(inputs))}")
    labels = list(dict.fromkeys(variants))
  if len(labels) < 2:
    raise ProvenanceError(f"{' '.join(p for p, _, _ in inputs)}: {len(labels)} variant common "
                          f"to the files ({','.join(labels)}): compiler provenance needs two "
                          "classes or more (build with more --compilers or --opt)")
  out = []
  for _, header, groups in inputs:
    prefixes = {m["prefix"] for m in header.get("merged", []) if m.get("prefix")}
    for g in groups:
      lib = library_of(g["source"], prefixes)
      out += [example(g, lib, name, g["variants"][name]) for name in labels
              if name in g["variants"]]
  return labels, out


def example(group: dict, library: str, label: str, variant: dict) -> dict:
  digest = variant.get("digest") or elf_corpus.function_digest(variant["text"]).hex()
  return {"text": variant["text"], "label": label, "library": library,
          "function": group["name"], "binary": group["source"], "digest": digest}


def library_names(inputs: list) -> dict[str, str]:
  """A spec build's library root → its name (``lz4-4.3.3`` → ``lz4``)."""
  return {lib["root"].split("/")[0]: lib["name"] for _, header, _ in inputs
          for lib in header.get("libraries", []) if lib.get("root") and lib.get("name")}


# --------------------------------------------------------------------------- the split
def split_libraries(sizes: dict[str, int], test_fraction: float, seed: int) -> set[str]:
  """The test split's libraries (the module docstring's rule); ``sizes``: examples per
  library."""
  if not 0 < test_fraction < 1:
    raise ProvenanceError(f"--test-fraction {test_fraction}: expected a number between 0 and 1")
  if len(sizes) < 2:
    raise ProvenanceError(f"the files hold {len(sizes)} library ({', '.join(sizes)}): a split "
                          "by library needs at least 2")
  order = sorted(sizes, key=lambda lib: _rank(seed, lib))
  target, n, test = test_fraction * sum(sizes.values()), 0, []
  for lib in order:
    if abs(n + sizes[lib] - target) < abs(n - target):
      test.append(lib)
      n += sizes[lib]
  if not test:
    test = order[:1]
  if len(test) == len(order):
    test = test[:-1]
  return set(test)


def dedup(rows: list[dict], seen: set[str], dropped: collections.Counter, why: str) -> list[dict]:
  """``rows`` without those whose digest is in ``seen`` and repeats of a (digest, label)."""
  kept, pairs = [], set()
  for r in rows:
    if r["digest"] in seen:
      dropped[why] += 1
    elif (r["digest"], r["label"]) in pairs:
      dropped["repeated_within_split"] += 1
    else:
      pairs.add((r["digest"], r["label"]))
      kept.append(r)
  return kept


def capped(rows: list[dict], most: int | None, seed: int, dropped: collections.Counter) -> list:
  if not most:
    return rows
  order = sorted(rows, key=lambda r: _rank(seed, r["digest"], r["label"], r["binary"],
                                           r["function"]))
  taken, keep = collections.Counter(), set()
  for r in order:
    if taken[r["label"]] < most:
      taken[r["label"]] += 1
      keep.add(id(r))
  dropped["over_max_per_label"] += len(rows) - len(keep)
  return [r for r in rows if id(r) in keep]


def _order(r: dict) -> tuple:
  return r["library"], r["binary"], r["function"], r["label"], r["digest"]


def split(rows: list[dict], test_fraction: float, seed: int, max_per_label: int | None = None):
  """→ ({"train": rows, "test": rows}, the test libraries, dropped counts)."""
  test_libs = split_libraries(collections.Counter(r["library"] for r in rows), test_fraction,
                              seed)
  rows = sorted(rows, key=_order)
  dropped = collections.Counter()
  test = dedup([r for r in rows if r["library"] in test_libs], set(), dropped, "")
  train = dedup([r for r in rows if r["library"] not in test_libs], {r["digest"] for r in test},
                dropped, "train_text_in_test")
  out = {"train": capped(train, max_per_label, seed, dropped),
         "test": capped(test, max_per_label, seed, dropped)}
  return out, test_libs, {k: dropped[k] for k in ("train_text_in_test", "repeated_within_split",
                                                  "over_max_per_label")}


# --------------------------------------------------------------------------- the task
def build(paths: list[str], *, test_fraction: float = TEST_FRACTION, seed: int = 0,
          variants: list[str] | None = None, max_per_label: int | None = None):
  """Function-groups files → ({"train": examples, "test": examples}, task.json's dict)."""
  inputs = read_inputs(paths)
  labels, rows = examples_of(inputs, variants)
  splits, test_libs, dropped = split(rows, test_fraction, seed, max_per_label)
  for name in SPLITS:
    if not splits[name]:
      raise ProvenanceError(f"{' '.join(paths)}: the {name} split is empty after dropping "
                            f"texts of the other split ({dropped}): its libraries copy the "
                            "others' code (try another --seed)")
  built = len(splits["test"]) / (len(splits["train"]) + len(splits["test"]))
  task = {"format": FORMAT, "task": "compiler provenance: the variant (compiler-level) of a "
          "function", "labels": labels,
          "variants_left_out": [v for v in all_variants(inputs) if v not in labels],
          "sources": [{"file": p, "sha256": file_io.sha256_file(p), "groups": len(g),
                       "variants": h.get("variants", [])} for p, h, g in inputs],
          "split": {"rule": RULE, "seed": seed, "test_fraction": test_fraction,
                    "test_fraction_built": round(built, 4), "max_per_label": max_per_label,
                    **{f"{s}_libraries": sorted({r["library"] for r in splits[s]})
                       for s in SPLITS}},
          "libraries": libraries(rows, splits, test_libs, library_names(inputs)),
          "counts": counts(splits, labels), "dropped": dropped}
  return splits, task


def libraries(rows: list[dict], splits: dict, test_libs: set[str], names: dict) -> dict:
  built = collections.Counter(r["library"] for s in SPLITS for r in splits[s])
  found = collections.Counter(r["library"] for r in rows)
  return {lib: {"name": names.get(lib, lib), "split": "test" if lib in test_libs else "train",
                "examples_found": found[lib], "examples": built[lib]} for lib in sorted(found)}


def counts(splits: dict, labels: list[str]) -> dict:
  """Examples per split and label, and the texts of a split that carry several labels."""
  out = {}
  for s in SPLITS:
    per = collections.Counter(r["label"] for r in splits[s])
    by_text = collections.Counter(r["digest"] for r in splits[s])
    out[s] = {"examples": len(splits[s]), "per_label": {lab: per[lab] for lab in labels},
              "texts_with_several_labels": sum(n > 1 for n in by_text.values())}
  return out


def check_output(path: str) -> None:
  if os.path.isdir(path) and os.listdir(path):
    raise ProvenanceError(f"--output {path}: exists and is not empty (a task is written into a "
                          "new or empty directory)")


def write(path: str, splits: dict, task: dict) -> None:
  """The task directory, each file atomic, task.json last (a directory without it is a build
  that did not finish)."""
  check_output(path)
  os.makedirs(path, exist_ok=True)
  for s in SPLITS:
    lines = [json.dumps({k: r[k] for k in ("text", "label", "library", "function", "binary")},
                        sort_keys=True) for r in splits[s]]
    file_io.atomic_write_bytes(os.path.join(path, f"{s}.jsonl"),
                               ("\n".join(lines) + "\n").encode())
  file_io.atomic_write_json(os.path.join(path, "task.json"), task)


def summary_line(task: dict) -> str:
  c, sp = task["counts"], task["split"]
  return (f"{c['train']['examples']} training and {c['test']['examples']} test examples "
          f"({sp['test_fraction_built']:.0%} test), {len(task['labels'])} labels, "
          f"{len(sp['train_libraries'])} + {len(sp['test_libraries'])} libraries; dropped: "
          + ", ".join(f"{k} {v}" for k, v in task["dropped"].items()))
