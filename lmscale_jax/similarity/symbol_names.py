"""A symbol's name as a function-naming label: normalised, or dropped with a reason, and split
into sub-tokens (the labels of ``lmscale naming-build``, the vocabulary of the naming head, the
units :mod:`lmscale_jax.evals.naming` scores).

The rules, in order (:data:`RULES`, written into each task.json):

1. the symbol version goes: ``memcpy@GLIBC_2.2.5`` and ``memcpy@@GLIBC_2.14`` → ``memcpy``;
2. dropped as generated, not named by a developer (:func:`generated`): the C runtime's start
   files (``_init``, ``_fini``, ``_start``, ``frame_dummy``, ``register_tm_clones``, …), the
   position-independent code thunks (``__x86.get_pc_thunk.bx``, ``__x86.indirect_thunk.rax``),
   C++ static initialisers (``_GLOBAL__sub_I_…``), and the unnamed functions of stripped files
   (``sub_<hex address>``, named so by :mod:`lmscale_jax.prep.elf.elf_functions`);
3. dropped: C++ mangled names (``_Z…``). Demangled, a name is a scope, template arguments and a
   parameter list, a different problem from a C function's name; the task is C's (the
   similarity corpora are C, and a distribution's C libraries export plain names);
4. compiler suffixes go, repeatedly: ``.cold``, ``.isra.N``, ``.part.N``, ``.constprop.N``,
   ``.lto_priv.N``, ``.localalias`` and a bare ``.N`` (a static local's copy): the code is
   the developer's function (or a piece of it), the name theirs;
5. leading underscores go (``__libc_malloc`` → ``libc_malloc``): reserved-namespace marks, not
   words;
6. a name left with no letter or digit is dropped.

Sub-tokens (:func:`tokens`): split at every character that is not a letter or digit, at camel
case boundaries (``inflateGetHeader`` → inflate, get, header; ``HTTPServer`` → http, server)
and between letters and digits (``sha256_update`` → sha, 256, update); lowercase; no empty
token.
"""

from __future__ import annotations

import re

GENERATED = frozenset({
    "_init", "_fini", "_start", "_dl_start", "frame_dummy", "register_tm_clones",
    "deregister_tm_clones", "__do_global_dtors_aux", "__do_global_ctors_aux",
    "__libc_csu_init", "__libc_csu_fini", "_dl_relocate_static_pie", "__stack_chk_fail_local",
    "__static_initialization_and_destruction_0", "__x86_return_thunk",
})
_GENERATED_PREFIXES = ("__x86.get_pc_thunk.", "__x86.indirect_thunk.", "_GLOBAL__sub_I_",
                       "_GLOBAL__sub_D_", "__x86_indirect_thunk_")
_UNNAMED = re.compile(r"^sub_[0-9a-f]+$")
_SUFFIX = re.compile(r"\.(cold|isra|part|constprop|lto_priv|localalias)(\.\d+)?$|\.\d+$")
_WORDS = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|[0-9]+")

RULES = [
    "symbol version removed (name@VERSION, name@@VERSION)",
    "dropped as generated: " + ", ".join(sorted(GENERATED)) + ", and names starting "
    + ", ".join(_GENERATED_PREFIXES) + "; sub_<hex> (unnamed functions of stripped files)",
    "dropped: C++ mangled names (_Z...), not demangled",
    "compiler suffixes removed, repeatedly: .cold .isra.N .part.N .constprop.N .lto_priv.N "
    ".localalias .N",
    "leading underscores removed",
    "dropped: a name with no letter or digit left",
    "sub-tokens: split at non-alphanumerics, camelCase boundaries (HTTPServer -> http server) "
    "and letter/digit boundaries; lowercased; empty tokens dropped",
]


def unversioned(symbol: str) -> str:
  return symbol.split("@", 1)[0]


def generated(name: str) -> bool:
  """Whether an unversioned symbol is the toolchain's, not a developer's (rule 2)."""
  return (name in GENERATED or name.startswith(_GENERATED_PREFIXES)
          or bool(_UNNAMED.match(name)))


def strip_suffixes(name: str) -> str:
  while (stripped := _SUFFIX.sub("", name)) != name:
    name = stripped
  return name


def normalise(symbol: str) -> tuple[str | None, str]:
  """→ (the normalised name, "") or (None, the reason it is dropped: "unnamed",
  "generated", "cpp_mangled", "no_letters")."""
  name = unversioned(symbol)
  if _UNNAMED.match(name):
    return None, "unnamed"
  if generated(name):
    return None, "generated"
  if name.startswith("_Z"):
    return None, "cpp_mangled"
  name = strip_suffixes(name).lstrip("_")
  if not tokens(name):
    return None, "no_letters"
  return name, ""


def tokens(name: str) -> list[str]:
  """The sub-tokens of a normalised name, in order, lowercase (repeats kept: the scorer makes
  sets)."""
  return [w.lower() for w in _WORDS.findall(name)]
