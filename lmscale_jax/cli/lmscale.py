"""The ``lmscale`` command: ``lmscale SUBCOMMAND [ARGS…]`` runs one module of
:mod:`lmscale_jax.cli` (its ``main(argv) -> exit code``), imported only when that subcommand
runs, so ``lmscale --help`` answers without importing JAX (about 2 s on a busy CPU).
"""

from __future__ import annotations

import difflib
import importlib
import sys

from lmscale_jax import exits  # the codes, without cli/args (it imports numpy)

# (group, [(subcommand, module, summary)]), in the order a user meets them.
GROUPS = (
    ("data", [
        ("prepare", "lmscale_jax.cli.prepare",
         "binary|text|cluster: a tokenised, sharded dataset from ELF files or text"),
        ("inspect-data", "lmscale_jax.cli.inspect_data",
         "a dataset's splits, shards and records (--verify: checksums)"),
        ("stage", "lmscale_jax.cli.stage", "copy a dataset to node-local storage"),
    ]),
    ("training", [
        ("gpu-check", "lmscale_jax.cli.gpu_check",
         "what this machine's accelerators run, and how fast"),
        ("max-batch", "lmscale_jax.cli.max_batch", "the largest batch that fits a device"),
        ("train", "lmscale_jax.cli.train",
         "pretrain: --config CONFIG --workdir DIR [--config.KEY=VALUE …]"),
        ("evaluate", "lmscale_jax.cli.evaluate", "a checkpoint's loss on a split"),
        ("inspect", "lmscale_jax.cli.inspect_checkpoint", "a workdir's checkpoints and config"),
    ]),
    ("using the model", [
        ("fill-mask", "lmscale_jax.cli.fill_mask", "the model's guesses for [MASK] tokens"),
        ("embed", "lmscale_jax.cli.embed", "embeddings of functions or texts"),
        ("index", "lmscale_jax.cli.index", "an on-disk function index of ELF binaries"),
        ("search", "lmscale_jax.cli.search",
         "the indexed functions most like a function or text"),
        ("serve", "lmscale_jax.cli.serve",
         "an HTTP API and a web page: fill-mask, embed and search"),
        ("export-hf", "lmscale_jax.cli.export_hf", "a checkpoint as a Hugging Face directory"),
        ("import-hf", "lmscale_jax.cli.import_hf", "a Hugging Face BERT as a start model"),
    ]),
    ("similarity", [
        ("similarity-sources", "lmscale_jax.cli.similarity_sources",
         "fetch the benchmark's pinned source trees"),
        ("similarity-build", "lmscale_jax.cli.similarity_build",
         "compile sources into a similarity benchmark"),
        ("similarity-leakage", "lmscale_jax.cli.similarity_leakage",
         "overlap between a benchmark and a training set"),
        ("finetune", "lmscale_jax.cli.finetune",
         "fine-tuning: contrastive for code similarity, --task classify or --task name"),
        ("classify", "lmscale_jax.cli.classify",
         "a classification fine-tune's accuracy and macro-F1 on a labels file"),
        ("name", "lmscale_jax.cli.name",
         "suggested names for a (stripped) binary's functions: a naming fine-tune"),
        ("eval-similarity", "lmscale_jax.cli.eval_similarity",
         "retrieval quality of a model on a benchmark"),
        ("provenance-build", "lmscale_jax.cli.provenance_build",
         "the compiler-provenance task: a labelled split by library"),
        ("naming-build", "lmscale_jax.cli.naming_build",
         "the function-naming task: names split by library"),
    ]),
    ("scaling study", [
        ("sweep", "lmscale_jax.cli.sweep", "run a grid of short training runs"),
        ("report", "lmscale_jax.cli.report", "tables and plots of a sweep's results"),
        ("scaling-model", "lmscale_jax.cli.scaling_model",
         "throughput at scale from measured runs"),
        ("storage-model", "lmscale_jax.cli.storage_model",
         "the storage bandwidth a run needs"),
    ]),
    ("cluster", [
        ("run-state", "lmscale_jax.cluster.run_state",
         "where a run stands: running, finished, failed, preempted"),
    ]),
)
MODULES = {name: module for _, commands in GROUPS for name, module, _ in commands}


def usage() -> str:
  width = max(map(len, MODULES))
  lines = ["usage: lmscale SUBCOMMAND [ARGS…]   (lmscale SUBCOMMAND --help: its arguments;"
           " lmscale --version)"]
  for group, commands in GROUPS:
    lines += ["", f"{group}:"]
    lines += [f"  {name:<{width}}  {summary}" for name, _, summary in commands]
  return "\n".join(lines)


def version() -> str:
  """The installed package's version (its metadata: no import of the package's modules)."""
  from importlib import metadata

  try:
    return metadata.version("lmscale_jax")
  except metadata.PackageNotFoundError:  # run from a checkout that was never installed
    return "unknown (lmscale_jax is not installed: pip install -e . in the checkout)"


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv and argv[0] in ("-h", "--help", "help"):
    print(usage())
    return 0
  if argv and argv[0] in ("-V", "--version"):
    print(f"lmscale {version()}")
    return 0
  if not argv:
    return exits.error_line("a subcommand is required; lmscale --help lists them",
                            exits.EXIT_USAGE)
  name, rest = argv[0], argv[1:]
  if name not in MODULES:
    near = difflib.get_close_matches(name, list(MODULES), n=1)
    return exits.error_line(f"unknown subcommand {name!r}"
                            + (f" (did you mean {near[0]!r}?)" if near else "")
                            + "; lmscale --help lists them", exits.EXIT_USAGE)
  sys.argv[0] = f"lmscale {name}"  # argparse's prog for a module's own parser
  code = importlib.import_module(MODULES[name]).main(rest)
  return code if isinstance(code, int) else (0 if code is None else exits.EXIT_USAGE)


if __name__ == "__main__":
  sys.exit(main())
