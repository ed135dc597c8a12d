"""lmscale serve with a naming model (--namer-workdir): /api/name answers what lmscale name
answers for the same functions, and the page shows each query function's suggested names. The
real server (a subprocess) on tests/test_finetune.py's pretraining run, with
tests/test_finetune_name.py's naming fine-tune and an index of the real stripped gcc library of
tests/test_name_command.py; the page in a real browser (tests/test_serve_page.py's)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from lmscale_jax.cli import index as index_cli
from lmscale_jax.prep.elf import elf_functions
from tests.helpers import ROOT
from tests.test_finetune import bench, pretrained, rows  # noqa: F401 (fixtures)
from tests.test_finetune_name import named, task_dir  # noqa: F401 (fixtures)
from tests.test_hf_tools import run_tool
from tests.test_name_command import pytestmark, stripped  # noqa: F401 (a fixture; gcc, strip)
from tests.test_serve_api import call, post_file, post_json, serve_command, start, stop
from tests.test_serve_page import CHROMIUM, browser_python

TOKEN = "name-token"


@pytest.fixture(scope="module")
def server(pretrained, named, stripped, tmp_path_factory):
  """The pretraining run, an index of the stripped library, and the naming fine-tune."""
  base = tmp_path_factory.mktemp("name-server")
  assert index_cli.main(["--workdir", str(pretrained[1]), "--elf", str(stripped[0]),
                         "--output", str(base / "idx")]) == 0
  p, url = start(["--workdir", pretrained[1], "--index", base / "idx", "--namer-workdir", named,
                  "--token", TOKEN, "--max-texts", 4, "--max-k", 20], base / "server.log")
  try:
    yield url, base
  finally:
    stop(p)


def cli_names(named, elf, capsys, *extra) -> dict:
  """lmscale name --json's answer."""
  code, _, err = run_tool("name", ["--workdir", named, "--elf", elf, "--json",
                                   elf.parent / "names.json", *extra], capsys)
  assert code == 0, err
  return json.load(open(elf.parent / "names.json"))


def test_info_names_the_naming_model_and_its_rule(server, named):
  status, info = call(server[0], "/api/info", token=TOKEN)
  assert status == 200, info
  rule = json.load(open(named / "naming_eval.json"))["rule"]
  vocab = json.load(open(named / "name_vocab.json"))["tokens"]
  assert info["naming"] == {"model": f"{named} step 60", "rule": rule,
                            "vocabulary": len(vocab)}


def test_an_uploads_names_equal_the_name_commands(server, named, stripped, capsys):
  want = cli_names(named, stripped[0], capsys, "--top", 3)
  status, got = post_file(server[0], "/api/name", open(stripped[0], "rb").read(),
                          "libstrings.stripped.so", token=TOKEN, k="3")
  assert status == 200, got
  assert (got["model"], got["rule"], got["k"]) == (f"{named} step 60", want["rule"], 3)
  assert len(got["functions"]) == len(want["functions"]) >= 20
  for g, w in zip(got["functions"], want["functions"], strict=True):
    assert (g["function"], hex(g["address"])) == (w["function"], w["address"])
    assert (g["suggested"], g["tokens"]) == (w["suggested"], w["tokens"])


def test_one_functions_names_equal_the_name_commands_and_a_texts_the_namers(server, named,
                                                                            stripped, capsys):
  """One function of an upload (by address) is named as lmscale name --address names it, with
  the namespace of the whole file (callee_copy.file_shares); its text alone, as /api/embed
  takes texts (the page sends a search's query texts), as name_suggestions names that text."""
  from lmscale_jax.inference import name_suggestions

  fn = elf_functions.functions(str(stripped[0]))[2]
  want = cli_names(named, stripped[0], capsys, "--address", hex(fn.address))["functions"]
  status, one = post_file(server[0], "/api/name", open(stripped[0], "rb").read(), "lib.so",
                          token=TOKEN, address=hex(fn.address))
  assert status == 200, one
  assert [(g["suggested"], g["tokens"]) for g in one["functions"]] == \
      [(w["suggested"], w["tokens"]) for w in want]
  status, got = post_json(server[0], "/api/name", {"texts": [fn.text]}, token=TOKEN)
  assert status == 200 and got["k"] == 5, got
  mine = name_suggestions.suggest(name_suggestions.load(str(named)), [fn.text], 5)
  assert [(g["function"], g["address"], g["suggested"], g["tokens"]) for g in got["functions"]] \
      == [(None, None, m["suggested"], m["tokens"]) for m in mine]


