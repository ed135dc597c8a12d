"""The compiled parts of lmscale_jax: prep/elf/_pretokens.c (x86-64 function bytes → pretoken
text) and prep/_token_ids.c (pretoken text → instruction counts, token ids, packed sequences).

Everything else is in pyproject.toml. The extensions are optional: where they cannot build (no C
compiler, no Python headers) the install still succeeds and preparation runs their pure-Python
references (pretokenize.code_pretokenizer: iced-x86; tokenize_pack, packing, store/tokenizer).
_pretokens needs no capstone headers or library at build time: it dlopens the capstone wheel's
library when first used.
"""

from setuptools import Extension, find_namespace_packages, setup

FLAGS = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"]

# configs/ (top level, where a checkout's users read and copy them) is installed as the package
# lmscale_jax.configs, so an installed `lmscale train --config tiny` finds the shipped configs by
# name (config/loader.resolve). Namespace discovery as pyproject's packages.find did: the data
# folders (model/hf_remote, serve/static) are packages too.
setup(packages=find_namespace_packages(include=["lmscale_jax*"]) + ["lmscale_jax.configs"],
      package_dir={"lmscale_jax.configs": "configs"},
      ext_modules=[
    Extension("lmscale_jax.prep.elf._pretokens", ["lmscale_jax/prep/elf/_pretokens.c"],
              extra_compile_args=FLAGS,
              libraries=["dl"],  # dlopen/dlsym (part of libc since glibc 2.34; harmless before)
              optional=True),
    Extension("lmscale_jax.prep._token_ids", ["lmscale_jax/prep/_token_ids.c"],
              extra_compile_args=FLAGS, optional=True),
])
