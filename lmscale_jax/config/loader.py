"""The one config loader of every command: ``--config FILE`` (a configs/*.py with
``get_config()``, a shipped config by name — ``--config tiny`` —, or a command's own defaults
such as fine-tuning's) and ``--config.a.b=v``
overrides, each typed by the type of the key's default.

Every mistake is one :class:`ConfigError` line: a config file that does not load (naming the
file and why), an unknown key (naming the one closest key, difflib over the dotted keys), a
renamed key (``config.legacy.RENAMED``: its new name), a value that is not of the key's type
(naming key, value and the type expected). ``python -m lmscale_jax.main``, ``lmscale train``,
``lmscale finetune`` and the sweep's ``--set`` parse through here, so a value means the same on
every command line.
"""

from __future__ import annotations

import difflib
import importlib.util
import os

import ml_collections

from lmscale_jax.config import legacy
from lmscale_jax.errors import ConfigError

FLAG = "--config"
SHIPPED = "lmscale_jax.configs"  # the wheel's copy of configs/ (setup.py's package_dir)
_BOOLS = {"true": True, "false": False, "1": True, "0": False}


def shipped() -> dict[str, str]:
  """The configs that come with the package, name -> file: the installed ``lmscale_jax.configs``
  (found without importing it), else a checkout's ``configs/`` beside the package."""
  spec = importlib.util.find_spec(SHIPPED)
  folders = list(spec.submodule_search_locations or []) if spec else []
  here = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "configs")
  folder = next((f for f in folders + [here] if os.path.isdir(f)), None)
  if folder is None:
    return {}
  return {n.removesuffix(".py"): os.path.join(folder, n) for n in sorted(os.listdir(folder))
          if n.endswith(".py") and not n.startswith("_")}


def resolve(name: str) -> str:
  """``--config``'s value as a file to load: a file that exists, else a shipped config's name
  (``tiny`` or ``tiny.py``, with its ``:ARG``). Anything else is one line listing the shipped
  names: an installed ``lmscale`` has no ``configs/`` folder to point at."""
  path, colon, arg = name.partition(":")
  if os.path.isfile(path):
    return name
  known = shipped()
  stem = path.removesuffix(".py")
  if stem in known and os.sep not in path:
    return known[stem] + colon + arg
  names = ", ".join(known) or "none found"
  example = "tiny" if "tiny" in known else next(iter(known), "FILE.py")
  raise ConfigError(f"{FLAG}={name}: no such file, and no shipped config of that name (shipped: "
                    f"{names}; e.g. {FLAG} {example}, or a file of your own with a "
                    "get_config())")


def beside(root: str, name: str) -> str:
  """A relative ``--config`` read from ``root`` (a checkout: the study tools' and gpu-check's
  rule) when it is there; otherwise ``name`` as given, for :func:`resolve`."""
  path = name.partition(":")[0]
  return (os.path.join(root, name) if root and not os.path.isabs(path)
          and os.path.isfile(os.path.join(root, path)) else name)