def test_bad_naming_requests_are_one_line(server, stripped):
  so = open(stripped[0], "rb").read()
  cases = [
      (post_json(server[0], "/api/name", {"texts": []}, token=TOKEN), 400,
       "texts: expected a non-empty list of strings"),
      (post_json(server[0], "/api/name", {"texts": ["ret", 7]}, token=TOKEN), 400,
       "texts[1]: expected a non-empty string"),
      (post_json(server[0], "/api/name", {"texts": ["ret"] * 5}, token=TOKEN), 413,
       "5 texts, over the server's limit of 4"),
      (post_json(server[0], "/api/name", {"texts": ["ret"], "k": 21}, token=TOKEN), 400,
       "k: 21 is out of range; expected an integer in 1..20"),
      (post_json(server[0], "/api/name", {"k": 3}, token=TOKEN), 400,
       "text: expected a non-empty string"),
      (post_json(server[0], "/api/name", {"texts": ["ret", "ret"], "calls": [["free"]]},
                 token=TOKEN), 400, "calls: expected a list of 2 (one per text)"),
      (post_json(server[0], "/api/name", {"texts": ["ret"], "calls": [[3]]}, token=TOKEN), 400,
       "calls[0]: expected a list of names or null"),
      (post_json(server[0], "/api/name", {"texts": ["ret"], "file_shares": {"gz": 2}},
                 token=TOKEN), 400, "file_shares['gz']: expected a number in [0, 1], got 2"),
      (post_json(server[0], "/api/name", {"texts": ["ret"], "file_shares": [0.5]},
                 token=TOKEN), 400, "file_shares: expected an object {sub-token: share"),
      (post_file(server[0], "/api/name", b"hello\n" * 50, "notes.txt", token=TOKEN), 400,
       "notes.txt: not an ELF file"),
      (post_file(server[0], "/api/name", so, "lib.so", token=TOKEN, address="0x1"), 404,
       "lib.so"),
      (call(server[0], "/api/name", b"[1]", "application/json", token=TOKEN), 400,
       '{"texts": ['),
      (post_json(server[0], "/api/name", {"texts": ["ret"]}, token=None), 401,
       "Authorization: Bearer"),
  ]
  for (status, answer), want, words in cases:
    assert status == want and list(answer) == ["error"], (words, status, answer)
    assert "\n" not in answer["error"] and words in answer["error"], (words, answer)
  assert "Traceback" not in (server[1] / "server.log").read_text()


def test_a_model_that_is_not_a_naming_fine_tune_is_refused_at_start(pretrained):
  p = subprocess.run(serve_command("--workdir", pretrained[1], "--namer-workdir", pretrained[1],
                                   "--port", 0), capture_output=True, text=True, cwd=ROOT,
                     timeout=180)
  assert p.returncode == 1 and "serving" not in p.stdout, p.stderr
  assert p.stderr.strip() == (f"error: --namer-workdir {pretrained[1]} is not a naming fine-tune "
                              "(lmscale finetune --task name makes one; lmscale export-hf "
                              "exports it)")


@pytest.mark.skipif(CHROMIUM is None or browser_python() is None,
                    reason="needs Chromium and the browser venv (tests/test_serve_page.py)")
def test_the_page_shows_each_query_functions_suggested_names(server, named, stripped,
                                                             tmp_path, capsys):
  job = {"names_url": server[0], "token": TOKEN, "upload": str(stripped[0]),
         "chromium": CHROMIUM, "report": str(tmp_path / "report.json"),
         "names_screenshot": str(tmp_path / "names.png")}
  (tmp_path / "job.json").write_text(json.dumps(job))
  p = subprocess.run([browser_python(), os.path.join(ROOT, "tests", "browser", "drive_page.py"),
                      str(tmp_path / "job.json")], capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-4000:]
  seen = json.loads((tmp_path / "report.json").read_text())["names"]
  want = cli_names(named, stripped[0], capsys)["functions"]
  assert seen["status"] == 200 and seen["error"] is None and seen["page_errors"] == []
  assert f"naming model {named} step 60" in seen["info"]
  assert seen["queries"] == [w["function"] for w in want]
  assert seen["listed"] == [f"→ {w['suggested'] or '?'}" for w in want]
  assert [(s["suggested"], s["tokens"]) for s in seen["selected"]] == [
      (w["suggested"] or "(none)", [f"{t} {p:.4f}" for t, p in w["tokens"]]) for w in want]
  assert all(s["heading"].startswith(f"Query: {w['function']}") and s["results"] > 0
             for s, w in zip(seen["selected"], want))
  assert (tmp_path / "names.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
