"""Function naming's scores (lmscale_jax/evals/naming.py): SymLM's and XFL's micro-averaged
sub-token precision, recall and F1, and exact-name accuracy."""

import pytest

from lmscale_jax.evals import naming


def test_scores_are_micro_averaged_over_summed_token_counts():
  got = naming.score([["inflate", "fast"], ["gz", "open"]],
                     [["inflate", "fast", "slow"], ["gz", "close"]])
  # hits 2 + 1 of 2 + 2 said and 3 + 2 real: precision 3/4, recall 3/5
  assert got["precision"] == pytest.approx(0.75) and got["recall"] == pytest.approx(0.6)
  assert got["f1"] == pytest.approx(2 * 0.75 * 0.6 / 1.35)
  assert got["exact"] == 0.0 and got["functions"] == 2


def test_exact_name_is_the_same_token_set_in_any_order():
  got = naming.score([["fast", "inflate"], []], [["inflate", "fast"], ["main"]])
  assert got["exact"] == 0.5 and got["precision"] == 1.0 and got["recall"] == pytest.approx(2 / 3)


def test_nothing_suggested_scores_zero_not_a_division_error():
  got = naming.score([[], []], [["a"], ["b"]])
  assert got["precision"] == 0.0 and got["f1"] == 0.0


def test_predictions_and_truth_of_other_lengths_are_refused():
  with pytest.raises(ValueError, match="1 predictions for 2 functions"):
    naming.score([["a"]], [["a"], ["b"]])


def test_weights_scale_each_functions_counts():
  # the second function counts half: hits 1 + 0.5·0 of 1 + 0.5·2 said, 1 + 0.5·1 real
  got = naming.score([["a"], ["b", "c"]], [["a"], ["d"]], weights=[1.0, 0.5])
  assert got["precision"] == pytest.approx(1 / 2) and got["recall"] == pytest.approx(1 / 1.5)
  assert got["exact"] == pytest.approx(1 / 1.5)


def test_a_library_larger_than_the_median_weighs_as_much_as_the_median_one():
  libraries = ["big"] * 8 + ["mid"] * 2 + ["small"]
  weights = naming.library_weights(libraries)
  assert weights[:8] == [0.25] * 8 and weights[8:] == [1.0, 1.0, 1.0]  # the median library: 2


def test_weights_of_another_length_are_refused():
  with pytest.raises(ValueError, match="2 weights for 1 functions"):
    naming.score([["a"]], [["a"]], weights=[1.0, 1.0])