def load_file(name: str) -> ml_collections.ConfigDict:
  """``name``'s ``get_config()`` (a file, or a shipped config's name: :func:`resolve`);
  ``FILE.py:ARG`` calls ``get_config(ARG)`` (as ml_collections' config_flags did). A config
  file is user code: any failure in it is its author's to fix, one line naming the file."""
  path, _, arg = resolve(name).partition(":")
  try:
    stem = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(f"lmscale_config_{stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(arg) if arg else module.get_config()
  except Exception as e:
    why = str(e) if isinstance(e, OSError) else f"{type(e).__name__}: {_last_line(e)}"
    raise ConfigError(f"{FLAG}={name}: cannot load the config file {path} ({why})") from None
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(f"{FLAG}={name}: get_config() returned a {type(config).__name__}, "
                      "expected an ml_collections.ConfigDict")
  return config


def _last_line(e: BaseException) -> str:
  lines = [line.strip() for line in str(e).splitlines() if line.strip()]
  return lines[-1] if lines else type(e).__name__


def split_overrides(argv: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
  """``argv`` -> ``([(dotted key, text), …], the other arguments)``: each ``--config.a.b=v``
  (or ``--config.a.b v``) in order, so a later one wins as on any command line."""
  items, rest, i = [], [], 0
  while i < len(argv):
    arg = argv[i]
    if arg.startswith(f"{FLAG}."):
      key, eq, text = arg.removeprefix(f"{FLAG}.").partition("=")
      if not eq:
        if i + 1 >= len(argv):
          raise ConfigError(f"{arg}: expected a value ({arg}=VALUE)")
        i, text = i + 1, argv[i + 1]
      items.append((key, text))
    else:
      rest.append(arg)
    i += 1
  return items, rest


def dotted_keys(config, prefix: str = "") -> list[str]:
  """Every leaf key of ``config`` as ``section.key`` (any depth)."""
  out = []
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      out += dotted_keys(value, f"{prefix}{key}.")
    else:
      out.append(f"{prefix}{key}")
  return out


def closest(key: str, keys) -> str | None:
  """The one "did you mean" of every config error: the closest of ``keys`` to ``key``."""
  near = difflib.get_close_matches(key, list(keys), n=1)
  return near[0] if near else None


def unknown_key(key: str, keys, shown=lambda k: f"config.{k}") -> ConfigError:
  """The one line for a key ``config`` does not have, naming its one closest key."""
  near = closest(key, keys)
  return ConfigError(f"unknown config key {shown(key)!r}"
                     + (f"; did you mean {shown(near)!r}?" if near else ""))


def parse_value(default, text: str, key: str):
  """``text`` as the type of ``default``: bool true/false/1/0, int without a decimal point or
  exponent, float, str, or a tuple/list of comma-separated items of its first item's type.
  ``key`` names the value in the error (``--config.train.steps``)."""
  if isinstance(default, (tuple, list)):
    item = default[0] if default else ""
    parts = [p.strip() for p in text.strip("()[]").split(",") if p.strip()]
    return type(default)(parse_value(item, p, key) for p in parts)
  kind = type(default)
  try:
    if kind is bool:
      return _BOOLS[text.strip().lower()]
    if kind is int:
      return int(text)
    if kind is float:
      return float(text)
  except (KeyError, ValueError):
    raise ConfigError(f"{key}={text}: expected {_EXPECTED[kind]}") from None
  return text if default is None or kind is str else kind(text)


_EXPECTED = {bool: "true or false (or 1/0)",
             int: "an integer (no decimal point or exponent)", float: "a number"}


def set_value(config, key: str, text: str, *, item: str | None = None) -> None:
  """``--config.key=text`` into ``config``: a known leaf key, a value of its default's type.
  ``item``: how another flag spelled it (``--set 'model.layers=2'``), which then starts each
  error line."""
  def error(message: str) -> ConfigError:
    return ConfigError(message if item is None else f"{item}: {message}")

  flag = f"{FLAG}." if item is None else ""
  if key in legacy.RENAMED:
    raise error(f"{flag}{key} was renamed {flag}{legacy.RENAMED[key]}")
  *sections, leaf = key.split(".")
  node = config
  for section in sections:
    node = node.get(section) if isinstance(node, ml_collections.ConfigDict) else None
  if not isinstance(node, ml_collections.ConfigDict) or leaf not in node or isinstance(
      node[leaf], ml_collections.ConfigDict):
    raise error(str(unknown_key(key, dotted_keys(config), lambda k: flag.lstrip("-") + k)))
  try:
    node[leaf] = parse_value(node[leaf], text, f"{flag}{key}")
  except ConfigError as e:
    raise error(str(e)) from None


def apply_overrides(config, items) -> None:
  """Every ``(key, text)`` of :func:`split_overrides` into ``config``, in order."""
  for key, text in items:
    set_value(config, key, text)


def apply_sets(config, items: list[str], flag: str = "--set") -> None:
  """``KEY=VALUE`` items of another flag (``--set model.layers=2``) into ``config``, each
  checked as ``--config.KEY=VALUE`` is; an error line starts with the item."""
  for item in items:
    key, eq, text = item.partition("=")
    if not eq:
      raise ConfigError(f"{flag} {item!r}: expected KEY=VALUE (e.g. model.layers=2)")
    set_value(config, key, text, item=f"{flag} {item!r}")


def load(name: str | None, overrides=(), *, sets=(), root: str = "", defaults=None,
         flag: str = "--set"):
  """The one way a command reads its config: ``name``'s ``get_config()`` (a file, read from
  ``root`` when it is there: :func:`beside`; or a shipped config's name; no ``name``:
  ``defaults()``), then ``overrides``, the ``(key, text)`` pairs of ``--config.a.b=v``
  (:func:`split_overrides`), then ``sets``, ``KEY=VALUE`` items of another flag (``flag``:
  gpu-check's and max-batch's ``--set``). Each value is typed by its key's default; every
  mistake is one :class:`ConfigError` line."""
  config = load_file(beside(root, name)) if name else defaults()
  apply_overrides(config, overrides)
  apply_sets(config, list(sets), flag)
  return config
