"""Spec files, merges and progress of the similarity benchmark's builder, as a user runs them:
tiny C libraries written here, compiled by the machine's gcc (real objects, real functions),
lmscale similarity-build and lmscale similarity-sources as subprocesses.

The libraries guard what the spec must do with ``#error``: a file that is only ever
``#include``d fails when compiled on its own, an excluded file fails anywhere, a source fails
without its library's define or its generated headers, and the other library fails if given
this one's flags. So a build with no failed object is the proof that each key did its part.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from lmscale_jax.similarity import function_groups
from lmscale_jax.similarity import spec as similarity_spec
from tests.helpers import ROOT
from tests.test_similarity import SOURCES, tool

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

LOOP = """  unsigned long h = seed;
  for (int i = 0; i < n; i++) { h = (h ^ (unsigned char)s[i]) * 1099511628211ul; h ^= h >> 13; }
  return h;
"""
TINY = {  # libtiny-1.0 under --from
    "src/core.c": '#define CORE_INCLUDES_ME\n#include "helpers.c"\n'
                  "#ifndef SCALE\n#error SCALE is the library's define\n#endif\n"
                  "unsigned long core_hash(const char *s, int n, unsigned long seed) {\n"
                  + LOOP + "}\n"
                  "long core_scale(const long *v, int n) {\n"
                  "  long t = 0;\n  for (int i = 0; i < n; i++) t += v[i] * SCALE - (v[i] >> 2);\n"
                  "  return t + helper_mix(t, n);\n}\n",
    "src/helpers.c": "#ifndef CORE_INCLUDES_ME\n#error only through core.c\n#endif\n"
                     "long helper_mix(long a, int n) {\n"
                     "  for (int i = 0; i < n; i++) a = a * 31 + (a >> 7) - i;\n"
                     "  return a ^ (a >> 17);\n}\n",
    "src/feature.c": '#include "config.h"\n#include <tiny_limits.h>\n'
                     "#ifndef HAVE_FEATURE\n#error config.h is generated\n#endif\n"
                     "int feature_count(const int *v, int n) {\n  int c = 0;\n"
                     "  for (int i = 0; i < n && i < TINY_MAX; i++) c += v[i] > FEATURE_LEVEL;\n"
                     "  return c * 3 + n;\n}\n"
                     "const char *feature_version(void) { return TINY_VERSION; }\n",
    "src/arm/neon.c": "#error ARM only\n",
    "config.h.in": "/* Define to 1 with the feature */\n#undef HAVE_FEATURE\n"
                   "#undef HAVE_OTHER\n#define FEATURE_LEVEL @LEVEL@\n"
                   '#define TINY_VERSION "@VERSION@"\n',
}
OTHER = {  # other-2.0: its own util.c:init, built with its own define and none of libtiny's
    "lib/util.c": "#ifdef SCALE\n#error libtiny's flags\n#endif\n"
                  "unsigned long init(const char *s, int n, unsigned long seed) {\n"
                  "  seed += OTHER_MODE;\n" + LOOP + "}\n",
}
SPEC = """
about = "two tiny libraries"

[[library]]
name = "tiny"
root = "libtiny-1.0"
sources = ["src"]
exclude = ["src/arm/*"]
include_only = ["src/helpers.c"]
defines = {SCALE = 3}

[[library.generate]]
path = "config.h"
template = "config.h.in"
vars = {LEVEL = 2, VERSION = "1.0"}
defines = {HAVE_FEATURE = true}

[[library.generate]]
path = "tiny_limits.h"
defines = {TINY_MAX = 64}

