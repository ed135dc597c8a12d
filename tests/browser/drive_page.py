"""Drives lmscale serve's page in a real headless browser (Debian's Chromium through Playwright)
and writes what it saw as JSON; tests/test_serve_page.py asserts on that report.

  python drive_page.py JOB.json     (in the venv that has playwright: tools/test.sh's .venv-browser)

JOB: {"url": the server's base URL (optional: without it, only "names_url" is driven), "token":
the access token, "upload": an ELF file (one the
index holds), "pick": a function of it, "asm": normalised assembly text, "fillmask": a text with
[MASK], "bad": a file that is not ELF, "big": one over the server's upload limit, "report":
where the report goes, "screenshot": where the page goes (PNG, 1200×800, a query selected and a
result compared), "chromium": the browser, optionally "k": results per query (default 10) and
"twin_url": a second server whose index holds two copies of "upload" (identical texts) and
"names_url": a server with a naming model (its page's suggested names for "upload"; its
screenshot: "names_screenshot")}.

Runs only the standard library and playwright (no lmscale_jax: this venv has no jax). The
browser is the system's: Playwright's own download (``playwright install``) is never used.
README's docs/images/serve-page.png is this script's screenshot (the demo's 200-step run, an
index of three small -O0 libraries and libz; numbers.so's ipow selected, "k": 5), made smaller
with Pillow: Image.open(p).convert("RGB").quantize(128, method=Image.Quantize.FASTOCTREE)
.save(out, optimize=True): 150 → 46 KB."""

from __future__ import annotations

import json
import sys
import tempfile

from playwright.sync_api import sync_playwright

ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WAIT_MS = 60_000  # one model call on a loaded 2-core machine: seconds; the limit: a hang
ERROR_SHOWN = "!document.querySelector('#error').hidden"  # a wait ends on an error too
SHOWN = ("document.querySelector('#result-text').textContent.trim() && "
         "!document.querySelector('#result-text .empty')")  # a result's text is in


CELLS = ("r => [...r.cells].map(c => { const k = c.cloneNode(true); "
         "k.querySelectorAll('.same-mark').forEach(m => m.remove()); return k.textContent; })")


def cells(row) -> list[str]:
  """A result row's cells as text, without its marks ("= #R", "= query": read apart)."""
  return row.evaluate(CELLS)


def texts(page, selector: str) -> list[str]:
  return page.locator(selector).all_inner_texts()


def error_shown(page) -> str | None:
  """#error's text when it is visible, else None."""
  return page.inner_text("#error") if page.is_visible("#error") else None


def search(page) -> int:
  """Clicks #search-btn; the HTTP status of its /api/search, once the page has shown it."""
  with page.expect_response("**/api/search", timeout=WAIT_MS) as answer:
    page.click("#search-btn")
  page.wait_for_selector("#search-btn:not([disabled])", timeout=WAIT_MS)
  return answer.value.status


def without_token(browser, job) -> dict:
  """The page opened without its #token=: what #info and #error say, then with it added."""
  page = browser.new_page()
  page.goto(job["url"] + "/")
  page.wait_for_selector("#error:not([hidden])", timeout=WAIT_MS)
  seen = {"error": error_shown(page), "info": page.inner_text("#info")}
  page.evaluate(f"location.hash = {json.dumps('token=' + job['token'])}")  # given later
  page.wait_for_function("document.querySelector('#info').textContent.startsWith('Model ')",
                         timeout=WAIT_MS)
  seen["error_after_token"] = error_shown(page)
  return seen


