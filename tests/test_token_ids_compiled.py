"""prep/_token_ids.c against its Python references, output for output: instruction counts
(store/tokenizer.count_pretokens' Counter), token ids (tokenize_pack.PretokenIds.encode) and
packing (prep/packing.Packer). Real pretoken text from this machine's libc through the
pretokenizer, a real tokenizer trained on it; the C path is what preparation runs by default."""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest

from lmscale_jax.prep import packing, tokenize_pack
from lmscale_jax.prep.elf import elf_corpus, pretokenize
from lmscale_jax.prep.packing import Packer, pack_documents
from lmscale_jax.store import tokenizer as toklib
from lmscale_jax.store.dataset import NEXT

_token_ids = pytest.importorskip("lmscale_jax.prep._token_ids",
                                 reason="the C extension is not built (bash tools/setup.sh)")
LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"
SEP = f" {NEXT} "


@pytest.fixture(scope="module")
def texts() -> list[str]:
  if not os.path.exists(LIBC):
    pytest.skip(f"{LIBC} is not on this machine")
  res = elf_corpus.FileResult(path=LIBC, file_bytes=0)
  out = [text for _, text in elf_corpus.iter_functions(LIBC, res)]
  assert len(out) > 1000
  return out


def python_counts(texts) -> collections.Counter:
  counts = collections.Counter()
  for t in texts:
    counts.update(t.split(SEP))
  return counts


def test_count_equals_the_counter_of_split_instructions_in_first_seen_order(texts):
  odd = ["", SEP, f"a{SEP}", f"{SEP}b", f"a{SEP}{SEP}b", "é ü", f"é{SEP}é"]
  got, want = _token_ids.count(texts + odd, SEP), python_counts(texts + odd)
  assert got == want and list(got) == list(want)


def test_count_of_words_spreads_each_instructions_count_to_its_words(texts):
  odd = ["", f" a  b{SEP}a\tb", "é ü\xa0x"]
  want = collections.Counter()
  for instruction, n in python_counts(texts + odd).items():
    for w in instruction.split():
      want[w] += n
  got = _token_ids.count(texts + odd, SEP, words=True)
  assert got == want and list(got) == list(want)


def test_count_of_something_not_a_str_says_what_it_got():
  with pytest.raises(TypeError, match="count text: expected str, got bytes"):
    _token_ids.count(["a", b"b"], SEP)


def test_count_pretokens_is_the_same_with_and_without_the_extension(texts, monkeypatch):
  compiled = toklib.count_pretokens(texts, _token_ids)
  assert toklib.count_pretokens(texts) == compiled
  monkeypatch.setenv(pretokenize.BACKEND_ENV, "python")
  assert packing.token_ids_module() is None


@pytest.mark.parametrize("table_size", [1 << 18, 7])  # 7: emptied every few instructions
def test_encoder_ids_equal_the_python_memo_on_every_libc_function(texts, table_size):
  tok = toklib.from_pretoken_counts(toklib.count_pretokens(texts[::3]), 2000)
  python = tokenize_pack.PretokenIds(tok)
  memo = tokenize_pack.PretokenIds(tok)
  encoder = _token_ids.Encoder(memo.word_ids, SEP, memo.instructions.separator, table_size)
  odd = ["", "nop", f"nop{SEP}ret", f" nop  eax{SEP}{SEP}ret ", f"mov\teax\x0b1{SEP}é\xa0x"]
  for text in texts + odd:
    want = python.encode(text)
    got = np.frombuffer(encoder.encode(text), np.uint16)
    assert np.array_equal(got, want), text[:80]
  # and what the worker uses: PretokenIds with the extension
  compiled = tokenize_pack.PretokenIds(tok, _token_ids)
  assert all(np.array_equal(compiled.encode(t), python.encode(t)) for t in texts[:500])


def test_a_word_ids_call_that_fails_raises_and_the_encoder_still_works():
  def word_ids(word: str) -> bytes:
    if word == "bad":
      raise KeyError(word)
    return b"\x01" if word == "odd" else bytes([len(word), 0])

  encoder = _token_ids.Encoder(word_ids, SEP, b"\x09\x00")
  with pytest.raises(KeyError):
    encoder.encode(f"a b{SEP}x bad")
  with pytest.raises(ValueError, match=r"word_ids\('odd'\) returned 1 bytes: not uint16 ids"):
    encoder.encode("odd")
  assert np.frombuffer(encoder.encode(f"a bb{SEP}x a"), np.uint16).tolist() == [1, 2, 9, 1, 1]


def random_documents(rng, n: int, seq_len: int) -> list[np.ndarray]:
  # Mostly short (functions), some longer than a sequence, some empty.
  lengths = np.where(rng.random(n) < 0.1, rng.integers(0, 3 * seq_len, n),
                     rng.integers(0, seq_len // 3, n))
  return [rng.integers(10, 60000, k).astype(np.uint16) for k in lengths]


@pytest.mark.parametrize("mode,seq_len,window", [("greedy", 512, 64), ("greedy", 16, 3),
                                                 ("greedy", 4, 1), ("none", 64, 64)])
def test_pack_equals_packer_add_then_flush(mode, seq_len, window):
  rng = np.random.default_rng(seq_len + window)
  docs = random_documents(rng, 3000, seq_len)
  packer = Packer(seq_len, 2, 3, 0, mode, window)
  want = np.stack([s for d in docs for s in packer.add(d)] + list(packer.flush()))
  got = pack_documents(docs, seq_len, 2, 3, 0, mode, window, compiled=_token_ids)
  assert got.dtype == np.uint16 and np.array_equal(got, want)
  assert pack_documents(docs, seq_len, 2, 3, 0, mode, window).tobytes() == want.tobytes()


def test_pack_of_no_documents_is_no_sequences():
  for compiled in (None, _token_ids):
    assert pack_documents([], 16, 2, 3, 0, compiled=compiled).shape == (0, 16)


def test_pack_with_bad_arguments_says_what_it_expected():
  with pytest.raises(ValueError, match="seq_len 3"):
    _token_ids.pack(np.zeros(0, np.uint16), np.zeros(0, np.int64), 3, 2, 3, 0, 64, True)
  with pytest.raises(ValueError, match="summing to 5 ids, ids 8 bytes"):
    _token_ids.pack(np.zeros(4, np.uint16), np.array([5], np.int64), 16, 2, 3, 0, 64, True)
  with pytest.raises(ValueError, match="none negative"):
    _token_ids.pack(np.zeros(0, np.uint16), np.array([-1, 1], np.int64), 16, 2, 3, 0, 64, True)
