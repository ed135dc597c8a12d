"""trained_model.encode reads at most seq_len words of a text when the tokenizer is word-local
(store/tokenizer.word_local: the binary tokenizer): the ids and the cut flag are those of the
whole text, cut, at every length around the cut and with any whitespace."""

from __future__ import annotations

import collections

import ml_collections
import numpy as np
import pytest

from lmscale_jax.inference import trained_model
from lmscale_jax.store import tokenizer as toklib

SEQ = 16
WORDS = ["mov", "rax", "rbx", "push", "rbp", "0x10", "[NEXT]", "call", "<fwd>", "qword"]


def binary_tokenizer():
  counts = collections.Counter({w: 5 for w in WORDS if w != "[NEXT]"})
  return toklib.with_hf_roles(toklib.from_pretoken_counts(counts, 200))


def model_of(tok) -> trained_model.TrainedModel:
  return trained_model.TrainedModel(cfg=ml_collections.ConfigDict({"seq_len": SEQ}), params={},
                                    tokenizer=tok, source="test")


def whole_then_cut(model, text):
  """The rule before: the whole text tokenized, then cut at seq_len keeping the final [SEP]."""
  ids = model.tokenizer.encode(text).ids
  cut = len(ids) > SEQ
  return (ids[:SEQ - 1] + ids[-1:] if cut else ids), cut


def texts():
  rng = np.random.default_rng(0)
  pool = WORDS + ["movzx", "unseenword", "x" * 150, "é"]  # pieces, [UNK], too long, non-ASCII
  for n in (0, 1, SEQ - 3, SEQ - 2, SEQ - 1, SEQ, SEQ + 1, SEQ + 2, 3 * SEQ, 400):
    for gap in (" ", "  \n\t ", "\x0b", "\x1c", " \x1f "):  # \x1c, \x1f: not spaces to it
      yield gap.join(rng.choice(pool, size=n)) + gap


def test_the_binary_tokenizer_is_word_local_and_encode_matches_the_whole_text_cut():
  model = model_of(binary_tokenizer())
  assert toklib.word_local(model.tokenizer) and model.words_kept == SEQ
  for text in texts():
    ids, cut = trained_model.encode(model, text)
    want, want_cut = whole_then_cut(model, text)
    assert ids.tolist() == want and cut == want_cut, (len(text.split()), text[:80])


def test_a_tokenizer_that_is_not_word_local_reads_the_whole_text():
  pytest.importorskip("tokenizers")
  tok = toklib.train([" ".join(WORDS)] * 50, vocab_size=60, kind="text")  # BertNormalizer
  model = model_of(toklib.with_hf_roles(tok))
  assert not toklib.word_local(model.tokenizer) and model.words_kept is None
  text = " ".join(WORDS * 10)
  assert trained_model.encode(model, text)[0].tolist() == whole_then_cut(model, text)[0]


def test_leading_words_keeps_the_text_as_written_up_to_the_last_word_kept():
  assert toklib.leading_words("a  b\tc", 3) == "a  b\tc"
  assert toklib.leading_words(" a  b\tc d", 3) == " a  b\tc"
  assert toklib.leading_words("a\x1cb c d", 2) == "a\x1cb c"  # \x1c is inside a word
  assert toklib.leading_words("a b", None) == "a b"
  few_long = " ".join(["movabs" * 8] * 250)  # fewer words than asked, each long: no backtracking
  assert toklib.leading_words(few_long, 256) == few_long
  assert toklib.leading_words(few_long, 3) == " ".join(["movabs" * 8] * 3)
  assert toklib.leading_words("é b c", 1) == "é b c"  # not ASCII: read whole
