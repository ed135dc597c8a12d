"""Function-groups files, built on this machine: C sources → one shared object per source file,
compiler and optimisation level → named functions as pretoken text (the project's own
extraction, :mod:`lmscale_jax.prep.elf.elf_functions`) → groups of the same source function.
One format serves the similarity benchmark (evaluation) and the fine-tuning pairs (training).

A function-groups file (the ``--bench``/``--pairs`` files; JSON lines, written atomically):

* line 1, the header: ``{"format": "lmscale_jax.similarity/1", "variants": ["gcc-O0", …],
  "sources": [the source files], "compilers": {"gcc": "gcc (Debian 12.2.0…) 12.2.0"},
  "cflags": [...], "min_instructions": 8, "stats": {...}, "problems": [one line each]}``;
  ``stats`` counts what was built and dropped, and what the file holds: ``groups``,
  ``functions``, ``per_variant``, ``pairs`` (two variants of one group: the positives of
  contrastive training) and ``groups_at_O0_and_O3`` per compiler (pool N needs N). A build of
  spec files (:func:`build_specs`; a named set, :func:`build_set`, adds ``"set"``) adds
  ``"specs"`` and ``"libraries"`` (each with its directories, flags and how many files it
  compiled, excluded and left include-only); lmscale similarity-build adds
  ``"leakage"`` and ``"duplicates_dropped"`` where it removed groups
  (:mod:`lmscale_jax.similarity.leakage`), and a merge (:mod:`lmscale_jax.similarity.merge`)
  ``"merged"``;
* then one line per group (a source-level function: source file + function name, present in
  at least two variants): ``{"source": "lz4-4.3.3/lz4libs/lz4.c", "name": "LZ4_compress_fast",
  "variants": {"gcc-O0": {"text": "push rbp [NEXT] …", "instructions": 57, "digest": HEX},
  …}}``. ``digest`` is preparation's normalised-text hash (``elf_corpus.function_digest``),
  the key of the leakage check against a pretraining corpus.

Functions are compiled with real optimisation (no ``-fno-inline``), symbols kept (no strip).
GCC's clones (``foo.isra.0``, ``foo.constprop.0``) count as ``foo`` where no plain ``foo`` is
in the same object; split-off fragments (``.cold``, ``.part.N``) are dropped and counted:
they are pieces of a function, not functions.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

from lmscale_jax.errors import UserError
from lmscale_jax import progress as progress_bars
from lmscale_jax.prep.elf import elf_corpus, elf_functions
from lmscale_jax.similarity import sources as similarity_sources
from lmscale_jax.similarity import spec
from lmscale_jax.store import file_io, user_text

FORMAT = "lmscale_jax.similarity/1"
LEVELS = ("O0", "O1", "O2", "O3", "Os")
MIN_INSTRUCTIONS = 8
HEADER_CAP = 1 << 26  # bytes of line 1 read to recognise a file (its header is kilobytes)
# Shared objects without the C runtime's start files: no _init/_fini/frame_dummy, which are
# the same in every object and no function of the sources. Undefined symbols are allowed in a
# shared object, so every file links on its own (its calls to other files stay external).
BASE_FLAGS = ("-fPIC", "-shared", "-nostartfiles", "-w")
_FRAGMENT = re.compile(r"\.(cold|part\.\d+)(\.\d+)?$")
_CLONE = re.compile(r"(\.(isra|constprop|lto_priv|localalias)(\.\d+)?)+$")
COMPILE_TIMEOUT = 600


class FunctionGroupsError(UserError, ValueError):
  """Bad arguments or input of a function-groups file's build or load (the file, its sources)."""


@dataclasses.dataclass
class Source:
  path: str       # on disk
  ident: str      # the source-level file: from the root's parent, or from a set's folder
  flags: tuple = ()  # its library's own: include directories, defines


