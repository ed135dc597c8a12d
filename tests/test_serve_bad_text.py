"""lmscale serve's API on text that is not valid Unicode, JSON nested too deeply, and a search
text with no instruction in it: each a 400 whose one line names the field (store/user_text.py's
check of every JSON body, search/listing.py's refusal of an empty query) — before, HTTP 500
(TypeError in the tokenizer, RecursionError in the parser, a NaN score that JSON cannot carry).
The real server (tests/test_serve_api.py's: a subprocess on a free port, a real short training
run, a real index) and standard-library HTTP clients."""

from __future__ import annotations

import shutil

import pytest

from tests.test_hf_tools import exported, run, run_tool  # noqa: F401 (fixtures)
from tests.test_search_index import binaries  # noqa: F401 (a fixture)
from tests.test_serve_api import call, index_dir, libs, post_json, server  # noqa: F401

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

JSON = "application/json"
LONE = b'"push rbp [NEXT] \\ud800 [MASK]"'  # a JSON string holding a lone surrogate
DEEP = b"[" * 50_000  # under the test server's 0.1 MB body limit

BAD_BODIES = {
    "fill-mask, a lone surrogate": ("/api/fill-mask", b'{"text": ' + LONE + b"}",
                                    "request body: text: not valid Unicode: character 16 is "
                                    "U+D800"),
    "embed, a lone surrogate in the second text": (
        "/api/embed", b'{"texts": ["push rbp", ' + LONE + b"]}",
        "request body: texts[1]: not valid Unicode"),
    "search, a lone surrogate": ("/api/search", b'{"text": ' + LONE + b', "k": 2}',
                                 "request body: text: not valid Unicode"),
    "search, a key with a lone surrogate": ("/api/search", b'{"text": "ret", "\\udc80": 1}',
                                            "request body: a key: not valid Unicode"),
    "fill-mask, invalid UTF-8 bytes": ("/api/fill-mask", b'{"text": "push \xff [MASK]"}',
                                       "request body: not valid UTF-8 (byte 0xff at offset 15"),
    "embed, invalid UTF-8 bytes": ("/api/embed", b'{"texts": ["\xed\xa0\x80"]}',
                                   "request body: not valid UTF-8 (byte 0xed"),
    "fill-mask, nested too deeply": ("/api/fill-mask", b'{"text": ' + DEEP,
                                     "request body: JSON nested too deeply"),
    "embed, nested too deeply": ("/api/embed", DEEP, "request body: JSON nested too deeply"),
    "search, nested too deeply": ("/api/search", DEEP, "request body: JSON nested too deeply"),
}


def one_line_400(status, answer, *words):
  assert status == 400, (status, answer)
  assert list(answer) == ["error"] and "\n" not in answer["error"], answer
  for w in words:
    assert w in answer["error"], (w, answer)


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
def test_text_that_is_not_valid_unicode_or_too_deep_is_a_400_naming_the_field(case, server):
  path, body, words = BAD_BODIES[case]
  one_line_400(*call(server[0], path, body, JSON), words)
  assert call(server[0], "/api/info")[0] == 200


@pytest.mark.parametrize("text", ["[NEXT]", " [NEXT] \n [NEXT] "], ids=["next", "separators"])
def test_a_search_text_with_no_instruction_is_a_400_not_a_nan_answer(text, server):
  one_line_400(*post_json(server[0], "/api/search", {"text": text, "k": 2}),
               "text: the query text holds no instruction")


def test_valid_text_beside_them_is_answered_and_no_traceback_was_logged(server):
  status, got = post_json(server[0], "/api/search", {"text": "push rbp [NEXT] ret \U0001f600",
                                                     "k": 2})
  assert status == 200 and [type(r["score"]) for r in got["queries"][0]["results"]] == [float] * 2
  status, got = post_json(server[0], "/api/embed", {"texts": ["push rbp", "mov \u00e9ax 1"]})
  assert status == 200 and len(got["embeddings"]) == 2, got
  for path, body, _ in BAD_BODIES.values():
    call(server[0], path, body, JSON)
  assert "Traceback" not in (server[1] / "server.log").read_text()
