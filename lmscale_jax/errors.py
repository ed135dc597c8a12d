"""The project's exception types for user errors: bad settings, bad data, an incompatible
checkpoint, an unusable cluster environment. ``main`` prints one ``error:`` line for a
:class:`UserError` and a full traceback for anything else (a bug must never look like a user
error). Each module raises its own subclass; they keep the builtin base they had before
(``ValueError``/``RuntimeError``) so that callers catching those still work.
"""


class UserError(Exception):
  """Something the user can fix: the message names the file/key/value and what was expected."""


class ConfigError(UserError, ValueError):
  """A config value (``--config.a.b=…`` or a configs/*.py) is invalid or inconsistent."""


class IncompatibleCheckpoint(UserError, ValueError):
  """The workdir's checkpoint cannot be resumed by this run (model shape, process count, the
  loader state of another version)."""


class PrepareError(UserError, ValueError):
  """Bad arguments, inputs or output directory of a data preparation (tools/prepare_*.py)."""
