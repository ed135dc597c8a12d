"""A library set as a small TOML file: which C libraries a similarity benchmark is built from,
and how each builds one ``.c`` file at a time (``lmscale similarity-build --spec FILE``).
The pinned sets ``eval`` and ``train`` are such files, shipped in ``specs/``.

One ``[[library]]`` table per library; paths are relative to its ``root``, which is relative to
the directory the build is given (``--from``)::

  [[library]]
  name = "libsodium"                 # unique in the build; errors name it
  root = "libsodium-1.0.18"          # under --from (apt-get source's or an sdist's directory)
  package = "pynacl==1.6.2"          # optional: the PyPI sdist fetch_bench_sources.py fetches
  sources = ["src/libsodium"]        # directories (every .c below) or .c files
  exclude = ["*armcrypto*"]          # fnmatch patterns on paths under root: never compiled
  include_only = ["src/block_common.c"]  # compiled only where another file #includes them
  include = ["src/libsodium/include/sodium"]  # more -I (each source dir and its include/
                                     # subdirectories are on the path already)
  defines = {NDEBUG = true, SYS_BITS = 64, VERSION = '"1.0"', OFF = false}
                                     # -DNDEBUG -DSYS_BITS=64 -DVERSION="1.0" -UOFF
  cflags = ["-std=gnu99"]            # any other flags, after the defines
  about = "one line: what it is, why something is left out"

  [[library.generate]]               # a header the sources #include, written before the build
  path = "version.h"                 # as the sources #include it
  template = "src/libsodium/include/sodium/version.h.in"  # optional, under root
  vars = {VERSION = "1.0.18"}        # the template's @VERSION@ ...
  defines = {HAVE_X = 1}             # no template: a header of these #defines; with one:
                                     # its autoheader lines "#undef HAVE_X" become #defines

Generated headers go to a private directory, first on the include path: the sources stay as
fetched. ``exclude`` and ``include_only`` differ in intent only (both keep a file from being
compiled on its own), and the header of the benchmark counts each. A bad spec is one
:class:`SpecError` naming the file, the library and the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import tomllib

from lmscale_jax.errors import UserError

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*$")
_VAR = re.compile(r"@([A-Za-z_][A-Za-z0-9_]*)@")
_UNDEF = re.compile(r"^[ \t]*#[ \t]*undef[ \t]+([A-Za-z_][A-Za-z0-9_]*)[ \t]*$", re.M)


class SpecError(UserError, ValueError):
  """A spec file that cannot be read or says something impossible."""


@dataclasses.dataclass(frozen=True)
class Generate:
  path: str                    # as the sources #include it
  template: str = ""           # under the library's root; "" = a header of ``defines``
  vars: dict = dataclasses.field(default_factory=dict)
  defines: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Library:
  name: str
  root: str                    # under the build's --from
  sources: tuple[str, ...]     # directories or .c files under root
  package: str = ""            # NAME==VERSION of its sdist on the package index, if any
  exclude: tuple[str, ...] = ()
  include_only: tuple[str, ...] = ()
  include: tuple[str, ...] = ()
  defines: dict = dataclasses.field(default_factory=dict)
  cflags: tuple[str, ...] = ()
  generate: tuple[Generate, ...] = ()
  about: str = ""
  spec: str = ""               # the file it was read from, for messages

  def flags(self) -> list[str]:
    """Its own compiler flags: the defines, then ``cflags``."""
    return [define_flag(k, v) for k, v in self.defines.items()] + list(self.cflags)

  def where(self) -> str:
    return f"{self.spec}: library {self.name!r}"


def define_flag(name: str, value) -> str:
  if value is True:
    return f"-D{name}"
  if value is False:
    return f"-U{name}"
  return f"-D{name}={value}"


# --------------------------------------------------------------------------- reading
def load(path: str) -> list[Library]:
  """The libraries of one spec file, checked (keys, types, paths), not yet their files."""
  try:
    with open(path, "rb") as f:
      doc = tomllib.load(f)
  except tomllib.TOMLDecodeError as e:
    raise SpecError(f"{path}: not valid TOML: {e}") from None
  except UnicodeDecodeError as e:
    raise SpecError(f"{path}: not valid TOML: not UTF-8 at byte {e.start}") from None
  except OSError as e:
    raise SpecError(f"{path}: cannot be read ({e.strerror})") from None
  _keys(path, doc, {"about": _text, "library": _tables}, ("library",))
  libs = [_library(path, i, t) for i, t in enumerate(doc["library"], 1)]
  unique(libs)
  return libs


def unique(libs: list[Library]) -> None:
  """Library names are unique in one build: messages and the header name libraries by them."""
  seen: dict[str, Library] = {}
  for lib in libs:
    if lib.name in seen:
      raise SpecError(f"{lib.where()}: key 'name': {seen[lib.name].spec} has a library of "
                      "this name too (rename one)")
    seen[lib.name] = lib


def _library(path: str, i: int, t: dict) -> Library:
  label = t.get("name") if isinstance(t.get("name"), str) else f"#{i}"
  where = f"{path}: library {label!r}"
  _keys(where, t, _LIBRARY, ("name", "root", "sources"))
  gens = tuple(_generate(f"{where}: generate[{j}]", g)
               for j, g in enumerate(t.get("generate", []), 1))
  tup = {k: tuple(t[k]) for k in ("sources", "exclude", "include_only", "include", "cflags")
         if k in t}
  return Library(name=t["name"], root=t["root"], package=t.get("package", ""),
                 defines=t.get("defines", {}), generate=gens, about=t.get("about", ""),
                 spec=path, **tup)


def _generate(where: str, t: dict) -> Generate:
  _keys(where, t, _GENERATE, ("path",))
  if "vars" in t and "template" not in t:
    raise SpecError(f"{where}: key 'vars': only a template has @VARS@ (add template = "
                    "\"FILE.in\", or write the values as defines)")
  if not t.get("template") and not t.get("defines"):
    raise SpecError(f"{where}: key 'defines': a header needs a template or some defines")
  return Generate(path=t["path"], template=t.get("template", ""), vars=t.get("vars", {}),
                  defines=t.get("defines", {}))


def _keys(where: str, table: dict, kinds: dict, required: tuple) -> None:
  """Unknown keys (naming the closest valid one), missing ones, then each value's type."""
  for key in table:
    if key not in kinds:
      close = difflib.get_close_matches(key, kinds, n=1)
      hint = f"did you mean {close[0]!r}?" if close else f"expected one of {', '.join(kinds)}"
      raise SpecError(f"{where}: unknown key {key!r} ({hint})")
  for key in required:
    if key not in table:
      raise SpecError(f"{where}: key {key!r} missing ({_MISSING[key]})")
  for key, value in table.items():
    if problem := kinds[key](value):
      raise SpecError(f"{where}: key {key!r}: {problem}")


