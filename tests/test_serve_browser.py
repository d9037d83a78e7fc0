"""The playground at ``/`` in a real headless Chromium (Debian's ``chromium``, driven by Playwright).

The page is loaded from a live server over an elastic run; the test moves the R slider, types a
prompt, clicks Generate, waits for the stream to end and checks the text and the concept marks
against the API's own answer for the same request. A screenshot is kept in
``$CONCEPTMOE_TEST_ARTIFACTS`` (``.ci/run`` sets it), else in the test's temporary folder.
Outside CI the test skips with a one-line reason when Chromium or Playwright is missing; with
``CONCEPTMOE_REQUIRE_BROWSER=1`` (CI) it fails instead.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import pytest
from hf_helpers import concept_run
from serve_helpers import live_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


def _browser_or_skip():
    why = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        why = "playwright is not installed (pip install -e \".[test]\")"
    if CHROMIUM is None:
        why = "Debian's chromium is not installed (apt-get install chromium)"
    if why:
        if os.environ.get("CONCEPTMOE_REQUIRE_BROWSER") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return sync_playwright


def test_playground_streams_text_and_concept_marks(tmp_path):
    sync_playwright = _browser_or_skip()
    run = tmp_path / "elastic"
    concept_run(run, seed=2, seq_len=128, elastic_ratios=[1.5, 2.0, 3.0], ratio_embedding="router+concept")
    artifacts = Path(os.environ.get("CONCEPTMOE_TEST_ARTIFACTS", tmp_path))
    artifacts.mkdir(parents=True, exist_ok=True)
    prompt = "Now is the winter of our discontent"
    with live_server(run, kv_cache_mb=2) as (url, _, _), sync_playwright() as pw:
        api = httpx.post(url + "/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 32, "temperature": 0, "concept_ratio": 1.5}).json()
        want_text, want_marks = api["choices"][0]["text"], api["conceptmoe"]["boundary_offsets"]
        assert want_marks, "the API's answer has no boundary inside the completion"
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        try:
            page = browser.new_page()
            page.goto(url + "/")
            page.wait_for_selector("#ratio_box:not([hidden])", timeout=15000)  # elastic: the R slider shows
            page.fill("#ratio", "1.5")
            page.dispatch_event("#ratio", "input")
            assert page.inner_text("#ratio_value") == "1.5"
            page.fill("#prompt", prompt)
            page.fill("#max_tokens", "32")
            page.fill("#temperature", "0")
            page.click("#go")
            page.wait_for_selector('#out[data-done="1"]', timeout=60000)
            text = "".join(page.eval_on_selector_all("#out .concept", "els => els.map(e => e.textContent)"))
            marks = json.loads(page.get_attribute("#out", "data-boundaries"))
            n_marks = page.locator("#out .mark").count()
            stats = page.inner_text("#stats")
            page.screenshot(path=str(artifacts / "playground.png"), full_page=True)
        finally:
            browser.close()
    assert text == want_text
    assert marks == sorted(set(want_marks))
    assert n_marks == len(marks) and n_marks > 0
    assert "compression" in stats and "saved" in stats