def find_sources(roots: list[str], base: str = "") -> list[Source]:
  """Every ``*.c`` under ``roots`` (a root may be a file), sorted; named relative to ``base``
  or else the root's parent, so ``lz4libs/lz4.c`` stays distinct from another root's
  ``lz4.c``."""
  out = []
  for root in roots:
    if not os.path.exists(root):
      raise FunctionGroupsError(f"--sources {root}: no such file or directory")
    root = os.path.abspath(root)
    rel_to = os.path.abspath(base) if base else os.path.dirname(root)
    paths = [root] if os.path.isfile(root) else [
        os.path.join(d, f) for d, dirs, files in _sorted_walk(root)
        for f in sorted(files)
        if f.endswith(".c") and os.path.isfile(os.path.join(d, f))]  # a FIFO: gcc would hang
    out += [Source(p, os.path.relpath(p, rel_to)) for p in paths]
  if not out:
    raise FunctionGroupsError(f"no .c files under {', '.join(roots)}")
  return out


def _sorted_walk(root: str):
  for d, dirs, files in os.walk(root):
    dirs.sort()
    yield d, dirs, files


def include_dirs(roots: list[str]) -> list[str]:
  """Each root and every ``include`` directory below it (brotli's sources include
  ``<brotli/encode.h>`` from ``c/include``)."""
  dirs = []
  for root in roots:
    root = os.path.abspath(root if os.path.isdir(root) else os.path.dirname(root))
    dirs.append(root)
    dirs += [os.path.join(d, "include") for d, sub, _ in sorted(os.walk(root))
             if "include" in sub]
  return dirs


def compiler_versions(names: list[str], say) -> dict[str, str]:
  """The compilers found (name → first line of ``--version``); a missing one is one line."""
  found = {}
  for name in names:
    exe = shutil.which(name)
    if exe is None:
      say(f"compiler {name}: not found on PATH; skipped (install it, or leave it out of "
          "--compilers)")
      continue
    r = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    found[name] = (r.stdout.splitlines() or [name])[0].strip()
  if not found:
    raise FunctionGroupsError(f"none of the compilers {', '.join(names)} is installed")
  return found


def _compile(cc: str, level: str, src: Source, out: str, flags: list[str]) -> str:
  """Compiles one source; returns '' or the one-line reason it did not build."""
  cmd = [cc, f"-{level}", *BASE_FLAGS, *flags, "-o", out, src.path]
  try:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT)
  except subprocess.TimeoutExpired:
    return f"{src.ident}: {cc} -{level} took over {COMPILE_TIMEOUT} s; skipped"
  if r.returncode == 0:
    return ""
  lines = r.stderr.strip().splitlines() or ["(no message)"]
  # The compiler's or linker's own first complaint, not collect2's summary of it.
  first = next((ln for ln in lines if ("error" in ln or "undefined reference" in ln)
                and not ln.startswith("collect2")), lines[-1])
  return f"{src.ident}: {cc} -{level} failed: {first.strip()[:300]}; skipped"


def canonical(name: str) -> str | None:
  """The source-level name of a symbol; None for a fragment (.cold, .part.N)."""
  if _FRAGMENT.search(name):
    return None
  return _CLONE.sub("", name)


def object_functions(path: str, stats: dict) -> dict[str, elf_functions.Function]:
  """Source-level name → function of one compiled object (plain names win over clones)."""
  out: dict[str, elf_functions.Function] = {}
  for fn in elf_functions.functions(path):
    name = canonical(fn.name)
    if name is None:
      stats["fragments_dropped"] += 1
      continue
    if name in out and fn.name != name:
      stats["clones_shadowed"] += 1
      continue
    out[name] = fn
  return out


def new_stats() -> dict:
  return {"sources": 0, "objects_built": 0, "objects_failed": 0, "functions_seen": 0,
          "fragments_dropped": 0, "clones_shadowed": 0, "too_small_dropped": 0,
          "single_variant_groups_dropped": 0, "groups": 0, "functions": 0}


def build(roots: list[str], compilers: list[str], levels: list[str], *, cflags=(),
          workers: int = 0, min_instructions: int = MIN_INSTRUCTIONS, say=print,
          progress: bool = False) -> tuple:
  """→ (header, groups): see the module docstring. ``say`` gets one line per problem."""
  check_levels(levels)
  sources = find_sources(roots)
  flags = (*cflags, *(f"-I{d}" for d in include_dirs(roots)))
  for s in sources:
    s.flags = flags
  header, kept = build_sources(sources, compilers, levels, workers=workers,
                               min_instructions=min_instructions, say=say,
                               what=", ".join(roots), progress=progress)
  header["cflags"] = list(BASE_FLAGS) + list(cflags)
  return header, kept


