"""The C libraries of the similarity corpora, pinned: which source distribution (sdist) of the
package index bundles each one, where inside it, and the flags it needs to build one file at a
time. Two named sets, disjoint by library:

* ``eval``: the benchmark (:mod:`lmscale_jax.evals.retrieval`). LZ4 and Brotli (the 2026-12-01
  benchmark, unchanged), then zstd and QuickJS, so that the O0↔O3 pair holds more than 1,000
  groups and pool 1000 can be drawn.
* ``train``: contrastive fine-tuning pairs (the same source function compiled two ways). None
  of its libraries is one of ``eval``'s or bundles a copy of one (xxhash's sdist would: LZ4
  ships xxHash; pycryptodomex is pycryptodome renamed); what still matches by text or by file
  and function name is removed by :mod:`lmscale_jax.similarity.leakage`. Not taken: packages
  whose C library needs Python.h (mmh3's murmurhash3.c, bitarray, regex, ujson), has none
  (pyzstd 0.20, python-lzo), or whose sdist makes ``pip download`` build CMake from source
  (deflate: scikit-build-core's build requirement).

Fetched by tools/fetch_bench_sources.py, built by tools/build_similarity_bench.py --set.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Library:
  package: str                   # NAME==VERSION on the package index (lower-case name)
  top: str                       # the sdist's top directory once unpacked
  sources: tuple[str, ...]       # the library's C directories or files under ``top``
  include: tuple[str, ...] = ()  # more include directories under ``top``
  cflags: tuple[str, ...] = ()   # as the package's own build defines them
  exclude: tuple[str, ...] = ()  # fnmatch patterns on paths under ``top``: files not built
  about: str = ""


# Excluded files say why: an amalgamation (one file #including the others) would list every
# function twice under two source names; another CPU's code does not build here.
EVAL = (
    Library("lz4==4.3.3", "lz4-4.3.3", ("lz4libs",),
            about="LZ4, LZ4HC, LZ4F and xxHash"),
    Library("brotli==1.1.0", "Brotli-1.1.0", ("c",), cflags=("-DBROTLI_INTERNAL=",),
            about="the Brotli encoder and decoder; -DBROTLI_INTERNAL= makes the hidden "
            "internal symbols linkable one file at a time"),
    Library("zstandard==0.25.0", "zstandard-0.25.0", ("zstd",),
            about="zstd, as the package's single-file amalgamation zstd.c"),
    Library("quickjs==1.19.4", "quickjs-1.19.4", ("upstream-quickjs",),
            cflags=('-DCONFIG_VERSION="2021-03-27"', "-DCONFIG_BIGNUM"),
            about="the QuickJS engine, its regexp, unicode and bignum libraries (setup.py's "
            "defines)"),
)

TRAIN = (
    Library("pycryptodome==4.4.0", "pycryptodome-4.4.0", ("src",),
            cflags=("-DHAVE_STDINT_H", "-DHAVE_UINT128", "-DHAVE_CPUID_H",
                    "-DHAVE_POSIX_MEMALIGN", "-DHAVE_X86INTRIN_H", "-DUSE_SSE2", "-DSYS_BITS=64"),
            exclude=("src/test/*", "src/mldsa-native/*", "src/mlkem-native/*",
                     "src/hash_SHA2_*", "src/block_common.c", "src/blowfish_init.c",
                     "src/cast5.c", "src/blake2.c", "*_avx2*", "*_shani*", "*bmi2_adx*",
                     "*AESNI*", "*clmul*", "*armv8*", "*neon*", "*pmull*"),
            about="ciphers, hashes, big-number and curve arithmetic, with compiler_opt.py's "
            "defines for x86-64; left out: files that are only #included by others (templates "
            "such as hash_SHA2_template.c, block_common.c; mldsa.c and mlkem.c #include their "
            "-native directories), copies of a module built with -mavx2/-msha/-maes/... "
            "(*_avx2_bmi2.c, *_shani.c, AESNI.c, ghash_clmul.c), other CPUs' code, src/test"),
    Library("pynacl==1.6.2", "pynacl-1.6.2", ("src/libsodium/src/libsodium",),
            include=("src/libsodium/src/libsodium/include/sodium",),
            exclude=("*/sodium/version.c", "*armcrypto*"),
            about="libsodium (version.c needs configure's version.h)"),
    Library("lupa==2.8", "lupa-2.8", ("third-party/lua54",), cflags=("-U__ELF__",),
            exclude=("*/onelua.c", "*/testes/*"),
            about="Lua 5.4 (one version: Lua 5.1-5.5 share most functions; onelua.c is its "
            "amalgamation). -U__ELF__ makes luaconf.h's LUAI_FUNC plain extern, not "
            "visibility(internal), which no shared object of one file can leave undefined"),
    Library("argon2-cffi-bindings==26.2.0", "argon2_cffi_bindings-26.2.0",
            ("extras/libargon2/src",), include=("extras/libargon2/include",),
            about="the Argon2 reference library with its BLAKE2b"),
    Library("cmarkgfm==2025.10.22", "cmarkgfm-2025.10.22", ("third_party/cmark",),
            include=("generated/unix", "third_party/cmark/src", "third_party/cmark/extensions"),
            about="cmark-gfm, GitHub's CommonMark parser, and its extensions"),
    Library("hiredis==3.5.0", "hiredis-3.5.0", ("vendor/hiredis",),
            exclude=("*/test.c", "*/ssl.c"),
            about="the hiredis client (ssl.c needs OpenSSL's headers; test.c its adapters)"),
    Library("pyppmd==1.3.1", "pyppmd-1.3.1", ("src/lib",), include=("src/lib/ppmd",),
            about="7-Zip's PPMd7/PPMd8 coders and the package's threaded buffer"),
    Library("tree-sitter==0.26.1", "tree_sitter-0.26.1", ("tree_sitter/core/lib/src",),
            include=("tree_sitter/core/lib/include",), exclude=("*/src/lib.c",),
            about="the tree-sitter runtime (lib.c is its amalgamation)"),
    Library("zopfli==0.4.3", "zopfli-0.4.3", ("zopfli/src/zopfli",),
            about="Zopfli, a deflate encoder"),
)

SETS = {"eval": EVAL, "train": TRAIN}


def by_package() -> dict[str, Library]:
  """NAME==VERSION → its library, over every set."""
  return {lib.package: lib for libs in SETS.values() for lib in libs}