[[library]]
name = "other"
root = "other-2.0"
sources = ["lib"]
defines = {OTHER_MODE = 2}
"""


def write_tree(where, files: dict) -> None:
  for rel, text in files.items():
    os.makedirs(os.path.dirname(os.path.join(where, rel)), exist_ok=True)
    with open(os.path.join(where, rel), "w") as f:
      f.write(text)


@pytest.fixture
def libs(tmp_path):
  """--from with libtiny-1.0 and other-2.0, and their spec."""
  write_tree(tmp_path / "src" / "libtiny-1.0", TINY)
  write_tree(tmp_path / "src" / "other-2.0", OTHER)
  (tmp_path / "libs.toml").write_text(SPEC)
  return tmp_path


def build(tmp_path, out, *args):
  return tool("build_similarity_bench.py", "--from", tmp_path / "src", "--output", out,
              "--compilers", "gcc", "--opt", "O0,O1", "--workers", "1", *args)


def groups_of(path) -> list[dict]:
  return function_groups.load(str(path))[1]


def test_a_spec_compiles_each_library_with_its_own_flags_headers_and_files(libs):
  out = libs / "b.jsonl"
  r = build(libs, out, "--spec", libs / "libs.toml")
  assert r.returncode == 0, r.stderr
  assert r.stderr == ""  # no object failed: every #error guard held
  header = json.loads(open(out).readline())
  assert header["stats"]["objects_failed"] == 0 and header["stats"]["objects_built"] == 6
  assert header["sources"] == ["libtiny-1.0/src/core.c", "libtiny-1.0/src/feature.c",
                               "other-2.0/lib/util.c"]
  tiny, other = header["libraries"]
  assert tiny["files"] == {"compiled": 2, "exclude": 1, "include_only": 1}
  assert tiny["cflags"] == ["-DSCALE=3"] and other["cflags"] == ["-DOTHER_MODE=2"]
  assert tiny["generate"] == ["config.h", "tiny_limits.h"]
  assert header["specs"] == [str(libs / "libs.toml")]
  got = {(g["source"], g["name"]) for g in groups_of(out)}
  # helper_mix, defined in the include-only file, is there through its includer
  assert {("libtiny-1.0/src/core.c", "helper_mix"), ("libtiny-1.0/src/core.c", "core_scale"),
          ("libtiny-1.0/src/feature.c", "feature_count"), ("other-2.0/lib/util.c", "init")} <= got
  assert not any("helpers.c" in s or "neon.c" in s for s, _ in got)
  assert not os.path.exists(libs / "src" / "libtiny-1.0" / "config.h")  # the sources as fetched


def test_a_pattern_matching_no_file_is_one_line_and_the_build_goes_on(libs):
  spec = (libs / "libs.toml").read_text().replace('exclude = ["src/arm/*"]',
                                                  'exclude = ["src/arm/*", "src/nosuch*.c"]')
  (libs / "libs.toml").write_text(spec)
  r = build(libs, libs / "b.jsonl", "--spec", libs / "libs.toml")
  assert r.returncode == 0, r.stderr
  assert r.stderr.splitlines() == [
      f"{libs / 'libs.toml'}: library 'tiny': key 'exclude': 'src/nosuch*.c' matches no .c "
      "file under its sources (a typo, or another version of the library?)"]


@pytest.mark.parametrize("edit, says", [
    (lambda s: s.replace('name = "other"', 'name = "tiny"'),
     "library 'tiny': key 'name': {spec} has a library of this name too"),
    (lambda s: s.replace("exclude =", "exlude ="),
     "library 'tiny': unknown key 'exlude' (did you mean 'exclude'?)"),
    (lambda s: s.replace('root = "other-2.0"\n', ""),
     "library 'other': key 'root' missing (its directory under --from)"),
    (lambda s: s.replace('sources = ["lib"]', 'sources = "lib"'),
     "library 'other': key 'sources': expected a list of non-empty strings, got 'lib'"),
    (lambda s: s.replace('root = "other-2.0"', 'root = "/opt/other-2.0"'),
     "library 'other': key 'root': '/opt/other-2.0': expected a relative path"),
    (lambda s: s.replace('path = "config.h"', 'path = "../config.h"'),
     "library 'tiny': generate[1]: key 'path': '../config.h': no '..' here"),
    (lambda s: s.replace("{OTHER_MODE = 2}", "{OTHER_MODE = 2.5}"),
     "library 'other': key 'defines': OTHER_MODE = 2.5: expected a string, an integer or "
     "true/false"),
    (lambda s: s.replace('template = "config.h.in"\n', ""),
     "library 'tiny': generate[1]: key 'vars': only a template has @VARS@"),
    (lambda s: s.replace("LEVEL = 2, ", ""),
     "library 'tiny': generate[1]: key 'vars': config.h.in has @LEVEL@ and no value for it"),
    (lambda s: s.replace('sources = ["lib"]', 'sources = ["lib", "nosuch"]'),
     "library 'other': key 'sources': 'nosuch': no such file or directory under"),
    (lambda s: s.replace('root = "other-2.0"', 'root = "other-3.0"'),
     "other-3.0: no such directory ({spec}: library 'other': key 'root': unpack its sources"),
    (lambda s: s.replace("[[library]]\nname", "[[library]\nname", 1),
     "not valid TOML: Expected ']]' at the end of an array declaration (at line 4, column 10)"),
], ids=["duplicate name", "unknown key", "missing root", "sources type", "absolute root",
        "header outside", "define value", "vars alone", "template var", "no source dir",
        "no root", "toml syntax"])
def test_a_bad_spec_is_one_error_line_naming_the_file_library_and_key(libs, edit, says):
  spec = libs / "libs.toml"
  spec.write_text(edit(SPEC))
  r = build(libs, libs / "b.jsonl", "--spec", spec)
  assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
  assert r.stderr.startswith("error: ") and says.format(spec=spec) in r.stderr, r.stderr
  assert str(spec) in r.stderr and not (libs / "b.jsonl").exists()


def test_flags_of_the_command_line_are_refused_with_a_spec(libs):
  r = build(libs, libs / "b.jsonl", "--spec", libs / "libs.toml", "--cflags=-DSCALE=3")
  assert r.returncode == 1 and r.stderr.count("\n") == 1
  assert "--cflags is for --sources" in r.stderr


def test_define_values_become_flags_and_header_lines_as_a_compiler_reads_them():
  assert [similarity_spec.define_flag(k, v) for k, v in
          {"A": True, "B": False, "C": "", "D": '"x"', "E": 64}.items()] == [
      "-DA", "-UB", "-DC=", '-DD="x"', "-DE=64"]


# --------------------------------------------------------------------------- merge
def two_libraries_named_alike(tmp_path):
  """Two libraries, each built alone from a directory src/ with its own util.c:init."""
  for lib, mult in (("alpha", 3), ("beta", 5)):
    write_tree(tmp_path / lib, {"src/util.c": (
        "long init(const long *v, int n) {\n  long t = 0;\n"
        f"  for (int i = 0; i < n; i++) t = t * {mult} + v[i] - (t >> 3);\n  return t;\n}}\n")})
    shutil.copy(os.path.join(SOURCES, "numeric.c" if lib == "alpha" else "strings.c"),
                tmp_path / lib / "src")


def test_merge_keeps_two_libraries_util_c_init_apart_and_adds_up_the_headers(tmp_path):
  two_libraries_named_alike(tmp_path)
  a, b, merged = tmp_path / "alpha.jsonl", tmp_path / "beta.jsonl", tmp_path / "all.jsonl"
  codecs = tmp_path / "codecs.jsonl"  # what beta is built disjoint from: its leakage entry
  for src, out, *extra in ((os.path.join(SOURCES, "codecs.c"), codecs),
                           (tmp_path / "alpha" / "src", a),
                           (tmp_path / "beta" / "src", b, "--disjoint-from", codecs)):
    r = tool("build_similarity_bench.py", "--sources", src, "--output", out,
             "--compilers", "gcc", "--opt", "O0,O3", "--workers", "1", *extra)
    assert r.returncode == 0, r.stderr
  r = tool("build_similarity_bench.py", "--merge", a, b, "--output", merged)
  assert r.returncode == 0, r.stderr
  (ha, ga), (hb, gb), (h, g) = (function_groups.load(str(p)) for p in (a, b, merged))
  for gs in (ga, gb):  # each input alone: src/util.c:init
    assert ("src/util.c", "init") in {(x["source"], x["name"]) for x in gs}
  keys = [(x["source"], x["name"]) for x in g]
  assert len(keys) == len(set(keys)) == len(ga) + len(gb) and keys == sorted(keys)
  assert {("alpha/src/util.c", "init"), ("beta/src/util.c", "init")} <= set(keys)
  assert h["stats"]["objects_built"] == ha["stats"]["objects_built"] + hb["stats"]["objects_built"]
  assert h["stats"]["groups"] == len(g) and h["stats"]["pairs"] == len(g)  # two variants each
  assert h["sources"] == [f"alpha/{x}" for x in ha["sources"]] + [f"beta/{x}" for x in
                                                                    hb["sources"]]
  assert h["leakage"] == [{**hb["leakage"][0], "in": str(b)}]
  assert [(m["file"], m["prefix"]) for m in h["merged"]] == [(str(a), "alpha"), (str(b), "beta")]
  assert r.stdout.startswith(f"wrote {merged}: {len(g)} functions")


def test_merge_of_other_compilers_or_levels_is_one_line(tmp_path):
  two_libraries_named_alike(tmp_path)
  a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
  for lib, out, opt in (("alpha", a, "O0,O3"), ("beta", b, "O0,O1")):
    r = tool("build_similarity_bench.py", "--sources", tmp_path / lib / "src", "--output", out,
             "--compilers", "gcc", "--opt", opt, "--workers", "1")
    assert r.returncode == 0, r.stderr
  r = tool("build_similarity_bench.py", "--merge", a, b, "--output", tmp_path / "m.jsonl")
  assert r.returncode == 1 and r.stderr.count("\n") == 1
  assert f"--merge {b}: variants gcc-O0,gcc-O1 are not {a}'s gcc-O0,gcc-O3" in r.stderr
  lines = open(a).read().splitlines()  # a's file as another gcc would have built it
  header = json.loads(lines[0])
  header["compilers"]["gcc"] = "gcc (Other) 14.1.0"
  (tmp_path / "c.jsonl").write_text("\n".join([json.dumps(header)] + lines[1:]) + "\n")
  r = tool("build_similarity_bench.py", "--merge", a, tmp_path / "c.jsonl", "--output",
           tmp_path / "m.jsonl")
  assert r.returncode == 1 and r.stderr.count("\n") == 1
  assert "compilers {'gcc': 'gcc (Other) 14.1.0'} is not" in r.stderr
  assert not (tmp_path / "m.jsonl").exists()


# --------------------------------------------------------------------------- progress
def test_progress_counts_objects_on_stderr_and_leaves_stdout_as_it_was(libs):
  out = libs / "b.jsonl"
  quiet = build(libs, out, "--spec", libs / "libs.toml", "--no-progress")
  shown = build(libs, out, "--spec", libs / "libs.toml", "--progress")
  assert quiet.returncode == shown.returncode == 0, shown.stderr
  assert shown.stdout == quiet.stdout and quiet.stderr == ""
  assert "compile: 100%" in shown.stderr and "6/6" in shown.stderr
  assert "compile:" not in shown.stdout and "6/6" not in shown.stdout


def test_fetch_progress_names_each_package_on_stderr_only(libs):
  spec = libs / "libs.toml"  # a library already unpacked under --output is not downloaded
  spec.write_text(SPEC.replace('root = "other-2.0"', 'root = "other-2.0"\npackage = "other==2.0"'))
  quiet = tool("fetch_bench_sources.py", "--output", libs / "src", "--spec", spec,
               "--no-progress")
  shown = tool("fetch_bench_sources.py", "--output", libs / "src", "--spec", spec, "--progress")
  assert quiet.returncode == shown.returncode == 0, shown.stderr
  assert shown.stdout == quiet.stdout == f"{libs / 'src' / 'other-2.0' / 'lib'}\n"
  assert quiet.stderr == "" and "1/1" in shown.stderr and "other==2.0" in shown.stderr


def test_fetch_lists_every_library_of_one_sdist_once_fetched(libs):
  """Two libraries of one package (pysam's htslib and samtools in eval3), one of them in a
  directory inside the sdist: the package is fetched once, both libraries' directories
  printed, in the spec's order."""
  spec = libs / "two.toml"
  spec.write_text('[[library]]\nname = "core"\npackage = "tiny==1.0"\nroot = "libtiny-1.0"\n'
                  'sources = ["src/core.c"]\n\n[[library]]\nname = "arm"\n'
                  'package = "tiny==1.0"\nroot = "libtiny-1.0/src"\nsources = ["arm"]\n')
  r = tool("fetch_bench_sources.py", "--output", libs / "src", "--spec", spec, "--no-progress")
  assert r.returncode == 0 and r.stderr == "", r.stderr
  top = libs / "src" / "libtiny-1.0"
  assert r.stdout == f"{top / 'src' / 'core.c'}\n{top / 'src' / 'arm'}\n"


def test_the_worked_example_of_the_docs_is_a_valid_spec(tmp_path):
  doc = open(os.path.join(ROOT, "docs", "similarity-corpora.md")).read()
  example = doc.split("```toml\n")[1].split("```")[0]
  (tmp_path / "libsodium.toml").write_text(example)
  lib, = similarity_spec.load(str(tmp_path / "libsodium.toml"))
  assert (lib.name, lib.root, lib.generate[0].path) == ("libsodium", "libsodium-1.0.18",
                                                        "version.h")
  assert lib.generate[0].vars["VERSION"] == "1.0.18"
