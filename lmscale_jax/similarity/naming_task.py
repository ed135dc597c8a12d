"""Function naming, a task anyone can rebuild: a function's code → its developer-given name, as
sub-tokens, from ELF files' symbol tables and the similarity corpora's function-groups files,
split by library so that every test name comes from a project never trained on
(``lmscale naming-build``).

* Examples: every named function of each ``--elf`` file (:mod:`lmscale_jax.prep.elf.
  elf_functions`, symbols only: the same text ``lmscale embed`` reads) and every group of each
  ``--bench`` file (:mod:`lmscale_jax.similarity.function_groups`), one variant per group
  (``variants="one"``: the first in the order of sha256("{seed}:{source}:{name}:{variant}"), a
  seeded mix of compilers and levels) or all of them (``"all"``). The label: the symbol's
  normalised name and its sub-tokens (:mod:`lmscale_jax.similarity.symbol_names`); a function
  whose name the rules drop, or under ``min_instructions`` instructions, is counted by reason.
* The library: an ELF file's DT_SONAME, else its file name, without ``.so…`` and a dotted
  version (``libz.so.1.2.13`` → ``libz``); a group's source's first directory
  (:func:`lmscale_jax.similarity.provenance.library_of`, ``lz4-4.3.3``).
* The split: :func:`lmscale_jax.similarity.provenance.split_libraries` over each library's
  number of functions (not examples, so ``"one"`` and ``"all"`` split alike): no library on
  both sides, all variants of a function on one. No function text on both sides: a training
  example whose text digest is in the test split is dropped, as is a repeated (digest, name)
  within a split; both counted.

The task directory (written atomically, task.json last): ``train.jsonl`` and ``test.jsonl``,
one ``{"text", "name", "tokens", "library", "function", "binary", "calls"}`` per line
(``function``: the raw symbol; ``binary``: the ELF file, or ``source:variant``; ``calls``, ELF
examples only: the names the function calls that its file shows stripped, imports and the
file's exports, :mod:`lmscale_jax.prep.elf.call_names`), sorted; ``task.json``: the input
files and their sha256, the rules, the split, counts, what was dropped and why, the training
split's token counts (functions per sub-token) and the share of test tokens never seen in
training. No date: one seed and the same files give byte-identical directories.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re

from lmscale_jax.errors import UserError
from lmscale_jax.prep.elf import call_names, elf_corpus, elf_functions
from lmscale_jax.prep.elf.pretokenize import NEXT
from lmscale_jax.similarity import function_groups, provenance, symbol_names
from lmscale_jax.store import file_io

FORMAT = "lmscale_jax.naming_task/1"
TEST_FRACTION = 0.25
MIN_INSTRUCTIONS = 8  # the similarity corpora's own floor, so both sources agree
VARIANTS = ("one", "all")
SPLITS = provenance.SPLITS
FIELDS = ("text", "name", "tokens", "library", "function", "binary", "calls")
DROP_REASONS = ("unnamed", "generated", "cpp_mangled", "no_letters", "too_small")
RULE = ("by library (ELF: soname or file name without .so and version; function groups: the "
        "source's first directory): libraries in the order of sha256('{seed}:{library}'), each "
        "to test if that brings test nearer test_fraction of the functions; training examples "
        "whose text digest is in test dropped, and a repeated (digest, name) within a split")
_SO_VERSION = re.compile(r"\.so(\.[0-9.]*)?$|[-.]\d+(\.\d+)+$")


class NamingError(UserError, ValueError):
  """Bad input or arguments of a naming task's build."""


def _rank(*parts) -> str:
  return hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()


# --------------------------------------------------------------------------- the inputs
def check_inputs(elf: list[str], bench: list[str]) -> None:
  """Every file is what its option takes, and none is given twice: before any is read."""
  paths = elf + bench
  if len(set(map(os.path.realpath, paths))) < len(paths):
    raise NamingError(f"{' '.join(paths)}: a file is given twice")
  if not paths:
    raise NamingError("no input: give ELF files (--elf) or function-groups files (--bench)")
  for path in elf:
    with open(path, "rb") as f:
      if f.read(4) != elf_corpus.ELF_MAGIC:
        raise NamingError(f"--elf {path}: not an ELF file (function-groups files go to "
                          "--bench)")
  for path in bench:
    if not function_groups.is_file(path):
      raise NamingError(f"--bench {path}: not a function-groups file (build one with lmscale "
                        "similarity-build; ELF files go to --elf)")


def library_of_elf(path: str) -> str:
  """An ELF file's library: its DT_SONAME, else its file name, without ``.so…`` and a dotted
  version."""
  from elftools.elf.dynamic import DynamicSection
  from elftools.elf.elffile import ELFFile

  name = os.path.basename(path)
  with open(path, "rb") as f:
    for sec in ELFFile(f).iter_sections():
      if isinstance(sec, DynamicSection):
        name = next((t.soname for t in sec.iter_tags() if t.entry.d_tag == "DT_SONAME"), name)
  while (short := _SO_VERSION.sub("", name)) != name and short:
    name = short
  return name