# Each returns "" or what is wrong with the value.
def _text(v) -> str:
  return "" if isinstance(v, str) and v.strip() else f"expected a non-empty string, got {v!r}"


def _texts(v) -> str:
  if isinstance(v, list) and all(isinstance(x, str) and x for x in v):
    return ""
  return f"expected a list of non-empty strings, got {v!r}"


def _name(v: str) -> str:
  return "" if "/" not in v and v == v.strip() else f"{v!r}: no '/' or outer spaces in a name"


def _pin(v: str) -> str:
  ok = v.count("==") == 1 and all(v.split("=="))
  return "" if ok else f"{v!r}: expected NAME==VERSION (a pinned release on the package index)"


def _path(v, *banned: str) -> str:
  """A relative path; a ``banned`` component (``..``) would leave the directory it is under
  (a root's ``..`` would name sources outside --from; a generated header's, write there)."""
  if problem := _text(v):
    return problem
  if os.path.isabs(v):
    return f"{v!r}: expected a relative path (under --from, or the library's root)"
  if any(p in banned for p in v.split("/")):
    return f"{v!r}: no '..' here (it would leave the directory the path is under)"
  return ""


def _paths(v, *banned: str, nonempty: bool = False) -> str:
  if problem := _texts(v):
    return problem
  if nonempty and not v:
    return "expected at least one path"
  return next((p for p in map(lambda x: _path(x, *banned), v) if p), "")


