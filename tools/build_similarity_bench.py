"""Build a binary-code similarity benchmark: C sources compiled at several optimisation levels.

  python tools/build_similarity_bench.py --sources DIR… --output BENCH.jsonl
      [--compilers gcc,clang] [--opt O0,O1,O2,O3] [--cflags "-DNDEBUG"] [--workers N]

Every .c file under the sources is built on its own as a shared object per compiler and level
(-fPIC -shared -nostartfiles, symbols kept, real optimisation), its named functions are taken
as preparation takes them, and functions are grouped by source file + name. Functions under
--min-instructions (8) are dropped and counted. A compiler that is not installed or a file
that does not build is one line on stderr; the rest goes on. The format: the docstring of
lmscale_jax/similarity_bench.py. Sources from the package index: tools/fetch_bench_sources.py.
"""

from __future__ import annotations

import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _cli  # noqa: E402
from lmscale_jax import similarity_bench  # noqa: E402


def parser():
  p = _cli.Parser(description=__doc__.splitlines()[0])
  p.add_argument("--sources", nargs="+", required=True, metavar="DIR",
                 help="directories (or .c files) of C sources")
  p.add_argument("--output", required=True, type=_cli.output_file, metavar="BENCH",
                 help="the benchmark file to write")
  p.add_argument("--compilers", default="gcc,clang", help="comma-separated (default gcc,clang)")
  p.add_argument("--opt", default="O0,O1,O2,O3", help="comma-separated optimisation levels")
  p.add_argument("--cflags", default="", help="extra compiler flags, one shell-quoted string")
  p.add_argument("--min-instructions", type=_cli.number(int, 1, 1 << 20),
                 default=similarity_bench.MIN_INSTRUCTIONS)
  p.add_argument("--workers", type=_cli.number(int, 0, 1024), default=0,
                 help="compilers run at once (0 = all cores)")
  return p


def main(argv=None) -> int:
  a = parser().parse_args(argv)

  def go() -> int:
    header, groups = similarity_bench.build(
        a.sources, [c for c in a.compilers.split(",") if c], [o for o in a.opt.split(",") if o],
        cflags=shlex.split(a.cflags), workers=a.workers, min_instructions=a.min_instructions,
        say=lambda line: print(line, file=sys.stderr))
    similarity_bench.write(a.output, header, groups)
    s = header["stats"]
    print(f"wrote {a.output}: {s['groups']} functions in {s['functions']} compiled variants "
          f"({', '.join(header['variants'])}) from {s['sources']} sources; dropped "
          f"{s['too_small_dropped']} under {a.min_instructions} instructions, "
          f"{s['fragments_dropped']} fragments, {s['single_variant_groups_dropped']} found "
          f"in one variant only; {s['objects_failed']} objects failed to build")
    return 0

  return _cli.guarded(go, f"nothing was written to {a.output}")


if __name__ == "__main__":
  sys.exit(main())
