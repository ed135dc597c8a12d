"""lmscale serve's page in a real headless browser: the real server (a subprocess on a free port)
on a real (short) training run and a real index of gcc-compiled shared libraries, driven by
tests/browser/drive_page.py (Playwright in its own venv, .venv-browser, and Debian's Chromium;
tools/test.sh makes both). The script clicks through the page once and reports what it saw;
each test here asserts on one part of that report."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from lmscale_jax.cli import index as index_cli
from lmscale_jax.prep.elf import elf_functions
from tests.helpers import ROOT
from tests.test_hf_tools import run  # noqa: F401 (fixture)
from tests.test_search_index import binaries  # noqa: F401 (fixture: libs uses it)
from tests.test_serve_api import (index_dir, libs, post_file, post_json, start,  # noqa: F401
                                  stop)

TOKEN = "page-token"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
LONG_ASM = "\n".join(["push rbp", "mov rbp rsp"] * 40)  # past the run's seq_len of 64
FILL_MASK = "push rbp\nmov rbp rsp\n[MASK] rsp 0x10\nmov eax [MASK]"


def browser_python() -> str | None:
  """$LMSCALE_BROWSER_PYTHON (tools/test.sh exports it), else .venv-browser's if it is there."""
  default = os.path.join(ROOT, ".venv-browser", "bin", "python")
  return os.environ.get("LMSCALE_BROWSER_PYTHON") or (default if os.path.exists(default) else None)


pytestmark = [
    pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc"),
    pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium: apt-get install -y chromium "
                       "(bash tools/test.sh installs it when run as root)"),
    pytest.mark.skipif(browser_python() is None, reason="no browser venv: run the tests with "
                       "bash tools/test.sh, which makes .venv-browser (playwright) once, or set "
                       "LMSCALE_BROWSER_PYTHON"),
]


@pytest.fixture(scope="module")
def server(run, index_dir, tmp_path_factory):
  base = tmp_path_factory.mktemp("page-server")
  p, url = start(["--workdir", run[1], "--index", index_dir, "--token", TOKEN,
                  "--max-upload-mb", 1],
                 base / "server.log")
  try:
    yield url, base
  finally:
    stop(p)


@pytest.fixture(scope="module")
def twin_server(run, libs, tmp_path_factory):
  """A server whose index holds maths_O0.so and a copy of it: each function has a twin of
  identical text (the search marks those: same_text_as, same_text_as_query)."""
  base = tmp_path_factory.mktemp("twin-server")
  twin = base / "maths_twin.so"
  shutil.copy(libs["O0"][2], twin)
  with open(twin, "ab") as f:  # another sha256 (an identical file is indexed once), the same code
    f.write(b"\0")
  assert index_cli.main(["--workdir", str(run[1]), "--elf", libs["O0"][2], str(twin),
                         "--output", str(base / "idx")]) == 0
  p, url = start(["--workdir", run[1], "--index", base / "idx", "--token", TOKEN],
                 base / "server.log")
  try:
    yield url, base
  finally:
    stop(p)


@pytest.fixture(scope="module")
def report(server, twin_server, libs, tmp_path_factory):
  """What the browser saw (tests/browser/drive_page.py's report) and the server's log."""
  python = browser_python()
  assert os.path.exists(python), f"LMSCALE_BROWSER_PYTHON={python}: no such interpreter"
  base = tmp_path_factory.mktemp("page")
  (base / "notes.txt").write_text("hello\n" * 100)
  (base / "big.so").write_bytes(b"\x7fELF" + bytes(3 << 20))
  job = {"url": server[0], "token": TOKEN, "upload": libs["O0"][2], "pick": "power",
         "asm": LONG_ASM, "fillmask": FILL_MASK, "bad": str(base / "notes.txt"),
         "big": str(base / "big.so"),
         "report": str(base / "report.json"), "screenshot": str(base / "page.png"),
         "chromium": CHROMIUM, "twin_url": twin_server[0]}
  (base / "job.json").write_text(json.dumps(job))
  p = subprocess.run([python, os.path.join(ROOT, "tests", "browser", "drive_page.py"),
                      str(base / "job.json")], capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-4000:]
  log = (server[1] / "server.log").read_text()
  return json.loads((base / "report.json").read_text()), log, base


def lines(text: str) -> list[str]:
  return [x.strip() for x in text.replace("[NEXT]", "\n").splitlines() if x.strip()]