def build_set(name: str, where: str, compilers: list[str], levels: list[str], **kw) -> tuple:
  """A named set of :mod:`lmscale_jax.similarity.sources` (a shipped spec file), unpacked
  under ``where`` → (header, groups), the header naming the set."""
  if name not in similarity_sources.SETS:
    raise FunctionGroupsError(f"--set {name}: expected one of {', '.join(similarity_sources.SETS)}")
  header, kept = build_specs(similarity_sources.load_set(name), where, compilers, levels,
                             fetch_with=f"--set {name}", **kw)
  header["set"] = name
  return header, kept


def build_specs(libs: list[spec.Library], where: str, compilers: list[str], levels: list[str],
                *, fetch_with: str = "", **kw) -> tuple:
  """The libraries of spec files (:mod:`lmscale_jax.similarity.spec`), their roots under
  ``where`` → (header, groups); each library builds with its own flags and generated headers,
  each source is named from ``where`` down (``zstandard-0.25.0/zstd/zstd.c``), so two
  libraries' ``util.c`` stay two files. ``fetch_with`` names the fetch's option in the line
  for a library not there yet (default: its spec file)."""
  check_levels(levels)
  spec.unique(libs)
  with tempfile.TemporaryDirectory(prefix="function-groups-headers-") as headers:
    sources, files = [], []
    for i, lib in enumerate(libs):
      mine, counts = library_sources(lib, where, os.path.join(headers, str(i)),
                                     fetch_with or f"--spec {lib.spec}", kw.get("say", print))
      sources += mine
      files.append(counts)
    header, kept = build_sources(sources, compilers, levels, what=f"the libraries under {where}",
                                 **kw)
  header["specs"] = list(dict.fromkeys(similarity_sources.shown(lib.spec) for lib in libs))
  header["libraries"] = [describe(lib, n) for lib, n in zip(libs, files)]
  return header, kept


def describe(lib: spec.Library, files: dict) -> dict:
  """A library as the benchmark's header records it, with how many of its files were compiled,
  excluded and include-only."""
  return {"name": lib.name, "package": lib.package, "root": lib.root,
          "sources": [f"{lib.root}/{x}" for x in lib.sources], "cflags": lib.flags(),
          "include": list(lib.include), "exclude": list(lib.exclude),
          "include_only": list(lib.include_only), "generate": [g.path for g in lib.generate],
          "about": lib.about, "spec": similarity_sources.shown(lib.spec), "files": files}


def library_sources(lib: spec.Library, where: str, headers: str, fetch_with: str,
                    say) -> tuple[list[Source], dict]:
  """One library's ``.c`` files to compile, each with the library's flags: its defines and
  cflags, its generated headers (written to ``headers``), each source directory with the
  ``include`` directories below it, then its own ``include``s. → (sources, counts)."""
  root = library_root(lib, where, fetch_with)
  roots = [checked(lib, "sources", root, x, os.path.exists) for x in lib.sources]
  include = [checked(lib, "include", root, x, os.path.isdir) for x in lib.include]
  sources, counts = split(lib, root, find_sources(roots, base=where), say)
  generated = []
  if lib.generate:
    spec.write_headers(lib, root, headers)
    generated = [f"-I{headers}"]  # first -I: before a stale copy in an include directory
  flags = (*lib.flags(), *generated, *(f"-I{d}" for d in include_dirs(roots)),
           *(f"-I{os.path.abspath(d)}" for d in include))
  for s in sources:
    s.flags = flags
  return sources, counts


def library_root(lib: spec.Library, where: str, fetch_with: str) -> str:
  root = os.path.join(where, lib.root)
  if os.path.isdir(root):
    return root
  if lib.package:
    raise FunctionGroupsError(f"{root}: no such directory ({lib.name}: fetch it first: "
                     f"lmscale similarity-sources {fetch_with} --output {where})")
  raise FunctionGroupsError(f"{root}: no such directory ({lib.where()}: key 'root': unpack its "
                   "sources there, e.g. with apt-get source, or fix root or --from)")