def _defines(v, bools: bool) -> str:
  kinds = (str, int, bool) if bools else (str, int)
  if not isinstance(v, dict):
    return f"expected a table NAME = value, got {v!r}"
  for name, value in v.items():
    if not _IDENT.match(name):
      return f"{name!r} is not a C identifier"
    if not isinstance(value, kinds) or isinstance(value, float):
      shown = "a string, an integer or true/false" if bools else "a string or an integer"
      return f"{name} = {value!r}: expected {shown}"
  return ""


def _tables(v) -> str:
  if isinstance(v, list) and all(isinstance(x, dict) for x in v):
    return ""
  return "expected an array of tables ([[…]] sections)"


_LIBRARY = {
    "name": lambda v: _text(v) or _name(v), "root": lambda v: _path(v, ".."),
    "sources": lambda v: _paths(v, "..", nonempty=True), "package": lambda v: _text(v) or _pin(v),
    "exclude": _texts, "include_only": _texts, "include": _paths,
    "defines": lambda v: _defines(v, bools=True), "cflags": _texts, "generate": _tables,
    "about": _text}
_GENERATE = {"path": lambda v: _path(v, ".."), "template": _path,
             "vars": lambda v: _defines(v, bools=False), "defines": lambda v: _defines(v, True)}
_MISSING = {"name": "a unique name for messages and the header",
            "root": "its directory under --from", "sources": "its .c directories under root",
            "library": "one [[library]] table per library", "path": "the name the sources "
            "#include"}



# --------------------------------------------------------------------------- generating
def write_headers(lib: Library, root: str, out: str) -> None:
  """Writes ``lib``'s generated headers under ``out`` (its private include directory)."""
  for j, gen in enumerate(lib.generate, 1):
    target = os.path.join(out, gen.path)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, "w", encoding="utf-8", errors="surrogateescape") as f:
      f.write(header_text(lib, gen, root, f"{lib.where()}: generate[{j}]"))


def header_text(lib: Library, gen: Generate, root: str, where: str) -> str:
  if not gen.template:
    return (f"/* {gen.path}: generated from {lib.spec}, library {lib.name} */\n"
            + "".join(_define_line(k, v) for k, v in gen.defines.items()))
  path = os.path.join(root, gen.template)
  if not os.path.isfile(path):
    raise SpecError(f"{where}: key 'template': {path}: no such file")
  with open(path, encoding="utf-8", errors="surrogateescape") as f:
    text = f.read()
  missing = sorted({m for m in _VAR.findall(text) if m not in gen.vars})
  if missing:
    raise SpecError(f"{where}: key 'vars': {gen.template} has @{missing[0]}@ and no value "
                    f"for it ({len(missing)} missing: {', '.join(missing[:5])})")
  text = _VAR.sub(lambda m: str(gen.vars[m.group(1)]), text)
  return _UNDEF.sub(lambda m: _undef_line(m, gen.defines), text)


def _undef_line(m: re.Match, defines: dict) -> str:
  """An autoheader ``#undef NAME``: defined as the spec says, else as it was."""
  name = m.group(1)
  return _define_line(name, defines[name]).rstrip("\n") if name in defines else m.group(0)


def _define_line(name: str, value) -> str:
  if value is False:
    return f"/* #undef {name} */\n"
  return f"#define {name} {1 if value is True else value}\n"
