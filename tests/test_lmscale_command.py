"""The installed ``lmscale`` command (lmscale_jax/cli/lmscale.py): its help lists every
subcommand in the order a user meets them without importing JAX, each subcommand's own
``--help`` is its usage, and a mistyped subcommand is one line naming the closest one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lmscale_jax.cli import lmscale
from tests.helpers import ROOT

# The order of docs/design.md's "lmscale" table: data, training, using the model, similarity,
# the scaling study, the cluster.
SUBCOMMANDS = ["prepare", "inspect-data", "stage", "gpu-check", "max-batch", "train",
               "evaluate", "inspect", "fill-mask", "embed", "index", "search", "serve", "export-hf",
               "import-hf", "similarity-sources", "similarity-build", "similarity-leakage",
               "finetune", "classify", "name", "eval-similarity", "provenance-build", "naming-build",
               "sweep", "report", "scaling-model", "storage-model", "run-state"]
INSTALLED = os.path.join(os.path.dirname(sys.executable), "lmscale")


def run(*args, timeout=120):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run(list(args), cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=timeout, stdin=subprocess.DEVNULL)


def test_the_command_is_installed_beside_the_interpreter():
  assert os.access(INSTALLED, os.X_OK), f"{INSTALLED}: run bash tools/setup.sh"
  r = run(INSTALLED, "--help")
  assert r.returncode == 0 and r.stdout.startswith("usage: lmscale"), r.stderr[-2000:]


def test_help_lists_every_subcommand_in_order_without_importing_jax():
  probe = ("import sys; from lmscale_jax.cli import lmscale; code = lmscale.main(['--help']); "
           "sys.exit(code or 10 * any(m == 'jax' or m.startswith('jax.') for m in sys.modules))")
  r = run(sys.executable, "-c", probe)
  assert r.returncode == 0, (r.returncode, r.stderr[-2000:])  # 10: jax was imported
  listed = [line.split()[0] for line in r.stdout.splitlines() if line.startswith("  ")]
  assert listed == SUBCOMMANDS
  assert [name for _, commands in lmscale.GROUPS for name, _, _ in commands] == SUBCOMMANDS


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_each_subcommand_help_is_its_usage(name, capsys, monkeypatch):
  monkeypatch.setattr(sys, "argv", ["lmscale"])
  try:
    code = lmscale.main([name, "--help"])
  except SystemExit as e:  # argparse's --help exits 0
    code = e.code
  out = capsys.readouterr().out
  assert code in (0, None), (name, code)
  assert "usage" in out.lower() or f"lmscale {name}" in out, out[:500]


def test_an_unknown_subcommand_is_one_line_naming_the_closest():
  r = run(INSTALLED, "trian", "--workdir", "w")
  assert r.returncode == 1 and r.stdout == ""
  assert r.stderr.splitlines() == [
      "error: unknown subcommand 'trian' (did you mean 'train'?); lmscale --help lists them"]


def test_no_subcommand_is_one_line():
  r = run(INSTALLED)
  assert r.returncode == 1 and r.stderr.count("\n") == 1 and r.stderr.startswith("error: ")


def test_train_takes_mains_arguments_in_both_spellings(tmp_path):
  """``lmscale train`` runs python -m lmscale_jax.main's code: the same one-line errors, and
  --dry-run / --dry_run, --config FILE / --config=FILE alike."""
  for config, dry in ((["--config", "configs/tiny.py"], "--dry-run"),
                      ([f"--config={ROOT}/configs/tiny.py"], "--dry_run")):
    r = run(INSTALLED, "train", *config, f"--workdir={tmp_path}", "--config.train.stpes=3", dry)
    assert r.returncode == 1, r.stderr[-2000:]
    assert r.stderr.splitlines() == [
        "error: unknown config key 'config.train.stpes'; did you mean 'config.train.steps'?"]


def test_config_values_are_typed_by_the_keys_default():
  """One loader for every command line (lmscale_jax/config/loader.py)."""
  from lmscale_jax.config import loader
  from lmscale_jax.errors import ConfigError

  config = loader.load_file(os.path.join(ROOT, "configs", "tiny.py"))
  loader.apply_overrides(config, loader.split_overrides([
      "--config.data.autotune=1", "--config.train.steps=7", "--config.train.learning_rate=3e-4",
      "--config.train.schedule", "cosine", "--config.init_from=hf_dir"])[0])
  assert (config.data.autotune, config.train.steps, config.train.learning_rate,
          config.train.schedule, config.init_from) == (True, 7, 3e-4, "cosine", "hf_dir")
  assert loader.parse_value((1, 2), "3,4", "k") == (3, 4)
  for item, message in (
      (("train.steps", "1e3"), "--config.train.steps=1e3: expected an integer (no decimal"),
      (("data.autotune", "yes"), "--config.data.autotune=yes: expected true or false"),
      (("train.learning_rate", "fast"), "--config.train.learning_rate=fast: expected a number"),
      (("train.stepz", "3"), "unknown config key 'config.train.stepz'; did you mean "
                             "'config.train.steps'?"),
      (("checkpoint.async", "0"), "--config.checkpoint.async was renamed "
                                  "--config.checkpoint.async_save")):
    with pytest.raises(ConfigError) as e:
      loader.apply_overrides(config, [item])
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
