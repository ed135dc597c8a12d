"""How the embedder cuts functions into forward passes (inference/function_vectors, the one
rule of lmscale embed, index, eval-similarity and lmscale serve's batcher): every function once,
at most BATCH rows per device a pass, and never more token positions than one row size would
compute."""

from __future__ import annotations

import random

from lmscale_jax.inference import function_vectors as fv

SEQ = 256


def window(lengths: list[int]) -> list:
  return [(i, [0] * n) for i, n in enumerate(lengths)]


def fixed_chunks(lengths: list[int], devices: int) -> int:
  """The positions of the old rule: sorted, cut every BATCH rows, each pass BATCH rows."""
  ordered, size = sorted(lengths), fv.BATCH * devices
  return sum(size * fv.padded_length(max(ordered[i:i + size]), SEQ)
             for i in range(0, len(ordered), size))


def test_each_function_is_in_one_pass_of_at_most_batch_rows_per_device():
  rng = random.Random(0)
  for devices in (1, 4):
    for n in (1, 7, 33, 50, 256):
      lengths = [rng.randint(3, SEQ) for _ in range(n)]
      batches = fv._by_length(window(lengths), devices, SEQ)
      assert sorted(i for b in batches for i, _ in b) == list(range(n))
      assert all(len(b) <= fv.BATCH * devices for b in batches)
      assert fv.window_slots(lengths, devices, SEQ) <= fixed_chunks(lengths, devices)


def test_a_lone_function_runs_in_the_smallest_row_size_at_its_own_bucket():
  assert fv.rows_for(1, 1) == fv.ROW_BUCKETS[0] and fv.rows_for(fv.BATCH, 1) == fv.BATCH
  assert fv.rows_for(9, 4) == fv.ROW_BUCKETS[0] * 4
  assert fv.batch_slots([40], 1, SEQ) == fv.ROW_BUCKETS[0] * fv.padded_length(40, SEQ)


def test_short_and_long_functions_waiting_together_are_not_padded_to_the_longest():
  lengths = [20] * 8 + [SEQ] * 8
  batches = fv._by_length(window(lengths), 1, SEQ)
  assert sorted(len(b) for b in batches) == [8, 8]
  assert fv.window_slots(lengths, 1, SEQ) == 8 * fv.padded_length(20, SEQ) + 8 * SEQ


def costs_where_a_large_pass_costs(factor: float, devices: int = 1) -> dict:
  """A measured_passes-shaped table: a row costs its length, times ``factor`` in the large pass."""
  lengths = {fv.padded_length(n, SEQ) for n in range(1, SEQ + 1)}
  small, large = (r * devices for r in fv.ROW_BUCKETS)
  return {**{(small, n): small * n for n in lengths},
          **{(large, n): factor * large * n for n in lengths}}


def test_measured_passes_decide_the_row_size_where_a_large_pass_costs_more_a_row():
  lengths = [SEQ] * 64  # as a CPU measured it: 32 rows at the longest length, 1.8x a row's cost
  for devices in (1, 4):
    costs = costs_where_a_large_pass_costs(1.8, devices)
    batches = fv._by_length(window(lengths), devices, SEQ, costs)
    assert sorted(i for b in batches for i, _ in b) == list(range(64))
    assert all(len(b) <= fv.ROW_BUCKETS[0] * devices for b in batches)
  # the same window by positions (and where the large pass is cheaper a row) fills 32 rows
  assert {len(b) for b in fv._by_length(window(lengths), 1, SEQ)} == {fv.BATCH}
  cheap = costs_where_a_large_pass_costs(0.5)
  assert {len(b) for b in fv._by_length(window(lengths), 1, SEQ, cheap)} == {fv.BATCH}