def compare(page, job) -> dict:
  """Upload → the query's functions → pick one → its results → the top result side by side."""
  page.set_input_files("#file", job["upload"])
  if job.get("k"):
    page.fill("#k", str(job["k"]))
  seen = {"status": search(page)}
  seen["queries"] = texts(page, ".query-item .name")
  page.locator(".query-item", has_text=job["pick"]).first.click()
  page.wait_for_function("document.querySelector('#query-h').textContent.includes("
                         f"{json.dumps(job['pick'])})", timeout=WAIT_MS)
  seen["results"] = [cells(page.locator("tr.result-row").nth(i))
                     for i in range(page.locator("tr.result-row").count())]
  page.locator("tr.result-row").first.click()
  page.wait_for_function(f"({SHOWN}) || {ERROR_SHOWN}", timeout=WAIT_MS)
  seen["query_text"] = page.inner_text("#query-text")
  seen["result_text"] = page.inner_text("#result-text")
  seen["differing_lines"] = [page.locator(f"{pre} .differs").count()
                             for pre in ("#query-text", "#result-text")]
  seen["cut_note_visible"] = page.is_visible("#cut-note")
  seen["cut_marked"] = page.locator(".query-item[aria-pressed=true] .cut-mark").count() == 1
  seen["names_shown"] = page.is_visible("#names") or page.locator(".suggested").count() > 0
  seen["error"] = error_shown(page)
  return seen


def second_result(page) -> dict:
  """The second result of the same query, compared: the lines only one side has marked."""
  name = cells(page.locator("tr.result-row").nth(1))[2]
  page.locator("tr.result-row").nth(1).click()
  page.wait_for_function(f"document.querySelector('#pair-note').textContent.trim() || "
                         f"{ERROR_SHOWN}", timeout=WAIT_MS)
  return {"name": name, "heading": page.inner_text("#result-h"), "error": error_shown(page),
          "query_text": page.inner_text("#query-text"),
          "differing_lines": [page.locator(f"{pre} .differs").count()
                              for pre in ("#query-text", "#result-text")]}


def asm_search(page, job) -> dict:
  page.fill("#asm", job["asm"])
  seen = {"status": search(page),
          "file_cleared": page.eval_on_selector("#file", "e => e.files.length == 0")}
  seen["queries"] = texts(page, ".query-item .name")
  seen["results"] = page.locator("tr.result-row").count()
  seen["query_text"] = page.inner_text("#query-text")
  seen["cut_note_visible"] = page.is_visible("#cut-note")
  seen["cut_note"] = page.inner_text("#cut-note")
  seen["error"] = error_shown(page)
  return seen


def fill_mask(page, job) -> dict:
  page.fill("#fillmask-text", job["fillmask"])
  with page.expect_response("**/api/fill-mask", timeout=WAIT_MS) as answer:
    page.click("#fillmask-btn")
  page.wait_for_selector("#fillmask-btn:not([disabled])", timeout=WAIT_MS)
  lists = page.locator("#fillmask-out ol")
  masks = [[[item.locator(".token").inner_text(), item.locator(".score").inner_text()]
            for item in lists.nth(i).locator("li").all()] for i in range(lists.count())]
  return {"status": answer.value.status, "error": error_shown(page), "masks": masks}


def shown_results(page) -> dict:
  return {"rows": page.locator("tr.result-row").count(),
          "queries": texts(page, ".query-item .name"),
          "texts": [page.inner_text(pre) for pre in ("#query-text", "#result-text")]}


def bad_upload_then_search(page, job) -> dict:
  """A non-ELF upload shows one error and clears the results shown before it; the next (good)
  search clears the error and answers."""
  before = shown_results(page)
  page.set_input_files("#file", job["bad"])
  seen = {"before": before, "status": search(page), "error": error_shown(page),
          "left": shown_results(page)}
  page.set_input_files("#file", job["upload"])
  seen["after_status"] = search(page)
  seen["after_error"] = error_shown(page)
  seen["after_queries"] = texts(page, ".query-item .name")
  return seen


def too_big_upload(page, job, requests: list) -> dict:
  """A file over the server's upload limit: refused by the page, before it is sent."""
  before = shown_results(page)
  page.set_input_files("#file", job["big"])
  sent = len(requests)
  page.click("#search-btn")
  page.wait_for_selector("#error:not([hidden])", timeout=WAIT_MS)
  return {"error": error_shown(page), "requests": requests[sent:], "before": before,
          "left": shown_results(page)}


