"""The C libraries of the similarity corpora, pinned: three spec files shipped in ``specs/`` (the
format: :mod:`lmscale_jax.similarity.spec`), each library with the source distribution (sdist)
of the package index that bundles it, where inside it, and the flags it needs to build one
file at a time. Three named sets, disjoint by library:

* ``eval`` (``specs/eval.toml``): the benchmark (:mod:`lmscale_jax.evals.retrieval`).
* ``eval2`` (``specs/eval2.toml``): a second held-out benchmark, other kinds of code than
  ``eval``'s, so that a claim is checked on two sets of libraries, not one.
* ``eval3`` (``specs/eval3.toml``): a benchmark large enough for pool 10,000 (more than
  10,000 groups at both ends of O0↔O3 per compiler): large C code bases of other kinds again.
* ``train`` (``specs/train.toml``): contrastive fine-tuning pairs (the same source function
  compiled two ways); why these libraries, and not others, is said in the file.

Fetched by lmscale similarity-sources, built by lmscale similarity-build --set.
"""

from __future__ import annotations

import os

from lmscale_jax.similarity import spec

SPECS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "specs")
SETS = {name: os.path.join(SPECS, f"{name}.toml") for name in ("eval", "eval2", "eval3", "train")}


def load_set(name: str) -> list[spec.Library]:
  return spec.load(SETS[name])


def by_package(libs=None) -> dict[str, list[spec.Library]]:
  """NAME==VERSION (lower case) → its libraries (one sdist may bundle several: pysam's
  htslib, samtools and bcftools), over ``libs`` or every set."""
  libs = libs if libs is not None else [lib for name in SETS for lib in load_set(name)]
  out: dict[str, list[spec.Library]] = {}
  for lib in libs:
    if lib.package:
      out.setdefault(lib.package.lower(), []).append(lib)
  return out


def shown(path: str) -> str:
  """A spec file's name for a benchmark's header: a shipped one from the repository's root
  (not this machine's path), any other as given."""
  here = os.path.dirname(os.path.dirname(os.path.dirname(SPECS)))
  inside = os.path.commonpath([os.path.abspath(path), SPECS]) == SPECS
  return os.path.relpath(os.path.abspath(path), here) if inside else path