def checked(lib: spec.Library, key: str, root: str, rel: str, test) -> str:
  path = os.path.join(root, rel)
  if not test(path):
    what = "directory" if test is os.path.isdir else "file or directory"
    raise FunctionGroupsError(f"{lib.where()}: key {key!r}: {rel!r}: no such {what} under {root}")
  return path


def split(lib: spec.Library, root: str, found: list[Source], say) -> tuple[list[Source], dict]:
  """The sources to compile, leaving out ``exclude`` and ``include_only`` files (patterns on
  paths under the root; one that matches no file is said: a typo, or another version)."""
  rel = {s.path: os.path.relpath(s.path, os.path.abspath(root)) for s in found}
  for key in ("exclude", "include_only"):
    for pattern in getattr(lib, key):
      if not any(fnmatch.fnmatchcase(r, pattern) for r in rel.values()):
        say(f"{lib.where()}: key {key!r}: {pattern!r} matches no .c file under its sources "
            "(a typo, or another version of the library?)")
  kind = {path: _kind(lib, r) for path, r in rel.items()}
  counts = {k: sum(v == k for v in kind.values()) for k in ("compiled", "exclude",
                                                            "include_only")}
  if not counts["compiled"]:
    raise FunctionGroupsError(f"{lib.where()}: no .c file left to compile under {root} (all "
                     f"{len(found)} are exclude or include_only)")
  return [s for s in found if kind[s.path] == "compiled"], counts


def _kind(lib: spec.Library, rel: str) -> str:
  for key in ("exclude", "include_only"):
    if any(fnmatch.fnmatchcase(rel, p) for p in getattr(lib, key)):
      return key
  return "compiled"


def check_levels(levels: list[str]) -> None:
  for lv in levels:
    if lv not in LEVELS:
      raise FunctionGroupsError(f"--opt {lv}: expected some of {','.join(LEVELS)}")


def build_sources(sources: list[Source], compilers: list[str], levels: list[str], *,
                  what: str, workers: int = 0, min_instructions: int = MIN_INSTRUCTIONS,
                  say=print, progress: bool = False) -> tuple:
  """Compiles every source per compiler and level (each with its own flags) → (header, groups);
  the header's ``cflags`` are the ones every source shares. ``progress``: a bar on stderr
  counting the objects compiled (``say`` must then write between its redraws)."""
  found = compiler_versions(compilers, say)
  variants = [f"{cc}-{lv}" for cc in found for lv in levels]
  stats, problems = new_stats(), []
  stats["sources"] = len(sources)
  groups: dict[tuple[str, str], dict] = {}
  with tempfile.TemporaryDirectory(prefix="function-groups-") as tmp:
    jobs = [(cc, lv, i, s) for cc in found for lv in levels for i, s in enumerate(sources)]
    bar = progress_bars.bar(progress, total=len(jobs), desc="compile", unit="obj",
                            file=sys.stderr)
    with concurrent.futures.ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
      futures = [pool.submit(_compile, cc, lv, s, os.path.join(tmp, f"{cc}-{lv}-{i}.so"),
                             list(s.flags)) for cc, lv, i, s in jobs]
      for (cc, lv, i, s), fut in zip(jobs, futures):
        problem = fut.result()
        bar.update()
        if problem:
          stats["objects_failed"] += 1
          problems.append(problem)
          say(problem)
          continue
        stats["objects_built"] += 1
        obj = os.path.join(tmp, f"{cc}-{lv}-{i}.so")
        _add_object(groups, obj, s, f"{cc}-{lv}", min_instructions, stats)
        os.remove(obj)  # a set's objects add up to gigabytes of /tmp
    bar.close()
  kept = []
  for key in sorted(groups):
    if len(groups[key]) < 2:
      stats["single_variant_groups_dropped"] += 1
      continue
    kept.append({"source": key[0], "name": key[1],
                 "variants": {v: groups[key][v] for v in variants if v in groups[key]}})
  if not kept:
    raise FunctionGroupsError(f"no function of {what} was built in two variants with "
                     f">= {min_instructions} instructions ({stats})")
  header = {"format": FORMAT, "variants": variants, "compilers": found,
            "cflags": list(BASE_FLAGS), "min_instructions": min_instructions,
            "sources": [s.ident for s in sources], "stats": stats, "problems": problems}
  restat(header, kept)
  return header, kept


