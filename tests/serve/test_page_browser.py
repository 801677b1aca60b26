"""The web page in a real headless browser (Debian's chromium driven by Playwright): the model it
names, typing and pasting text, translating (button, Ctrl+Enter, Cmd+Enter), the attention map,
and the reason shown beside every disabled control. A screenshot of each state goes to
$AIAYN_SCREENSHOTS when set (docs/img/page-*.png were taken so), else to a temporary folder."""
from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import pytest

from aiayn.config import replace
from aiayn.serve.app import create_app
from aiayn.serve.page import parameters_text
from tests.arith import softmax_sum_bound

from .conftest import SERVE, LiveServer

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
NAMED = replace(SERVE, model_name="tiny.pt", languages="en-de")  # at most 4 sentences a request
PARAGRAPH = 'A man is riding a bicycle. Two dogs play in the snow!\n"Where is the cat?" she asks.'
PARAGRAPH_SENTENCES = ["A man is riding a bicycle.", "Two dogs play in the snow!", '"Where is the cat?" she asks.']

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing (apt-get install chromium)")


@pytest.fixture(scope="module")
def live_server(translator):
    """The service with a model name and a language pair given (conftest's has neither)."""
    with LiveServer(create_app(translator, NAMED), NAMED) as server:
        yield server


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    """The folder for screenshots: $AIAYN_SCREENSHOTS, else a temporary one."""
    where = os.environ.get("AIAYN_SCREENSHOTS")
    path = Path(where) if where else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def open_page(browser, url: str):
    """A fresh page on ``url``, recording its JS errors and its POSTs to /translate (``pg.sent``)."""
    pg = browser.new_page(viewport={"width": 960, "height": 640})
    pg.set_default_timeout(30_000)
    pg.js_errors, pg.sent = [], []
    pg.on("pageerror", lambda exc: pg.js_errors.append(exc))
    pg.on("request", lambda req: pg.sent.append(req.post_data_json) if req.url.endswith("/translate") else None)
    pg.goto(url + "/")
    return pg


@pytest.fixture
def page(browser, live_server):
    pg = open_page(browser, live_server.url)
    yield pg
    assert pg.js_errors == []
    pg.close()


def api(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/translate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=60) as resp:
        return json.loads(resp.read())


def answered(page, action) -> None:
    """Do ``action`` (which sends a translation request) and wait until the page shows the answer."""
    with page.expect_response(lambda r: r.url.endswith("/translate")):
        action()
    page.wait_for_function("!busy")


def reason(page, selector: str) -> tuple[str, str]:
    """(title, visible note) of a disabled control; the note is the element after it."""
    assert page.is_disabled(selector)
    note = page.locator(selector + " + .note")
    assert note.is_visible()
    return page.get_attribute(selector, "title"), note.text_content()


def test_the_page_names_its_model_and_translate_waits_for_text(page, live_server, translator, shots):
    model = health(live_server.url)["model"]
    assert page.title() == "aiayn: translate"
    assert page.text_content("#model-name") == "tiny.pt"
    assert page.text_content("#model-pair") == "en \u2192 de"
    assert page.text_content("#model-size") == parameters_text(model["parameters"]) == "263.9K parameters"  # tiny, no attention biases
    title, note = reason(page, "#translate")
    assert note == "type or paste text first" and title == note
    page.screenshot(path=str(shots / "page-empty.png"))
    page.fill("#source", "A cat.")
    assert page.is_enabled("#translate") and page.get_attribute("#translate", "title") == ""
    assert page.text_content("#translate-note") == "" and page.text_content("#count") == "1 sentence"


