"""Name sub-tokens copied from what a function calls (lmscale_jax/evals/callee_copy.py): the
rates learnt on training names, a token never seen at the overall rate, the threshold chosen
on training F1."""

from __future__ import annotations

import pytest

from lmscale_jax.evals import callee_copy

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


def test_the_threshold_is_the_grids_best_training_f1():
  rates = callee_copy.fit(CALLS, NAMES)
  chosen = callee_copy.chosen_threshold(rates, CALLS, NAMES)
  assert chosen in callee_copy.GRID
  from lmscale_jax.evals import naming
  f1 = {t: naming.score(callee_copy.suggested(rates, CALLS, t), NAMES)["f1"]
        for t in callee_copy.GRID}
  assert f1[chosen] == max(f1.values())