def instructions(text: str) -> int:
  return text.count(f" {NEXT} ") + 1 if text else 0


def labelled(symbol: str, text: str, library: str, binary: str, unit: str,
             dropped: collections.Counter, min_instructions: int) -> dict | None:
  """One example, or None with its reason counted in ``dropped``."""
  name, why = symbol_names.normalise(symbol)
  if name is None:
    dropped[why] += 1
    return None
  if instructions(text) < min_instructions:
    dropped["too_small"] += 1
    return None
  return {"text": text, "name": name, "tokens": symbol_names.tokens(name), "library": library,
          "function": symbol, "binary": binary, "unit": unit,
          "digest": elf_corpus.function_digest(text).hex()}


def elf_examples(path: str, dropped, min_instructions: int) -> tuple[list[dict], dict]:
  library = library_of_elf(path)
  functions = elf_functions.functions(path, source="symbols")
  rows = [labelled(fn.name, fn.text, library, path, f"{path}:{fn.name}", dropped,
                   min_instructions)
          for fn in functions]
  calls = call_names.called(path)  # what each calls, as the stripped file still shows it
  for fn, r in zip(functions, rows):
    if r:
      r["calls"] = calls.get(fn.address, [])
  rows = [r for r in rows if r]
  return rows, {"file": path, "kind": "elf", "library": library, "functions": len(rows)}


def chosen_variants(group: dict, variants: str, seed: int) -> list[str]:
  names = sorted(group["variants"])
  if variants == "all":
    return names
  return [min(names, key=lambda v: _rank(seed, group["source"], group["name"], v))]


def bench_examples(path: str, dropped, min_instructions: int, variants: str,
                   seed: int) -> tuple[list[dict], dict]:
  header, groups = function_groups.load(path)
  prefixes = {m["prefix"] for m in header.get("merged", []) if m.get("prefix")}
  rows = []
  for g in groups:
    lib = provenance.library_of(g["source"], prefixes)
    for v in chosen_variants(g, variants, seed):
      rows.append(labelled(g["name"], g["variants"][v]["text"], lib, f"{g['source']}:{v}",
                           f"{g['source']}:{g['name']}", dropped, min_instructions))
  rows = [r for r in rows if r]
  return rows, {"file": path, "kind": "bench", "functions": len({r["unit"] for r in rows}),
                "examples": len(rows)}


# --------------------------------------------------------------------------- the split
def _order(r: dict) -> tuple:
  return r["library"], r["binary"], r["function"], r["name"], r["digest"]


def dedup(rows: list[dict], seen: set[str], dropped: collections.Counter, why: str) -> list:
  """``rows`` without those whose digest is in ``seen`` and repeats of a (digest, name)."""
  kept, pairs = [], set()
  for r in rows:
    if r["digest"] in seen:
      dropped[why] += 1
    elif (r["digest"], r["name"]) in pairs:
      dropped["repeated_within_split"] += 1
    else:
      pairs.add((r["digest"], r["name"]))
      kept.append(r)
  return kept


def split(rows: list[dict], test_fraction: float, seed: int) -> tuple[dict, set, dict]:
  """→ ({"train": rows, "test": rows}, the test libraries, text duplicates dropped)."""
  units = {(r["library"], r["unit"]) for r in rows}
  sizes = collections.Counter(lib for lib, _ in units)
  test_libs = provenance.split_libraries(sizes, test_fraction, seed)
  rows = sorted(rows, key=_order)
  dropped = collections.Counter()
  test = dedup([r for r in rows if r["library"] in test_libs], set(), dropped, "")
  train = dedup([r for r in rows if r["library"] not in test_libs],
                {r["digest"] for r in test}, dropped, "train_text_in_test")
  return {"train": train, "test": test}, test_libs, {
      k: dropped[k] for k in ("train_text_in_test", "repeated_within_split")}


# --------------------------------------------------------------------------- the task
def read_all(elf, bench, *, variants, seed, min_instructions):
  """→ (examples, the sources' entries, drop counts by reason)."""
  dropped = collections.Counter({k: 0 for k in DROP_REASONS})
  rows, sources = [], []
  for path in elf:
    got, entry = elf_examples(path, dropped, min_instructions)
    rows += got
    sources.append(entry)
  for path in bench:
    got, entry = bench_examples(path, dropped, min_instructions, variants, seed)
    rows += got
    sources.append(entry)
  return rows, sources, dict(dropped)


