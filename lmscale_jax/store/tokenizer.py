"""Tokenizers (Hugging Face ``tokenizers``): train on a corpus, or load and validate a given one.

Binary code: the corpus is already split into pretokens by whitespace, so the tokenizer is a
WordPiece model over whitespace-split words whose vocabulary is the most frequent pretokens plus
every character as a piece: frequent pretokens are single tokens and a rare or unseen one (a new
mnemonic) decomposes into characters instead of ``[UNK]``. We build that vocabulary ourselves
because ``tokenizers``' trainers break frequency ties in hash order, so two runs on the same
corpus give different vocabularies, and preparation promises byte-identical output.
Text: BERT normalisation and pre-tokenisation, WordPiece (default) or byte-level BPE, trained by
``tokenizers`` (not bit-reproducible between runs for that reason; pass ``--tokenizer`` to fix it).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import re

from typing import Iterable

from lmscale_jax.errors import UserError
from lmscale_jax.store import dataset, file_io
from lmscale_jax.store.dataset import NEXT


class TokenizerError(UserError, ValueError):
  """A tokenizer.json that cannot be used (unreadable, not Hugging Face's schema, without the
  special tokens): one line naming the file, as every tool that reads one reports it."""


def check_vocab_size(vocab_size: int) -> None:
  if not len(dataset.SPECIAL_TOKENS) < vocab_size <= dataset.MAX_VOCAB:
    raise TokenizerError(
        f"--vocab-size {vocab_size}: must be in "
        f"{len(dataset.SPECIAL_TOKENS) + 1}..{dataset.MAX_VOCAB} "
        "(token ids are stored as uint16)")


def train(texts: Iterable[str], *, vocab_size: int, kind: str, model: str = "wordpiece",
          lowercase: bool = False):
  """Trains a tokenizer whose specials get ids 0..5 in ``dataset.SPECIAL_TOKENS`` order."""
  from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

  check_vocab_size(vocab_size)
  specials = list(dataset.SPECIAL_TOKENS)
  if kind == "binary":
    return _pretoken_wordpiece(texts, vocab_size)
  if model == "wordpiece":
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=100))
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials,
                                        min_frequency=2, show_progress=False)
    tok.decoder = decoders.WordPiece()
  elif model == "bpe":
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, min_frequency=2,
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.decoder = decoders.ByteLevel()
  else:
    raise TokenizerError(f"tokenizer model {model!r}: expected 'wordpiece' or 'bpe'")
  tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase, clean_text=True,
                                                handle_chinese_chars=True, strip_accents=None)
  tok.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
                       if model == "bpe" else pre_tokenizers.BertPreTokenizer())
  tok.train_from_iterator(texts, trainer=trainer)
  validate(tok, "trained tokenizer")
  return tok


def _pretoken_wordpiece(texts: Iterable[str], vocab_size: int):
  """Deterministic WordPiece over pretokens: specials, character pieces, then frequent words."""
  return from_pretoken_counts(count_pretokens(texts), vocab_size)


def count_pretokens(texts: Iterable[str], compiled=None) -> collections.Counter:
  """Word counts of pretoken texts, specials excluded: all a binary tokenizer is built from.
  Counts of parts of a corpus add up (``Counter`` +) to the whole's, so each node of a cluster
  preparation can count its share and one step builds the tokenizer."""
  # Counted per instruction first (" [NEXT] "-separated; ~4× fewer items than words, and the
  # distinct instructions are few), then spread to their words: the same counts, ~2× faster.
  # ``compiled``: prep/_token_ids.c's module (prep passes packing.token_ids_module(): store
  # does not import prep), whose count does both in C (measured on libc: 3.7× faster).
  if compiled is not None:
    counts = collections.Counter(compiled.count(texts, f" {NEXT} ", words=True))
  else:
    instructions = collections.Counter()
    for t in texts:
      instructions.update(t.split(f" {NEXT} "))
    counts = collections.Counter()
    for instruction, n in instructions.items():
      for w in instruction.split():
        counts[w] += n
  for sp in dataset.SPECIAL_TOKENS:
    counts.pop(sp, None)
  return counts


def from_pretoken_counts(counts: collections.Counter, vocab_size: int):
  """The binary tokenizer of :func:`count_pretokens`' counts: specials, every character as a
  piece, then the words seen at least twice, most frequent first (ties by the word)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers

  chars = sorted({c for w in counts for c in w})
  vocab = list(dataset.SPECIAL_TOKENS) + chars + ["##" + c for c in chars]
  if len(vocab) > vocab_size:
    raise TokenizerError(f"--vocab-size {vocab_size} is smaller than the corpus alphabet "
                         f"({len(vocab)} specials and character pieces)")
  taken = set(vocab)
  words = sorted((w for w, n in counts.items() if n >= 2 and w not in taken),
                 key=lambda w: (-counts[w], w))
  vocab += words[:vocab_size - len(vocab)]
  tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]",
                                   max_input_chars_per_word=100))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.decoder = decoders.WordPiece()
  tok.add_special_tokens(list(dataset.SPECIAL_TOKENS))
  validate(tok, "trained tokenizer")
  return tok


