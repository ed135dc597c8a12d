"""Name sub-tokens copied from what a function calls (lmscale_jax/inference/callee_copy.py): the
rates learnt on training names, a token never seen at the overall rate, suggestions at a
threshold, a model's tokens merged, the rates saved and read back."""

from __future__ import annotations

import pytest

from lmscale_jax.errors import UserError
from lmscale_jax.inference import callee_copy

# Training functions: what each calls and its own name's sub-tokens.
CALLS = [["gz_open", "free"], ["gz_read", "free"], ["inflateInit2_", "free"], None]
NAMES = [["gz", "open", "file"], ["gz", "read", "all"], ["inflate", "setup"], ["misc"]]


def test_called_names_split_and_normalise_as_names_do():
  assert callee_copy.called_tokens(["inflateInit2_", "XOpenDisplay@@GLIBC_2.2.5"]) == {
      "inflate", "init", "2", "x", "open", "display"}


def test_a_rate_is_the_share_of_callers_whose_name_holds_the_token_smoothed():
  rates = callee_copy.fit(CALLS, NAMES)
  assert rates.called["free"] == 3 and rates.held.get("free", 0) == 0
  assert rates.called["gz"] == 2 and rates.held["gz"] == 2
  overall = sum(rates.held.values()) / sum(rates.called.values())
  assert rates.overall == pytest.approx(overall)
  assert rates.rate("gz") == pytest.approx((2 + overall) / 3)
  assert rates.rate("free") == pytest.approx(overall / 4)
  assert rates.rate("never_seen") == pytest.approx(overall)  # a new library's own prefix


def test_suggestions_keep_the_tokens_at_or_above_the_threshold_and_none_without_calls():
  rates = callee_copy.fit(CALLS, NAMES)
  assert rates.overall == 0.5  # 5 of the 10 (caller, token) pairs
  got = callee_copy.suggested(rates, [["gz_write", "free"], None, []], threshold=0.6)
  assert got == [["gz"], [], []]  # write, never seen, is at 0.5; free at 0.125


def test_a_models_tokens_merge_with_the_called_names_at_the_larger_score():
  rates = callee_copy.fit(CALLS, NAMES)
  names, scores = callee_copy.merged([["gz", "read"]], [[0.1, 0.4]], rates, [["gz_close"]], 3)
  assert names == [["gz", "close", "read"]]  # gz: its rate 0.83; close: never seen, 0.5
  assert scores[0] == pytest.approx([2.5 / 3, 0.5, 0.4])


def test_rates_saved_are_read_back_and_a_damaged_file_is_one_line(tmp_path):
  rates = callee_copy.fit(CALLS, NAMES)
  callee_copy.save(str(tmp_path), rates)
  assert callee_copy.load(str(tmp_path)) == rates
  assert callee_copy.load(str(tmp_path / "none")) is None
  (tmp_path / callee_copy.FILE).write_text("{\"format\": 3}")
  with pytest.raises(UserError, match=r"callee_copy.json: unreadable .*restore the run's own"):
    callee_copy.load(str(tmp_path))
