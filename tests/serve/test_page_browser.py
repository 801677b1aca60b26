"""The web page in a real headless browser (Debian's chromium driven by Playwright):
load it, type a sentence, translate, see the translation, open the attention map."""
from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing (apt-get install chromium)")


@pytest.fixture(scope="module")
def page(live_server):
    from playwright.sync_api import sync_playwright
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=ARGS, headless=True)
        try:
            pg = browser.new_page(viewport={"width": 1100, "height": 900})
            pg.set_default_timeout(30_000)
            pg.js_errors = []
            pg.on("pageerror", lambda exc: pg.js_errors.append(exc))
            pg.goto(live_server.url + "/")
            yield pg
        finally:
            browser.close()


def api(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/translate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def test_type_translate_and_open_the_attention_map(page, live_server, tmp_path):
    sentence = "Two dogs play in the snow."
    expected = api(live_server.url, {"sentences": [sentence], "attention": True})
    assert page.title() == "aiayn: translate"
    page.fill("#source", sentence)
    page.click("#translate")
    page.wait_for_selector("#translations li")
    page.wait_for_function("document.getElementById('status').textContent.endsWith('ms')")
    assert page.locator("#translations li .text").all_text_contents() == expected["translations"]
    assert not page.is_visible("#attention")

    page.click("#translations li .show-attention")
    page.wait_for_selector("#attention-map td.w", state="visible")
    att = expected["attention"][0]
    rows = page.locator("#attention-map tbody tr")
    assert rows.count() == len(att["tgt_tokens"])
    assert page.locator("#attention-map thead th").all_text_contents()[1:] == att["src_tokens"]
    assert page.locator("#attention-map tbody th").all_text_contents() == att["tgt_tokens"]
    # shown by default: the mean over the heads of the last layer; each row sums to 1 over the source
    weights = page.eval_on_selector_all(
        "#attention-map tbody tr", "trs => trs.map(tr => [...tr.querySelectorAll('td.w')].map(td => +td.dataset.weight))")
    assert all(len(r) == len(att["src_tokens"]) and abs(sum(r) - 1) < 5e-3 for r in weights)
    page.select_option("#head", "0")
    head0 = page.eval_on_selector_all("#attention-map tbody tr td.w", "tds => tds.map(td => +td.dataset.weight)")
    flat = [w for row in att["cross"][-1][0] for w in row]
    assert head0 == pytest.approx(flat, abs=1e-4)
    assert "darkest = " in page.text_content("#scale")
    page.screenshot(path=str(tmp_path / "page.png"), full_page=True)
    assert page.js_errors == []


def test_errors_are_shown_on_the_page(page):
    page.fill("#source", "A cat.")
    page.fill("#beam", "99")
    page.click("#translate")
    page.wait_for_function("document.getElementById('error').textContent.length > 0")
    assert "beam: 99 exceeds the limit" in page.text_content("#error")
    page.fill("#beam", "4")
    assert page.js_errors == []
