"""The progress bars of a preparation's passes: tqdm is imported only when a bar is shown.
Every pool worker imports the modules that draw them, and tqdm's import was 37 ms of a worker's
~0.3 s start (``python -X importtime``), paid again by each worker of a run without bars."""

from __future__ import annotations

import sys


class _Hidden:
  """What a hidden bar is asked to do: nothing."""

  def update(self, n: float = 1) -> None:
    pass

  def close(self) -> None:
    pass

  def unpause(self) -> None:
    pass


def bar(shown: bool, **kwargs):
  """A tqdm bar updated by hand (``update``/``close``), or one that draws nothing."""
  if not shown:
    return _Hidden()
  from tqdm import tqdm

  return tqdm(**kwargs)


def over(items, shown: bool, **kwargs):
  """``items`` behind a tqdm bar, or as they are."""
  if not shown:
    return items
  from tqdm import tqdm

  return tqdm(items, **kwargs)


def clocked_from_first(items, bar):
  """``items`` as they come, ``bar``'s clock (its rate, its time left) started when the first
  arrives: a pass's start-up (spawned workers, a first disassembly) is not its rate. The demo's
  extract bar opened at "43:22:36" left, 496 bytes done in its first 3 s, for 12 s of work."""
  items = iter(items)
  for first in items:
    bar.unpause()  # tqdm: the time since its last redraw, here its opening one, is not counted
    yield first
    break
  yield from items


def end_bars() -> None:
  """Closes every bar still drawn, so that what is printed next starts a line of its own. An
  error raised mid-pass leaves its bar open, and a bar's line has no newline until it closes:
  the ``error:`` line was glued to it (``extract:   0%| … ?B/s]error: …``), then the bar redrew
  itself after it when it was collected. Only if tqdm was imported (a bar was shown)."""
  tqdm = sys.modules.get("tqdm")
  for shown in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
    shown.close()