def digest(path: str) -> str:
  """sha256 of the tokenizer ``path`` (a tokenizer.json) as canonical JSON (keys sorted, no
  spaces): the same tokenizer saved twice, or by another version of ``tokenizers`` with its
  keys in another order, has one digest; any change to its vocabulary, merges, normalizer or
  pre-tokenizer gives another. What binds a training run to its dataset
  (train/run_record.py ``dataset_identity``)."""
  kind = file_io.not_regular(path)
  if kind:
    raise TokenizerError(f"{path} is {kind}: expected a Hugging Face tokenizer.json file")
  try:
    with open(path, "rb") as f:
      tree = json.loads(f.read())
  except (OSError, ValueError) as e:
    raise TokenizerError(f"{path}: cannot read the tokenizer ({e})") from e
  canonical = json.dumps(tree, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
  return hashlib.sha256(canonical.encode()).hexdigest()


def load(path: str):
  from tokenizers import Tokenizer

  kind = file_io.not_regular(path)
  if kind:  # a FIFO would block the read forever
    raise TokenizerError(f"{path} is {kind}: expected a Hugging Face tokenizer.json file")
  try:
    tok = Tokenizer.from_file(path)
  except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
    raise TokenizerError(f"{path}: not a Hugging Face tokenizer.json: {e}") from e
  validate(tok, path)
  return tok


def validate(tok, where: str) -> dict:
  """Checks the special tokens ([PAD] must be 0) and the uint16 vocab limit; returns special ids."""
  size = tok.get_vocab_size(with_added_tokens=True)
  if size > dataset.MAX_VOCAB:
    raise TokenizerError(f"{where}: vocabulary of {size} tokens > {dataset.MAX_VOCAB}; ids are "
                         "stored as uint16")
  ids = {t: tok.token_to_id(t) for t in dataset.SPECIAL_TOKENS}
  missing = [t for t, i in ids.items() if i is None]
  if missing:
    raise TokenizerError(f"{where}: lacks special tokens {missing} (need all of "
                         f"{list(dataset.SPECIAL_TOKENS)})")
  if ids["[PAD]"] != 0:
    raise TokenizerError(f"{where}: [PAD] has id {ids['[PAD]']}, expected 0")
  return ids


def word_local(tok) -> bool:
  """Whether ``tok`` turns every whitespace-separated word of a text into at least one id, from
  that word alone: WordPiece (an unknown word is [UNK], never nothing) after a WhitespaceSplit
  pre-tokenizer, no normalizer (BertNormalizer drops control characters: a word could vanish),
  no added token holding a space. The binary tokenizer (:func:`from_pretoken_counts`) is."""
  from tokenizers import models, pre_tokenizers

  return (tok.normalizer is None and isinstance(tok.model, models.WordPiece)
          and isinstance(tok.pre_tokenizer, pre_tokenizers.WhitespaceSplit)
          and not any(any(c.isspace() for c in t.content)
                      for t in tok.get_added_tokens_decoder().values()))


def leading_words(text: str, words: int | None) -> str:
  """The first ``words`` whitespace-separated words of ``text`` (None: all of it). With a
  :func:`word_local` tokenizer they hold the text's first ``words`` ids, so a function cut at
  ``seq_len`` ids need not be tokenized whole: libz's functions average 842 ids against 256
  kept, and tokenizing them whole was 0.57 ms a function, a third of ``lmscale embed``'s time."""
  if words is None or not text.isascii():  # Unicode spaces: Python's and Rust's lists differ
    return text
  found = _first_words(words).match(text)
  return text[:found.end()] if found else text


# Whitespace as tokenizers' WhitespaceSplit sees it in ASCII (Rust's char::is_whitespace):
# \x1c-\x1f, which Python's str.split also splits at, are part of a word there.
_SPACE, _WORD = "[\t\n\x0b\x0c\r ]", "[^\t\n\x0b\x0c\r ]"


@functools.lru_cache(maxsize=8)
def _first_words(n: int) -> re.Pattern:
  """A pattern matching a text's first ``n`` words and the spaces before them, as written.
  Possessive: a word is never split into two (backtracking into words made a text of fewer
  than ``n`` long words take exponential time)."""
  return re.compile(f"(?:{_SPACE}*+{_WORD}++){{{n}}}")


# --------------------------------------------------------------------------- for transformers
# The files `transformers.AutoTokenizer.from_pretrained(DIR)` reads beside tokenizer.json.
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
HF_FILES = (dataset.TOKENIZER, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP)
HF_ROLES = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]",
            "sep_token": "[SEP]", "mask_token": "[MASK]"}
