"""Name sub-tokens copied from what a function calls (lmscale_jax/inference/callee_copy.py): the
rates learnt on training names, a token never seen at the overall rate, suggestions at a
threshold, a model's tokens merged or gated, the rates saved and read back."""

from __future__ import annotations

import numpy as np
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


def test_candidates_are_the_models_tokens_then_the_called_ones_with_their_evidence():
  rates = callee_copy.fit(CALLS, NAMES)
  tokens, x = callee_copy.candidates(["read", "gz"], [0.5, 0.2], rates, ["gz_close"])
  assert tokens == ["read", "gz", "close"] and x.shape == (3, len(callee_copy.FEATURES))
  assert x[0][:7].tolist() == [0.5, 0.0, 0.0, 0.0, 0.0, pytest.approx(np.log(3)), 1.0]
  # no file known: no share, not the namespace; read: not called, so its rate counts
  assert x[0][7:10].tolist() == [0.0, pytest.approx(np.log(1e-3)), 0.0]
  assert x[0][10] == pytest.approx(rates.rate("read"))
  assert x[1][:4].tolist() == [0.2, pytest.approx(np.log(0.25)), pytest.approx(2.5 / 3), 1.0]
  assert x[1][4] == pytest.approx(np.log(3))  # gz: 2 training callers
  assert x[2][[0, 2, 3, 6]].tolist() == [0.0, 0.5, 1.0, 0.0]  # close: never seen, not the model's


def test_a_gate_fitted_where_copying_pays_ranks_the_copied_token_first():
  rates = callee_copy.fit(CALLS, NAMES)
  # Functions whose name is what they call; the model's guess ("misc") is always wrong.
  names, probs = [["misc"]] * 40, [[0.6]] * 40
  calls = [[f"{t}_helper"] for t in ("gz", "inflate") * 20]
  truth = [[c[0].split("_")[0]] for c in calls]
  gate = callee_copy.fit_gate(names, probs, rates, calls, truth, [1.0] * 40)
  got, scores = callee_copy.gated([["misc"]], [[0.6]], rates, [["gz_helper"]], gate, 3)
  assert sorted(got[0]) == ["gz", "helper", "misc"] and got[0][0] == "gz"
  assert scores[0][0] > 0.5 > max(scores[0][1:])  # helper: called, never in a name
  assert callee_copy.gate_from_json(gate.as_json()) == gate
  with pytest.raises(ValueError, match="gate features"):
    callee_copy.gate_from_json({**gate.as_json(), "features": ["probability"]})


def test_a_token_most_of_a_files_functions_call_is_a_candidate_for_each_of_them():
  """callee_copy.file_shares: the file's namespace (here ``gz``, called by 3 of 10 functions)
  joins every function's candidates, with its share; fewer than MIN_FILE_FUNCTIONS: none."""
  rates = callee_copy.fit(CALLS, NAMES)
  calls = [["gz_open"], ["gz_close"], ["gzread"], None, ["memcpy"]] + [[]] * 5
  shares = callee_copy.file_shares(calls)
  assert shares["gz"] == pytest.approx(0.2) and shares["open"] == pytest.approx(0.1)
  assert callee_copy.file_shares(calls[:callee_copy.MIN_FILE_FUNCTIONS - 1]) is None
  tokens, x = callee_copy.candidates(["read"], [0.5], rates, ["memcpy"], shares)
  assert tokens[0] == "read" and {"gz", "open", "close", "memcpy"} <= set(tokens)
  gz = x[tokens.index("gz")]
  assert gz[[7, 9]].tolist() == [pytest.approx(0.2), 1.0] and gz[3] == 0.0  # not called here
  by_file = callee_copy.shares_by_file(calls * 2, ["a"] * 10 + ["b"] * 10)
  assert by_file[0] == by_file[19] == shares


def test_a_gate_fitted_before_file_shares_scores_as_it_did():
  """A run saved with the seven calls-only features reads them alone and adds no namespace
  candidates, whatever shares it is given."""
  rates = callee_copy.fit(CALLS, NAMES)
  old = {"features": list(callee_copy.CALLS_ONLY), "weights": [1.0, 0.5, 2.0, 0.3, 0.1, -0.2,
                                                             0.4], "bias": -1.0}
  gate = callee_copy.gate_from_json(old)
  assert not gate.reads_files and gate.as_json() == old
  shares = callee_copy.file_shares([["zz_top"]] * 10)
  got = callee_copy.gated([["read"]], [[0.5]], rates, [["gz_close"]], gate, 8, [shares])
  assert callee_copy.gated([["read"]], [[0.5]], rates, [["gz_close"]], gate, 8) == got
  assert "zz" not in got[0][0] and "gz" in got[0][0]
  tokens, x = callee_copy.candidates(["read"], [0.5], rates, ["gz_close"])
  want = 1 / (1 + np.exp(-(x[:, :7] @ np.asarray(old["weights"]) - 1.0)))
  assert dict(zip(got[0][0], got[1][0])) == pytest.approx(dict(zip(tokens, want.tolist())))