def restat(header: dict, groups: list[dict]) -> None:
  """The header's counts of what the file holds (again, after groups were removed): groups,
  functions, functions per variant, positive pairs (two variants of one group), and per
  compiler the groups at both -O0 and -O3 (the hardest pair; pool N needs N of them)."""
  stats = header["stats"]
  stats["groups"] = len(groups)
  stats["functions"] = sum(len(g["variants"]) for g in groups)
  stats["per_variant"] = {v: sum(v in g["variants"] for g in groups) for v in header["variants"]}
  stats["pairs"] = sum(len(g["variants"]) * (len(g["variants"]) - 1) // 2 for g in groups)
  stats["groups_at_O0_and_O3"] = {
      cc: sum(f"{cc}-O0" in g["variants"] and f"{cc}-O3" in g["variants"] for g in groups)
      for cc in header["compilers"]
      if {f"{cc}-O0", f"{cc}-O3"} <= set(header["variants"])}


def _add_object(groups: dict, path: str, src: Source, variant: str, min_instructions: int,
                stats: dict) -> None:
  for name, fn in object_functions(path, stats).items():
    stats["functions_seen"] += 1
    n = len(fn.instructions)
    if n < min_instructions:
      stats["too_small_dropped"] += 1
      continue
    groups.setdefault((src.ident, name), {})[variant] = {
        "text": fn.text, "instructions": n,
        "digest": elf_corpus.function_digest(fn.text).hex()}


# --------------------------------------------------------------------------- the file
def write(path: str, header: dict, groups: list[dict]) -> None:
  lines = [json.dumps(header, sort_keys=True)] + [json.dumps(g, sort_keys=True) for g in groups]
  file_io.atomic_write_bytes(path, ("\n".join(lines) + "\n").encode())


def is_file(path: str) -> bool:
  """Whether ``path`` is a function-groups file: its first line, a JSON object with this
  format. lmscale similarity-build recognises its own earlier output so (none other writes
  one), read no further than that line (a cap: an ELF or a video is no line of JSON)."""
  try:
    with open(path, "rb") as f:
      line = f.readline(HEADER_CAP) if f.read(1) == b"{" else b""
    header = json.loads(b"{" + line) if line.endswith(b"\n") else None
  except (OSError, ValueError):
    return False
  return isinstance(header, dict) and header.get("format") == FORMAT


def _line(path: str, number: int, line: str) -> dict:
  """One line's JSON object (the header or a group)."""
  try:
    doc = user_text.parse_json(line, f"{path}:{number}")
  except json.JSONDecodeError as e:
    raise FunctionGroupsError(f"{path}:{number}: malformed JSON ({e})") from None
  if not isinstance(doc, dict):
    raise FunctionGroupsError(f"{path}:{number}: a JSON {type(doc).__name__}, expected an "
                              "object")
  return doc


def load(path: str) -> tuple[dict, list[dict]]:
  if not os.path.isfile(path):
    raise FunctionGroupsError(f"--bench {path}: no such file (build one with "
                     "lmscale similarity-build)")
  # Strict UTF-8, every string valid Unicode, no line too deep (store/user_text): the texts
  # reach the tokenizer, which refuses a lone surrogate mid-run.
  lines = [(i, ln) for i, ln in enumerate(user_text.read_file(path).split("\n"), 1)
           if ln.strip()]
  header = _line(path, *lines[0]) if lines else {}
  if header.get("format") != FORMAT:
    raise FunctionGroupsError(f"{path}: not a similarity benchmark (line 1 has format "
                              f"{header.get('format')!r}, expected {FORMAT!r})")
  groups = []
  for i, line in lines[1:]:
    g = _line(path, i, line)
    if not isinstance(g.get("variants"), dict) or not all(
        isinstance(v, dict) and isinstance(v.get("text"), str) for v in g["variants"].values()):
      raise FunctionGroupsError(f"{path}:{i}: a group without variants {{name: {{text: …}}}}")
    groups.append(g)
  if not groups:
    raise FunctionGroupsError(f"{path}: no function groups")
  return header, groups