# Kept by decode(skip_special_tokens=True): it is the instruction separator of binary code,
# part of the text, not framing. Still an added token, so it is never split into pieces.
NON_SPECIAL = ("[NEXT]",)


def with_hf_roles(tok):
  """``tok`` as training sees its sequences: ``encode()`` wraps text in ``[CLS] … [SEP]``
  (pairs ``[CLS] a [SEP] b [SEP]``, all type 0: pretraining never used segment 1) and
  ``[NEXT]`` is an ordinary (non-special) added token. Token ids are unchanged, and so is any
  ``encode(..., add_special_tokens=False)``, which is how preparation tokenizes. Idempotent."""
  import json

  from tokenizers import Tokenizer, processors

  ids = validate(tok, "tokenizer")
  # tokenizers has no setter for an added token's `special` flag: edit its JSON form.
  data = json.loads(tok.to_str())
  for added in data.get("added_tokens", []):
    if added["content"] in NON_SPECIAL:
      added["special"] = False
  out = Tokenizer.from_str(json.dumps(data))
  out.post_processor = processors.TemplateProcessing(
      single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
      special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])])
  return out


def write_hf_files(tok, directory: str, *, model_max_length: int) -> None:
  """tokenizer.json (:func:`with_hf_roles`), tokenizer_config.json and
  special_tokens_map.json into ``directory``, each written atomically."""
  import json
  import os

  tok = with_hf_roles(tok)
  config = {"tokenizer_class": "PreTrainedTokenizerFast", **HF_ROLES,
            "model_max_length": int(model_max_length),
            # transformers' clean-up would glue "[ rbp - 0x18 ]" and "mov rax , …" together.
            "clean_up_tokenization_spaces": False, "do_lower_case": False}
  file_io.atomic_write_bytes(os.path.join(directory, dataset.TOKENIZER), tok.to_str().encode())
  file_io.atomic_write_bytes(os.path.join(directory, TOKENIZER_CONFIG),
                             json.dumps(config, indent=2).encode())
  file_io.atomic_write_bytes(os.path.join(directory, SPECIAL_TOKENS_MAP),
                             json.dumps(HF_ROLES, indent=2).encode())