def test_type_translate_and_open_the_attention_map(page, live_server, shots):
    sentence = "Two dogs play in the snow."
    expected = api(live_server.url, {"sentences": [sentence], "attention": True})
    page.fill("#source", sentence)
    answered(page, lambda: page.click("#translate"))
    assert page.locator("#translations li .text").all_text_contents() == expected["translations"]
    assert page.text_content("#status").startswith("translated in ") and not page.is_visible("#output")
    assert not page.is_visible("#attention") and page.is_enabled("#translations li .show-attention")
    page.screenshot(path=str(shots / "page-translated.png"))

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
    # (each head's row within softmax_sum_bound of 1 as the service writes it, 4 decimals; their mean in
    # float64, then written again with 4 decimals: half a unit more per weight)
    n = len(att["src_tokens"])
    bound = float(softmax_sum_bound(n, decimals=4)) + n * 0.5e-4 + n * 2.0 ** -50
    assert all(len(r) == n and abs(sum(r) - 1) <= bound for r in weights)
    page.select_option("#head", "0")
    head0 = page.eval_on_selector_all("#attention-map tbody tr td.w", "tds => tds.map(td => +td.dataset.weight)")
    flat = [w for row in att["cross"][-1][0] for w in row]
    assert head0 == flat  # one head's weights as the service wrote them: 4 decimals, written again as they are
    assert "darkest = " in page.text_content("#scale")
    page.screenshot(path=str(shots / "page-attention.png"), full_page=True)


def test_a_paragraph_is_translated_sentence_by_sentence_in_one_request(page, live_server, shots):
    expected = api(live_server.url, {"sentences": PARAGRAPH_SENTENCES})["translations"]
    page.fill("#source", PARAGRAPH)
    assert page.text_content("#count") == "3 sentences"
    answered(page, lambda: page.click("#translate"))
    assert len(page.sent) == 1 and page.sent[0]["sentences"] == PARAGRAPH_SENTENCES
    assert page.locator("#translations li .source").all_text_contents() == PARAGRAPH_SENTENCES
    assert page.locator("#translations li .text").all_text_contents() == expected
    # joined back as the text was: sentences of a line by spaces, its line break kept
    assert page.eval_on_selector("#output", "e => e.textContent") == f"{expected[0]} {expected[1]}\n{expected[2]}"
    assert page.is_visible("#output") and page.text_content("#status").startswith("translated in ")
    page.screenshot(path=str(shots / "page-paragraph.png"), full_page=True)


@pytest.mark.parametrize("text, lines", [
    ("One. Two! Three? four.", [["One.", "Two!", "Three? four."]]),
    ("He left.\n\n  Then she came.  ", [["He left."], [], ["Then she came."]]),
    ('She said "Yes." \u00c4rger kommt. \u201eJa!\u201c Er geht.',
     [['She said "Yes."', "\u00c4rger kommt.", "\u201eJa!\u201c", "Er geht."]]),
    ("e.g. this one. 3.5 kg. Dr. Smith", [["e.g. this one. 3.5 kg.", "Dr.", "Smith"]]),
    ("  \n ", [[]]),
])
def test_the_split_rule(page, text, lines):
    assert page.evaluate("splitText", text) == lines


def test_ctrl_enter_and_cmd_enter_translate(page, live_server):
    for n, (keys, sentence) in enumerate([("Control+Enter", "A cat sleeps."), ("Meta+Enter", "A dog runs.")], 1):
        expected = api(live_server.url, {"sentences": [sentence]})["translations"]
        page.fill("#source", sentence)
        answered(page, lambda: page.press("#source", keys))
        assert len(page.sent) == n and page.sent[-1]["sentences"] == [sentence]
        assert page.locator("#translations li .text").all_text_contents() == expected
        assert page.input_value("#source") == sentence  # no line break typed


def test_more_sentences_than_the_cap_are_not_sent(page, shots):
    page.fill("#source", "One cat. Two cats.\nThree cats. Four cats. Five cats.")
    title, note = reason(page, "#translate")
    assert note == "5 sentences: at most 4 per request"
    assert "translates at most 4 per request" in title
    page.press("#source", "Control+Enter")
    page.click("#translate", force=True)  # a disabled button sends nothing
    page.wait_for_timeout(300)
    assert page.sent == [] and page.locator("#translations li").count() == 0
    page.screenshot(path=str(shots / "page-disabled.png"))
    page.fill("#source", "One cat. Two cats.\nThree cats. Four cats.")
    assert page.is_enabled("#translate") and page.text_content("#translate-note") == ""