def build(elf: list[str], bench: list[str], *, test_fraction: float = TEST_FRACTION,
          seed: int = 0, variants: str = "one", min_instructions: int = MIN_INSTRUCTIONS):
  """ELF and function-groups files → ({"train": examples, "test": examples}, task.json's
  dict)."""
  if variants not in VARIANTS:
    raise NamingError(f"--variants {variants}: expected one of {', '.join(VARIANTS)}")
  check_inputs(elf, bench)
  rows, sources, dropped = read_all(elf, bench, variants=variants, seed=seed,
                                    min_instructions=min_instructions)
  files = " ".join(elf + bench)
  if not rows:
    raise NamingError(f"{files}: no usable function names (dropped: "
                      + ", ".join(f"{k} {v}" for k, v in dropped.items())
                      + "); give files with symbol tables (unstripped) of C functions")
  splits, test_libs, duplicates = split(rows, test_fraction, seed)
  for name in SPLITS:
    if not splits[name]:
      raise NamingError(f"{files}: the {name} split is empty after dropping texts of the "
                        f"other split ({duplicates}): its libraries copy the others' code "
                        "(try another --seed)")
  for entry in sources:
    entry["sha256"] = file_io.sha256_file(entry["file"])
  return splits, describe(rows, splits, test_libs, sources, dropped, duplicates,
                          dict(test_fraction=test_fraction, seed=seed, variants=variants,
                               min_instructions=min_instructions))


def describe(rows, splits, test_libs, sources, dropped, duplicates, options) -> dict:
  built = len(splits["test"]) / (len(splits["train"]) + len(splits["test"]))
  return {"format": FORMAT, "task": "function naming: a function's name (sub-tokens) from its "
          "code", "sources": sources,
          "options": {k: options[k] for k in ("variants", "min_instructions")},
          "normalisation": symbol_names.RULES,
          "split": {"rule": RULE, "seed": options["seed"],
                    "test_fraction": options["test_fraction"],
                    "test_fraction_built": round(built, 4),
                    **{f"{s}_libraries": sorted({r["library"] for r in splits[s]})
                       for s in SPLITS}},
          "libraries": libraries(rows, splits, test_libs),
          "counts": {s: split_counts(splits[s]) for s in SPLITS},
          "dropped": dropped, "text_duplicates_dropped": duplicates,
          "train_token_counts": token_counts(splits["train"]),
          "unseen_in_training": unseen(splits)}


def libraries(rows: list[dict], splits: dict, test_libs: set[str]) -> dict:
  built = collections.Counter(r["library"] for s in SPLITS for r in splits[s])
  found = collections.Counter(r["library"] for r in rows)
  return {lib: {"split": "test" if lib in test_libs else "train",
                "examples_found": found[lib], "examples": built[lib]} for lib in sorted(found)}


def split_counts(rows: list[dict]) -> dict:
  return {"examples": len(rows), "functions": len({(r["library"], r["unit"]) for r in rows}),
          "names": len({r["name"] for r in rows}),
          "tokens": len({t for r in rows for t in r["tokens"]}),
          "mean_tokens_per_name": round(sum(len(set(r["tokens"])) for r in rows)
                                        / max(len(rows), 1), 3),
          "examples_calling_names": sum(bool(r.get("calls")) for r in rows)}


def token_counts(rows: list[dict]) -> dict[str, int]:
  """Training examples whose name holds each sub-token (a set per example)."""
  return dict(collections.Counter(t for r in rows for t in set(r["tokens"])))


def unseen(splits: dict) -> dict:
  """How much of the test split's names no training name holds: a ceiling on any method that
  only suggests tokens it has seen (a closed vocabulary)."""
  seen = {t for r in splits["train"] for t in r["tokens"]}
  test = [set(r["tokens"]) for r in splits["test"]]
  total = sum(map(len, test))
  distinct = set().union(*test)
  return {"test_token_share": round(sum(len(t - seen) for t in test) / total, 4),
          "test_distinct_token_share": round(len(distinct - seen) / len(distinct), 4),
          "test_examples_with_unseen_token_share": round(
              sum(bool(t - seen) for t in test) / len(test), 4)}


def check_output(path: str) -> None:
  provenance.check_output(path)


def write(path: str, splits: dict, task: dict) -> None:
  """The task directory, each file atomic, task.json last (a directory without it is a build
  that did not finish)."""
  check_output(path)
  os.makedirs(path, exist_ok=True)
  for s in SPLITS:
    lines = [json.dumps({k: r[k] for k in FIELDS if k in r}, sort_keys=True)
             for r in splits[s]]
    file_io.atomic_write_bytes(os.path.join(path, f"{s}.jsonl"),
                               ("\n".join(lines) + "\n").encode())
  file_io.atomic_write_json(os.path.join(path, "task.json"), task)


def summary_line(task: dict) -> str:
  c, sp, u = task["counts"], task["split"], task["unseen_in_training"]
  return (f"{c['train']['examples']} training and {c['test']['examples']} test examples "
          f"({sp['test_fraction_built']:.0%} test), {len(sp['train_libraries'])} + "
          f"{len(sp['test_libraries'])} libraries; {u['test_token_share']:.1%} of test tokens "
          "never in training; dropped: "
          + ", ".join(f"{k} {v}" for k, v in {**task["dropped"],
                                               **task["text_duplicates_dropped"]}.items()))
