"""The shipped configs reach a user of the installed command: ``--config tiny`` by name, in a
non-editable install of the wheel, from a directory that is no checkout (issue 56, item 1)."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import sysconfig

import pytest

from lmscale_jax.config import loader
from lmscale_jax.errors import ConfigError
from tests.helpers import ROOT, make_synthetic_dataset

SHIPPED = ["bert120m", "bert350m", "tiny", "undertale_medium"]


def test_every_file_in_configs_is_shipped_by_its_name():
  names = sorted(n.removesuffix(".py") for n in os.listdir(os.path.join(ROOT, "configs"))
                 if n.endswith(".py") and not n.startswith("_"))
  assert names == SHIPPED
  assert sorted(loader.shipped()) == SHIPPED


@pytest.mark.parametrize("name", ["tiny", "tiny.py"])
def test_a_shipped_name_loads_the_same_config_as_its_file(name):
  by_name = loader.load_file(name)
  by_file = loader.load_file(os.path.join(ROOT, "configs", "tiny.py"))
  assert by_name.to_dict() == by_file.to_dict()
  assert by_name.model.layers == 2


def test_an_existing_file_wins_over_a_shipped_name(tmp_path, monkeypatch):
  (tmp_path / "tiny.py").write_text(
      "from lmscale_jax.config import defaults\n"
      "def get_config():\n  c = defaults.get_base_config()\n  c.model.layers = 7\n  return c\n")
  monkeypatch.chdir(tmp_path)
  assert loader.load_file("tiny.py").model.layers == 7
  assert loader.load_file("tiny").model.layers == 2  # no file "tiny": the shipped one


def test_an_unknown_config_is_one_line_listing_every_shipped_name(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ConfigError) as e:
    loader.load_file("configs/tiny.py")  # the checkout's path, from elsewhere
  assert str(e.value) == (
      "--config=configs/tiny.py: no such file, and no shipped config of that name (shipped: "
      "bert120m, bert350m, tiny, undertale_medium; e.g. --config tiny, or a file of your own "
      "with a get_config())")


def _pip(*args, cwd=None):
  r = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                     cwd=cwd, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
  """A fresh venv with the wheel installed (not editable), then its dependencies borrowed from
  this environment through a path file (site-packages' own .pth files, the editable install's
  finder among them, are not read from there): what `pip install .` leaves, in seconds. The
  path file comes after the install: pip, seeing this environment's lmscale_jax through it,
  uninstalled the developer's editable install (so did --prefix)."""
  top = tmp_path_factory.mktemp("installed")
  _pip("wheel", "--no-deps", "-q", "-w", str(top / "wheel"), ROOT)
  venv = top / "venv"
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
  wheel = glob.glob(str(top / "wheel" / "lmscale_jax-*.whl"))[0]
  _pip("--python", str(venv / "bin" / "python"), "install", "--no-deps", "-q", wheel)
  site = glob.glob(str(venv / "lib" / "python3.*" / "site-packages"))[0]
  with open(os.path.join(site, "borrowed_dependencies.pth"), "w") as f:
    f.write(sysconfig.get_paths()["purelib"] + "\n")
  return venv


def _developer_install() -> list[str]:
  site = sysconfig.get_paths()["purelib"]
  return sorted(n for n in os.listdir(site) if "lmscale_jax" in n)


@pytest.fixture(scope="module", autouse=True)
def developer_install_kept():
  before = _developer_install()
  yield
  assert _developer_install() == before  # the test's pip never touches this environment


def test_the_wheel_installs_the_configs_and_train_finds_tiny_by_name(installed, tmp_path):
  outside = tmp_path / "elsewhere"
  make_synthetic_dataset(str(outside / "data"))
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("PYTHONPATH", None)
  where = subprocess.run([str(installed / "bin" / "python"), "-c",
                          "import lmscale_jax.configs as c; print(c.__file__)"],
                         cwd=outside, env=env, capture_output=True, text=True, timeout=60)
  assert where.stdout.startswith(str(installed)), where.stdout + where.stderr
  r = subprocess.run([str(installed / "bin" / "lmscale"), "train", "--config", "tiny",
                      "--workdir", "w", "--config.data.path=data", "--dry_run"],
                     cwd=outside, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "layers" in r.stdout and "2" in r.stdout
  bad = subprocess.run([str(installed / "bin" / "lmscale"), "train", "--config",
                        "configs/tiny.py", "--workdir", "w"],
                       cwd=outside, env=env, capture_output=True, text=True, timeout=300)
  assert bad.returncode == 1
  assert bad.stderr.strip().splitlines()[-1].startswith(
      "error: --config=configs/tiny.py: no such file, and no shipped config of that name "
      "(shipped: bert120m, bert350m, tiny, undertale_medium")