def test_a_sentence_whose_map_was_not_returned_says_why(page, shots):
    def drop_last_map(route):  # as the service answers when the maps exceed max_attention_values
        response = route.fetch()
        data = response.json()
        data["attention"][-1] = None
        route.fulfill(response=response, json=data)

    page.route("**/translate", drop_last_map)
    page.fill("#source", "A man is riding a bicycle. Two dogs play in the snow.")
    answered(page, lambda: page.click("#translate"))
    first, second = "#translations li:nth-child(1) .show-attention", "#translations li:nth-child(2) .show-attention"
    assert page.is_enabled(first) and page.get_attribute(first, "title") == ""
    assert page.locator(first + " + .note").text_content() == ""
    title, note = reason(page, second)
    assert note == "map over the service's limit"
    assert f"limit of {SERVE.max_attention_values} values" in title and "alone" in title
    page.screenshot(path=str(shots / "page-no-map.png"), full_page=True)


def test_a_service_without_maps_or_a_name(browser, translator, shots):
    cfg = replace(SERVE, max_attention_values=0)
    with LiveServer(create_app(translator, cfg), cfg) as server:
        pg = open_page(browser, server.url)
        try:
            assert pg.locator("#model-name").count() == 0 and pg.locator("#model-pair").count() == 0
            assert pg.text_content("#model").startswith("Model: ") and pg.is_visible("#model-size")
            pg.fill("#source", "A cat.")
            answered(pg, lambda: pg.click("#translate"))
            assert pg.sent[0]["attention"] is False
            title, note = reason(pg, "#translations li .show-attention")
            assert note == "no maps on this service" and "max_attention_values = 0" in title
            assert pg.js_errors == []
        finally:
            pg.close()


def test_errors_are_shown_on_the_page(page):
    page.fill("#source", "A cat.")
    page.fill("#beam", "99")
    page.click("#translate")
    page.wait_for_function("document.getElementById('error').textContent.length > 0")
    assert "beam: 99 exceeds the limit" in page.text_content("#error")


def test_an_emptied_number_field_takes_the_service_default(page, live_server):
    """A cleared beam or α is left out of the request (the service's default), not sent as 0."""
    page.fill("#source", "A cat.")
    page.fill("#alpha", "")
    answered(page, lambda: page.click("#translate"))
    assert "alpha" not in page.sent[-1] and page.sent[-1]["beam"] == 4
    page.fill("#beam", "")
    answered(page, lambda: page.click("#translate"))
    assert "beam" not in page.sent[-1] and page.text_content("#error") == ""
    assert page.text_content("#translations li .text") == api(live_server.url, {"sentences": ["A cat."]})["translations"][0]


def test_an_answer_that_is_not_json_shows_its_status(page):
    """A proxy's HTML error page (502) is reported by its status, not as a JSON syntax error."""
    page.route("**/translate", lambda route: route.fulfill(status=502, content_type="text/html",
                                                           body="<html><body>Bad Gateway</body></html>"))
    page.fill("#source", "A cat.")
    page.click("#translate")
    page.wait_for_function("document.getElementById('error').textContent.length > 0")
    assert page.text_content("#error").startswith("HTTP 502")


def test_the_page_works_behind_a_proxy_under_a_path_prefix(browser, live_server):
    """Served at http://proxy.test/mt/ (a reverse proxy passing /mt/... to the service), the page
    posts to /mt/translate, beside itself, not to the proxy's own /translate."""
    import urllib.request as ur
    html = ur.urlopen(live_server.url + "/", timeout=60).read()
    posted = []

    def service(route):
        posted.append(route.request.url)
        # (a proxy passes its own Host on, so the page's Origin is the service's; here the Origin goes)
        sent = {k: v for k, v in route.request.headers.items() if k.lower() not in ("origin", "host", "referer")}
        route.fulfill(response=route.fetch(url=live_server.url + "/translate", headers=sent))
    pg = browser.new_page()
    pg.set_default_timeout(30_000)
    try:
        pg.route("http://proxy.test/mt/", lambda route: route.fulfill(status=200, content_type="text/html", body=html))
        pg.route("http://proxy.test/mt/translate", service)
        pg.route("http://proxy.test/translate", lambda route: route.fulfill(status=404, body="not here"))
        pg.goto("http://proxy.test/mt/")
        pg.fill("#source", "A cat.")
        with pg.expect_response("http://proxy.test/mt/translate"):
            pg.click("#translate")
        pg.wait_for_function("!busy")
        assert posted == ["http://proxy.test/mt/translate"] and pg.text_content("#error") == ""
        assert pg.text_content("#translations li .text") == api(live_server.url, {"sentences": ["A cat."]})["translations"][0]
    finally:
        pg.close()
