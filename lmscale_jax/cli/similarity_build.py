"""Build a binary-code similarity benchmark: C sources compiled at several optimisation levels.

  lmscale similarity-build --sources DIR… --output BENCH.jsonl
      [--compilers gcc,clang] [--opt O0,O1,O2,O3] [--cflags "-DNDEBUG"] [--workers N]
  lmscale similarity-build --spec LIBS.toml… [--from DIR] --output F
  lmscale similarity-build --set eval|eval2|eval3|train [--from bench_sources] --output F
      [--disjoint-from BENCH.jsonl …]
  lmscale similarity-build --merge A.jsonl B.jsonl… --output C.jsonl

Every .c file under the sources is built on its own as a shared object per compiler and level
(-fPIC -shared -nostartfiles, symbols kept, real optimisation), its named functions are taken
as preparation takes them, and functions are grouped by source file + name. Functions under
--min-instructions (8) are dropped and counted. A compiler that is not installed or a file
that does not build is one line on stderr; the rest goes on. The format: the docstring of
lmscale_jax/similarity/function_groups.py. --spec builds the libraries a spec file lists, their roots
under --from, each with its own source directories, exclusions, include-only files, include
directories, defines and generated headers (lmscale_jax/similarity/spec.py;
docs/similarity-corpora.md has the recipe); --set builds a shipped one
(lmscale_jax/similarity/specs/, fetched by lmscale similarity-sources). --merge writes
several benchmark files as one (lmscale_jax/similarity/merge.py). --disjoint-from drops every
group that shares a function text or a source file + function name with that benchmark
(lmscale_jax/similarity/leakage.py) and records how many. On a terminal, a bar on stderr
counts the objects compiled (--progress / --no-progress: always / never).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from lmscale_jax.cli import args
from lmscale_jax.similarity import function_groups
from lmscale_jax.similarity import leakage as similarity_leakage
from lmscale_jax.similarity import merge as similarity_merge
from lmscale_jax.similarity import sources as similarity_sources
from lmscale_jax.similarity import spec as similarity_spec


def parser():
  p = args.Parser(prog="lmscale similarity-build", description=__doc__.splitlines()[0])
  what = p.add_mutually_exclusive_group(required=True)
  what.add_argument("--sources", nargs="+", metavar="DIR",
                    help="directories (or .c files) of C sources")
  what.add_argument("--spec", action="append", type=args.input_file, metavar="LIBS.toml",
                    help="repeatable: a spec file of libraries (lmscale_jax/similarity/"
                    "spec.py), their roots under --from")
  what.add_argument("--set", choices=list(similarity_sources.SETS),
                    help="a pinned set of lmscale similarity-sources, unpacked under --from")
  what.add_argument("--merge", nargs="+", type=args.input_file, metavar="BENCH",
                    help="benchmark files to write as one (same compilers and levels)")
  p.add_argument("--from", dest="from_dir", default="bench_sources", metavar="DIR",
                 help="(--set, --spec) where the libraries' roots are")
  p.add_argument("--disjoint-from", nargs="+", default=[], type=args.input_file, metavar="BENCH",
                 help="drop the groups this benchmark shares (by function text or by source "
                 "file + function name): for a training file")
  p.add_argument("--drop-duplicates", action="store_true",
                 help="keep one of the groups that share a function text (a function "
                 "#included into several files): for a training file")
  # Its own earlier output: a function-groups file (no other command writes one).
  p.add_argument("--output", required=True, metavar="BENCH", help="the benchmark file to write",
                 type=args.OutputFile(owns=lambda path, _: function_groups.is_file(path)))
  p.add_argument("--compilers", default="gcc,clang", help="comma-separated (default gcc,clang)")
  p.add_argument("--opt", default="O0,O1,O2,O3", help="comma-separated optimisation levels")
  p.add_argument("--cflags", default="", help="(--sources) extra compiler flags, one "
                 "shell-quoted string")
  p.add_argument("--min-instructions", type=args.number(int, 1, 1 << 20),
                 default=function_groups.MIN_INSTRUCTIONS)
  p.add_argument("--workers", type=args.number(int, 0, 1024), default=0,
                 help="compilers run at once (0 = all cores)")
  p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                 help="a bar on stderr counting the objects compiled (default: on a terminal)")
  return p


def main(argv=None) -> int:
  a = parser().parse_args(argv)
  shown = a.progress if a.progress is not None else sys.stderr.isatty()

  def go() -> int:
    against = [(path, disjoint_from(path)) for path in a.disjoint_from]  # before the build
    header, groups = build(a, shown)
    groups = refine(a, header, groups, against)
    function_groups.write(a.output, header, groups)
    report(a, header)
    return 0

  return args.guarded(go, f"nothing was written to {a.output}")


def refine(a, header: dict, groups: list[dict], against: list) -> list[dict]:
  """--drop-duplicates, then --disjoint-from; the header records what each dropped."""
  if a.drop_duplicates:  # added to what a merged file's inputs dropped
    dup = set(similarity_leakage.duplicates(groups))
    stats = header["stats"]
    stats["duplicate_groups_dropped"] = stats.get("duplicate_groups_dropped", 0) + len(dup)
    header["duplicates_dropped"] = header.get("duplicates_dropped", []) + [
        f"{groups[i]['source']}:{groups[i]['name']}" for i in sorted(dup)]
    groups = [g for i, g in enumerate(groups) if i not in dup]
  for path, bench in against:
    groups, rep = similarity_leakage.without(groups, bench)
    print(f"{path}: {similarity_leakage.summary_line(rep)}; dropped from {a.output}")
    header.setdefault("leakage", []).append({"against": path, "dropped": rep})
  if against:
    header["stats"]["leakage_groups_dropped"] = sum(
        x["dropped"]["shared_either"] for x in header["leakage"])
  if not groups:
    raise function_groups.FunctionGroupsError(f"no group is left to write to {a.output} (all shared "
                                      "with --disjoint-from or duplicates)")
  function_groups.restat(header, groups)
  return groups


def disjoint_from(path: str) -> list[dict]:
  if not os.path.isfile(path):
    raise function_groups.FunctionGroupsError(f"--disjoint-from {path}: no such file (build the "
                                      "benchmark first)")
  return function_groups.load(path)[1]


def build(a, shown: bool) -> tuple:
  kw = dict(workers=a.workers, min_instructions=a.min_instructions, say=sayer(shown),
            progress=shown)
  compilers, levels = [c for c in a.compilers.split(",") if c], [o for o in a.opt.split(",") if o]
  if a.cflags and not a.sources:
    raise function_groups.FunctionGroupsError("--cflags is for --sources: a spec's libraries have "
                                      "their own (its cflags and defines keys)")
  if a.merge:
    return similarity_merge.merge(a.merge)
  if a.set:
    return function_groups.build_set(a.set, a.from_dir, compilers, levels, **kw)
  if a.spec:
    libs = [lib for path in a.spec for lib in similarity_spec.load(path)]
    return function_groups.build_specs(libs, a.from_dir, compilers, levels, **kw)
  return function_groups.build(a.sources, compilers, levels, cflags=shlex.split(a.cflags), **kw)


def sayer(shown: bool):
  """One line on stderr; with a bar, written between its redraws (tqdm.write), not into it."""
  if not shown:
    return lambda line: print(line, file=sys.stderr)
  from tqdm import tqdm

  return lambda line: tqdm.write(line, file=sys.stderr)


def report(a, header: dict) -> None:
  s = header["stats"]
  print(f"wrote {a.output}: {s['groups']} functions in {s['functions']} compiled variants "
        f"({', '.join(header['variants'])}) from {s['sources']} sources; dropped "
        f"{s['too_small_dropped']} under {header['min_instructions']} instructions, "
        f"{s['fragments_dropped']} fragments, {s['single_variant_groups_dropped']} found "
        f"in one variant only; {s['objects_failed']} objects failed to build")
  print(f"per variant: {', '.join(f'{v} {n}' for v, n in s['per_variant'].items())}; "
        f"{s['pairs']} positive pairs; groups at O0 and O3: "
        f"{', '.join(f'{cc} {n}' for cc, n in s['groups_at_O0_and_O3'].items()) or 'n/a'}")


if __name__ == "__main__":
  sys.exit(main())
