"""The compiled part of lmscale_jax: prep/_pretokens.c (x86-64 function bytes → pretoken text).

Everything else is in pyproject.toml. The extension is optional: where it cannot build (no C
compiler, no Python headers) the install still succeeds and preparation decodes with the
pure-Python iced-x86 path (pretokenize.code_pretokenizer). It needs no capstone headers or
library at build time: it dlopens the capstone wheel's library when first used.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "lmscale_jax.prep._pretokens", ["lmscale_jax/prep/_pretokens.c"],
    extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
    libraries=["dl"],  # dlopen/dlsym (part of libc since glibc 2.34; harmless before)
    optional=True)])