def test_the_page_shows_the_model_and_the_index_and_labels_every_input(report, run, index_dir):
  seen = report[0]["with_token"]
  assert seen["info"].startswith(f"Model {run[1]} step 6 (sequence length 64, mean pooling)")
  assert f"index {os.path.abspath(index_dir)}: 9 functions of 3 binaries" in seen["info"]
  assert seen["error_at_load"] is None and seen["labelled"]
  assert seen["outside_requests"] == [] and seen["page_errors"] == []
  assert (report[2] / "page.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_uploaded_function_finds_itself_first_in_the_index(report, libs):
  seen = report[0]["with_token"]["compare"]
  maths = {f.name: f for f in elf_functions.functions(libs["O0"][2])}
  assert seen["status"] == 200 and seen["error"] is None
  assert sorted(seen["queries"]) == sorted(maths)
  rank, score, function, address, binary = seen["results"][0]
  assert (rank, function, address, binary) == ("1", "power", hex(maths["power"].address),
                                               "maths_O0.so")
  assert float(score) >= 0.9999 and len(seen["results"]) == 9  # k 10 > the index's 9
  assert not seen["names_shown"]  # no naming model (tests/test_serve_name.py: with one)


def test_a_selected_result_shows_both_texts_side_by_side(report, libs):
  seen = report[0]["with_token"]["compare"]
  text = {f.name: f.text for f in elf_functions.functions(libs["O0"][2])}["power"]
  assert lines(seen["query_text"]) == lines(text)
  assert lines(seen["result_text"]) == lines(text)  # the top hit is power itself
  assert seen["differing_lines"] == [0, 0]  # the lines only one side has are marked: none
  other = report[0]["with_token"]["second_result"]  # another function: some lines differ
  assert other["heading"].startswith(f"Result: {seen['results'][1][2]} @ {seen['results'][1][3]}")
  assert other["error"] is None and min(other["differing_lines"]) > 0
  assert lines(other["query_text"]) == lines(text)


def test_a_query_past_the_sequence_length_is_marked_cut_in_the_list_and_the_note(report,
                                                                                 server, libs):
  """At the run's seq_len of 64 each function of maths.c is cut (the API says so too)."""
  seen = report[0]["with_token"]["compare"]
  status, want = post_file(server[0], "/api/search", open(libs["O0"][2], "rb").read(),
                           "maths_O0.so", token=TOKEN, function="power", k="1")
  assert status == 200 and want["queries"][0]["cut"], want
  assert seen["cut_marked"] and seen["cut_note_visible"]


def test_pasted_assembly_is_searched_and_the_page_says_it_was_cut(report):
  seen = report[0]["with_token"]["asm"]
  assert seen["status"] == 200 and seen["error"] is None and seen["file_cleared"]
  assert seen["queries"] == ["text"] and seen["results"] == 9
  assert lines(seen["query_text"]) == LONG_ASM.splitlines()  # one instruction a line
  assert seen["cut_note_visible"]
  assert "only the first 62 tokens of this query were embedded" in seen["cut_note"]


def test_fill_mask_shows_the_apis_predictions_for_each_mask(report, server):
  seen = report[0]["with_token"]["fillmask"]
  text = FILL_MASK.replace("\n", " [NEXT] ")
  status, want = post_json(server[0], "/api/fill-mask", {"text": text, "k": 5}, token=TOKEN)
  assert status == seen["status"] == 200 and seen["error"] is None
  assert seen["masks"] == [[[p["token"], f"{p['score']:.4f}"] for p in m["predictions"]]
                           for m in want["masks"]]


def test_a_non_elf_upload_is_one_error_and_the_next_search_works(report):
  seen = report[0]["with_token"]["bad"]
  assert seen["status"] == 400
  assert seen["error"].startswith("400: notes.txt: not an ELF file") and "\n" not in seen["error"]
  assert seen["after_status"] == 200 and seen["after_error"] is None
  assert "power" in seen["after_queries"]
  assert "Traceback" not in report[1]


def test_a_failed_search_clears_the_results_of_the_one_before(report):
  """A refused upload (400) and one the page refuses itself: no earlier query's results are
  left to be read as the failed one's."""
  for seen in (report[0]["with_token"]["bad"], report[0]["with_token"]["too_big"]):
    assert seen["before"]["rows"] > 0 and seen["before"]["queries"], seen["before"]
    assert seen["left"] == {"rows": 0, "queries": [],
                            "texts": ["", ""]}, seen["left"]


def test_identical_texts_are_marked_and_the_warning_shown_as_the_api_says(report, twin_server,
                                                                          libs):
  """The page shows what /api/search answers for the same upload: "= #R" where a result's text
  is the same as result R's, "= query" where it is the query's, and the answer's warning above
  the results. (Before the search's same_text_as fields existed, no marks: asserted alike.)"""
  seen = report[0]["twins"]
  status, want = post_file(twin_server[0], "/api/search", open(libs["O0"][2], "rb").read(),
                           "maths_O0.so", token=TOKEN, function="power", k="10")
  assert status == seen["status"] == 200 and seen["error"] is None
  results = want["queries"][0]["results"]
  assert [r["function"] for r in seen["results"]] == [r["function"] for r in results]
  assert [r["function"] for r in results[:2]] == ["power", "power"]  # the twins, first
  marks = [([f"= #{r['same_text_as']}"] if r.get("same_text_as") else [])
           + (["= query"] if r.get("same_text_as_query") else []) for r in results]
  assert [r["marks"] for r in seen["results"]] == marks
  if "same_text_as" in results[1]:
    assert marks[1] == ["= #1", "= query"]
  assert seen["warning"] == (want.get("warning") or None)
  assert "exclusive" in seen["exclusive_note"] and seen["file_cleared_by_text"]


def test_an_upload_over_the_limit_is_refused_by_the_page_before_it_is_sent(report):
  seen = report[0]["with_token"]["too_big"]
  assert seen["error"] == ("big.so: 3.0 MB, over the server's limit of 1.0 MB "
                           "(lmscale serve --max-upload-mb)")
  assert seen["requests"] == []


def test_without_the_token_the_page_shows_the_401_until_it_is_given(report):
  seen = report[0]["without_token"]
  assert seen["error"].startswith("401: missing or wrong access token")
  assert "\n" not in seen["error"]
  assert seen["info"] == "The model's description could not be read."
  assert seen["error_after_token"] is None  # #token= added to the open page: answered