def twins(browser, job) -> dict:
  """The twin server's page: an upload's function against two copies of it; each result's
  marks ("= #R", "= query") and the warning above the results, as shown."""
  page = browser.new_page()
  page.goto(f"{job['twin_url']}/#token={job['token']}")
  page.wait_for_function("document.querySelector('#info').textContent.startsWith('Model ')",
                         timeout=WAIT_MS)
  page.set_input_files("#file", job["upload"])
  page.fill("#function", job["pick"])
  seen = {"status": search(page), "error": error_shown(page)}
  rows = page.locator("tr.result-row")
  seen["results"] = [{"function": cells(rows.nth(i))[2],
                      "marks": rows.nth(i).locator(".same-mark").all_inner_texts()}
                     for i in range(rows.count())]
  seen["warning"] = page.inner_text("#search-warning") if page.is_visible("#search-warning") \
      else None
  seen["exclusive_note"] = page.inner_text("#exclusive-note")
  page.fill("#asm", "push rbp")  # typing text clears the chosen file, as the note says
  seen["file_cleared_by_text"] = page.eval_on_selector("#file", "e => e.files.length == 0")
  return seen


def names(browser, job) -> dict:
  """The naming server's page: an upload's functions, each with its suggested name in the list,
  and, each selected in turn, its name and best sub-tokens above its results."""
  page = browser.new_page()
  page_errors = []
  page.on("pageerror", lambda e: page_errors.append(str(e)))
  page.goto(f"{job['names_url']}/#token={job['token']}")
  page.wait_for_function("document.querySelector('#info').textContent.startsWith('Model ')",
                         timeout=WAIT_MS)
  page.set_input_files("#file", job["upload"])
  seen = {"info": page.inner_text("#info"), "status": search(page), "error": error_shown(page)}
  seen["queries"] = texts(page, ".query-item .name")
  seen["listed"] = texts(page, ".query-item .suggested")
  seen["selected"] = []
  for i in range(page.locator(".query-item").count()):
    page.locator(".query-item").nth(i).click()
    seen["selected"].append({"heading": page.inner_text("#query-h"),
                             "suggested": page.inner_text("#names .suggested-name"),
                             "tokens": texts(page, "#names .name-token"),
                             "results": page.locator("tr.result-row").count()})
  seen["page_errors"] = page_errors
  page.locator(".query-item").first.click()
  page.screenshot(path=job["names_screenshot"])
  return seen


def with_token(browser, job) -> dict:
  page = browser.new_page()
  outside, page_errors, requests = [], [], []
  page.on("request", lambda r: r.url.startswith(job["url"]) or outside.append(r.url))
  page.on("request", lambda r: requests.append(r.url))
  page.on("pageerror", lambda e: page_errors.append(str(e)))
  page.goto(f"{job['url']}/#token={job['token']}")
  page.wait_for_function("document.querySelector('#info').textContent.startsWith('Model ')",
                         timeout=WAIT_MS)
  seen = {"info": page.inner_text("#info"), "error_at_load": error_shown(page),
          "labelled": page.eval_on_selector_all(
              "input, textarea", "es => es.every(e => document.querySelector("
              "`label[for='${e.id}']`))")}
  seen["compare"] = compare(page, job)
  page.evaluate("window.scrollTo(0, 0)")
  page.screenshot(path=job["screenshot"])
  seen["second_result"] = second_result(page)
  seen["asm"] = asm_search(page, job)
  seen["fillmask"] = fill_mask(page, job)
  seen["bad"] = bad_upload_then_search(page, job)
  seen["too_big"] = too_big_upload(page, job, requests)
  seen["outside_requests"], seen["page_errors"] = outside, page_errors
  return seen


def main(job_path: str) -> int:
  with open(job_path) as f:
    job = json.load(f)
  with sync_playwright() as p, tempfile.TemporaryDirectory() as profile:
    browser = p.chromium.launch_persistent_context(
        profile, executable_path=job["chromium"], headless=True, args=ARGS,
        viewport={"width": 1200, "height": 800})
    try:
      report = {}
      if job.get("url"):
        report = {"without_token": without_token(browser, job),
                  "with_token": with_token(browser, job)}
      if job.get("twin_url"):
        report["twins"] = twins(browser, job)
      if job.get("names_url"):
        report["names"] = names(browser, job)
    finally:
      browser.close()
  with open(job["report"], "w") as f:
    json.dump(report, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1]))
