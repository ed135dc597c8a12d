"""Text a user gives is checked where it enters (store/user_text.py), and a dataset's
metadata.json field by field where it is parsed (store/dataset.py): invalid UTF-8 in argv or on
standard input, a lone surrogate or JSON nested too deeply in a labels or pairs file, a search
query with no instruction in it, and a metadata.json value of the wrong type or range are each
one ``error:`` line naming the argument, FILE:LINE or key — before, tracebacks deep in the
tokenizer (TypeError), the JSON parser (RecursionError) or a reader (AttributeError), NaN
scores with exit 0, a labels file silently trained on U+FFFD, and "records": -1 passing
``inspect-data --verify``. On a real (short) training run, its index, and real dataset
directories written by the production writer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from lmscale_jax.cli import inspect_data
from lmscale_jax.errors import UserError
from lmscale_jax.finetune import labels, pairs
from lmscale_jax.search import index, query
from lmscale_jax.similarity import function_groups
from lmscale_jax.store import dataset
from tests.helpers import ROOT, lmscale, make_synthetic_dataset
from tests.test_hf_tools import exported, run, run_tool  # noqa: F401 (fixtures)
from tests.test_search_index import binaries, built, model  # noqa: F401 (fixtures)

# The locale under which Python's own stdin decoding is strict (a bad byte: UnicodeDecodeError)
ENV = dict(os.environ, JAX_PLATFORMS="cpu", LC_ALL="C.UTF-8", PYTHONPATH=ROOT)
LONE = '"push rbp [NEXT] mov \\ud800 rsp"'  # JSON text of a string with a lone surrogate
DEEP = "[" * 100_000


def one_error_line(stderr: str, *parts: str) -> None:
  lines = stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-2000:]
  for part in parts:
    assert part in lines[0], (part, lines[0])


def command(tool: str, *argv, stdin: bytes | None = None) -> subprocess.CompletedProcess:
  """The subcommand as a process, bytes in its argv as they are (argv of invalid UTF-8 is what
  a shell passes; Python turns its bad bytes into lone surrogates)."""
  return subprocess.run([*lmscale(tool), *[a if isinstance(a, bytes) else str(a) for a in argv]],
                        cwd=ROOT, capture_output=True, timeout=180, env=ENV, input=stdin)


needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc (the index)")


# --------------------------------------------------------------------------- argv and stdin
@needs_gcc
@pytest.mark.parametrize("tool", ["fill_mask", "search"])
def test_a_text_argument_of_invalid_utf8_is_one_line_naming_the_argument(tool, run, built):
  extra = ["--index", built[0]] if tool == "search" else []
  r = command(tool, "--workdir", run[1], *extra, "--text", b"push rbp [NEXT] \xff [MASK]")
  assert r.returncode == 1
  one_error_line(r.stderr.decode(), "argument --text: not valid Unicode", "character 16",
                 "expected UTF-8 text")


@needs_gcc
def test_standard_input_of_invalid_utf8_is_one_line_naming_its_line(run, built, tmp_path):
  out = tmp_path / "answers.json"
  r = command("search", "--index", built[0], "--workdir", run[1], "--text", "-", "--json", out,
              stdin=b"push rbp\nmov rbp rsp\n\xff\xfe rbp\n")
  assert r.returncode == 1
  one_error_line(r.stderr.decode(), "--text - (standard input):3: not valid UTF-8",
                 "byte 0xff at offset 21")
  assert not out.exists()


@needs_gcc
@pytest.mark.parametrize("text", ["", "   ", "[NEXT]", " [NEXT] \n [NEXT] "],
                         ids=["empty", "blank", "next", "separators"])
def test_a_search_query_with_no_instruction_is_refused_not_scored_nan(text, run, built,
                                                                     tmp_path, capsys):
  out = tmp_path / "answers.json"
  code, stdout, err = run_tool("search", ["--index", built[0], "--workdir", run[1], "--text",
                                          text, "--json", out], capsys)
  assert code == 1 and stdout == "" and not out.exists()
  one_error_line(err, "the query text holds no instruction", "expected normalised instructions")


@needs_gcc
def test_a_text_of_no_token_embeds_as_the_zero_vector_and_scores_zero_not_nan(model, built):
  vectors, encoded = index.embed_texts(model, [("empty", ""), ("one", "push rbp")])
  assert len(encoded[0][0]) == 2  # [CLS] [SEP]: no token of its own
  assert np.isfinite(vectors).all() and not vectors[0].any()
  assert np.linalg.norm(vectors[1]) == pytest.approx(1.0, abs=1e-5)
  corpus = query.load(built[0], model)
  answer, = query.search(model, corpus, [("empty", None, "")], 3)
  assert [r["score"] for r in answer["results"]] == [0.0, 0.0, 0.0]


# --------------------------------------------------------------------------- labels, pairs
def labels_file(path, last: bytes) -> str:
  """Eight good examples of two classes, then ``last`` as line 9."""
  rows = [{"text": "push rbp [NEXT] ret", "label": "a"}, {"text": "xor eax eax", "label": "b"}]
  path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows * 4) + last + b"\n")
  return str(path)


BAD_LINES = {
    "invalid_utf8": (b'{"text": "push \xff rbp", "label": "a"}', "not valid UTF-8 (byte 0xff"),
    "lone_surrogate": (b'{"text": ' + LONE.encode() + b', "label": "a"}',
                       "text: not valid Unicode: character 20 is U+D800"),
    "deep": (DEEP.encode(), "JSON nested too deeply"),
}


@pytest.mark.parametrize("fault", sorted(BAD_LINES))
def test_a_labels_file_of_text_that_is_not_valid_unicode_is_refused_naming_file_and_line(
    fault, tmp_path):
  line, message = BAD_LINES[fault]
  path = labels_file(tmp_path / "train.jsonl", line)
  with pytest.raises(UserError) as e:
    labels.read(path)
  assert str(e.value).startswith(f"{path}:9: ") and message in str(e.value)


def pairs_file(path, last: bytes) -> str:
  """A function-groups file: its header, four groups of two variants, then ``last``."""
  head = {"format": function_groups.FORMAT, "variants": ["gcc-O0", "gcc-O2"]}
  groups = [{"source": "a.c", "name": f"f{i}", "variants": {
      "gcc-O0": {"text": "push rbp [NEXT] ret"}, "gcc-O2": {"text": "ret"}}} for i in range(4)]
  path.write_bytes(b"".join(json.dumps(x).encode() + b"\n" for x in [head, *groups]) + last
                   + b"\n")
  return str(path)


PAIRS_LINES = {
    "invalid_utf8": (b'{"source": "a.c", "name": "g", "variants": {"gcc-O0": {"text": "\xc3"}}}',
                     "not valid UTF-8 (byte 0xc3"),
    "lone_surrogate": (b'{"source": "a.c", "name": "g", "variants": {"gcc-O0": {"text": '
                       + LONE.encode() + b'}, "gcc-O2": {"text": "ret"}}}',
                       "variants.gcc-O0.text: not valid Unicode"),
    "deep": (DEEP.encode(), "JSON nested too deeply"),
    "array": (b"[1, 2]", "a JSON list, expected an object"),
}


@pytest.mark.parametrize("fault", sorted(PAIRS_LINES))
def test_a_pairs_file_line_that_is_not_valid_text_or_an_object_is_refused_naming_the_line(
    fault, tmp_path):
  line, message = PAIRS_LINES[fault]
  path = pairs_file(tmp_path / "pairs.jsonl", line)
  with pytest.raises(UserError) as e:
    pairs.load(path)
  assert f"{path}:6: " in str(e.value) and message in str(e.value)


def test_a_pairs_file_whose_header_is_not_an_object_is_one_line(tmp_path):
  path = tmp_path / "pairs.jsonl"
  path.write_text("[1]\n")
  with pytest.raises(UserError, match=f"{path}:1: a JSON list, expected an object"):
    function_groups.load(str(path))


def test_finetune_refuses_bad_labels_and_pairs_files_in_one_line_before_any_work(run, tmp_path):
  surrogate = labels_file(tmp_path / "train.jsonl", BAD_LINES["lone_surrogate"][0])
  good = labels_file(tmp_path / "test.jsonl", b"")
  bad_bytes = pairs_file(tmp_path / "pairs.jsonl", PAIRS_LINES["invalid_utf8"][0])
  cases = [(["--task", "classify", "--labels", surrogate, "--eval-labels", good],
            f"{surrogate}:9: text: not valid Unicode"),
           (["--pairs", bad_bytes], f"{bad_bytes}:6: not valid UTF-8")]
  for argv, message in cases:
    workdir = tmp_path / "out"
    r = command("finetune", *argv, "--workdir", workdir, "--init-workdir", run[1],
                "--batch-size", 2, "--steps", 2)
    assert r.returncode == 1
    one_error_line(r.stderr.decode(), message)
    assert not workdir.exists()  # refused before the workdir, the runtime, a checkpoint


# --------------------------------------------------------------------------- metadata.json
def edited(tmp_path, edit) -> str:
  """A real dataset directory whose metadata.json ``edit`` changed."""
  where = tmp_path / "ds"
  make_synthetic_dataset(str(where), n_train=16, n_val=8, shards=1)
  path = where / dataset.METADATA
  raw = json.loads(path.read_text())
  edit(raw)
  path.write_text(json.dumps(raw))
  return str(where)


def _set(*keys_value):
  *keys, value = keys_value

  def edit(raw):
    for k in keys[:-1]:
      raw = raw[k]
    raw[keys[-1]] = value
  return edit


METADATA_FAULTS = {
    "split_records_negative": (_set("splits", "train", "records", -1),
                               "splits.train.records is -1; expected an integer >= 0"),
    "split_records_not_the_sum": (_set("splits", "train", "records", 15),
                                  "splits.train.records is 15; expected 16, the sum"),
    "splits_an_array": (_set("splits", []), "splits is a JSON array; expected a JSON object"),
    "shards_a_string": (_set("splits", "train", "shards", "x"),
                        'splits.train.shards is "x"; expected a JSON array'),
    "shard_records_negative": (_set("splits", "train", "shards", 0, "records", -1),
                               "splits.train.shards[0].records is -1"),
    "shard_file_outside": (_set("splits", "train", "shards", 0, "file", "../../etc/passwd"),
                           "splits.train.shards[0].file is \"../../etc/passwd\"; expected a "
                           "file name in the dataset directory"),
    "shard_sha256_null": (_set("splits", "validation", "shards", 0, "sha256", None),
                          "splits.validation.shards[0].sha256 is null; expected 64 lowercase"),
    "seq_len_a_string": (_set("seq_len", "64"), 'seq_len is "64"; expected an integer in 1..'),
    "seq_len_negative": (_set("seq_len", -5), "seq_len is -5"),
    "vocab_size_a_bool": (_set("vocab_size", True), "vocab_size is true; expected an integer"),
    "vocab_size_a_word": (_set("vocab_size", "big"), 'vocab_size is "big"'),
    "special_id_past_the_vocabulary": (_set("special_ids", "[PAD]", 999),
                                       "special_ids.[PAD] is 999; expected an integer in 0..127"),
    "special_ids_an_array": (_set("special_ids", []), "special_ids is a JSON array"),
    "name_a_number": (_set("name", 5), "name is 5; expected a non-empty string"),
    "packing_unknown": (_set("packing", "tight"), 'packing is "tight"; expected "greedy" or'),
}


@pytest.mark.parametrize("fault", sorted(METADATA_FAULTS))
def test_a_metadata_field_of_the_wrong_type_or_range_is_one_line_naming_file_and_key(
    fault, tmp_path, capsys):
  edit, message = METADATA_FAULTS[fault]
  where = edited(tmp_path, edit)
  code, out, err = run_tool("inspect_data", [where, "--verify"], capsys)
  assert code == 1 and "verify:" not in out
  one_error_line(err, os.path.join(where, dataset.METADATA) + ": " + message)


def test_a_metadata_file_of_invalid_utf8_or_nested_too_deeply_is_one_line(tmp_path, capsys):
  where = edited(tmp_path, lambda raw: None)
  path = os.path.join(where, dataset.METADATA)
  for text, message in ((b'{"name": "\xff"}', "not valid UTF-8 (byte 0xff at offset 10"),
                        (DEEP.encode(), "JSON nested too deeply")):
    with open(path, "wb") as f:
      f.write(text)
    code, _, err = run_tool("inspect_data", [where], capsys)
    assert code == 1
    one_error_line(err, f"{path}: {message}")


def test_an_intact_dataset_still_verifies(tmp_path, capsys):
  where = edited(tmp_path, lambda raw: None)
  code, out, err = run_tool("inspect_data", [where, "--verify"], capsys)
  assert code == 0 and "verify: 2/2 shards OK" in out, err

