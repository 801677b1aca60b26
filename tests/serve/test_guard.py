"""Access rules through the test client: JSON only, Host and Origin checks, the API key, CORS,
plain 4xx answers for hostile bodies, the attention cap and /metrics."""
from __future__ import annotations

import asyncio
import http.client
import json
import logging
import re

import pytest
from fastapi.testclient import TestClient

from aiayn.config import ConfigError, replace
from aiayn.serve import app as app_module
from aiayn.serve.app import TranslateRequest, create_app
from aiayn.serve.batcher import attention_values
from aiayn.serve.config import ServeConfig

from .conftest import LOCAL, SERVE, LiveServer

JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def client(translator):
    with TestClient(create_app(translator, SERVE), base_url=LOCAL) as c:
        yield c


def calls(client) -> int:
    return client.get("/health").json()["model_calls"]


@pytest.mark.parametrize("headers", [{}, {"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"},
                                     {"content-type": "multipart/form-data; boundary=x"}])
def test_only_json_bodies_are_read(client, headers):
    before = calls(client)
    r = client.post("/translate", content=json.dumps({"sentences": ["A dog."]}), headers=headers)
    assert r.status_code == 415 and "application/json" in r.json()["error"]
    assert calls(client) == before  # nothing decoded
    ok = client.post("/translate", content=json.dumps({"sentences": ["A dog."]}),
                     headers={"content-type": "Application/JSON; charset=utf-8"})
    assert ok.status_code == 200


def test_large_headers_get_431(client):
    r = client.get("/health", headers={"x-pad": "p" * 20_000})
    assert r.status_code == 431 and "16384 bytes" in r.json()["error"]
    assert client.get("/health", headers={"x-pad": "p" * 10_000}).status_code == 200


@pytest.mark.parametrize("host, status", [("localhost", 200), ("127.0.0.1:8000", 200), ("[::1]:8000", 200),
                                          ("LOCALHOST:1", 200), ("evil.example", 403), ("evil.example:8000", 403),
                                          ("127.0.0.1.evil.example", 403)])
def test_a_loopback_service_answers_only_localhost_names(client, host, status):
    # DNS rebinding: a foreign name that resolves to 127.0.0.1 carries its own Host header
    for r in (client.get("/health", headers={"host": host}),
              client.post("/translate", json={"sentences": ["A dog."]}, headers={"host": host})):
        assert r.status_code == status, r.text
    if status == 403:
        assert "Host" in r.json()["error"]


def test_allow_host_and_other_binds(translator):
    cfg = replace(SERVE, allow_host=("mt.example.org",))
    assert ServeConfig(host="0.0.0.0").allowed_hosts == ("*",)
    assert "127.0.0.2" in ServeConfig(host="127.0.0.2").allowed_hosts
    # (the start line lists them: the default bind, 127.0.0.1, once)
    loopback = ("127.0.0.1", "localhost", "[::1]")
    assert ServeConfig().allowed_hosts == ServeConfig(host="localhost").allowed_hosts == loopback
    with TestClient(create_app(translator, cfg), base_url="http://mt.example.org:8000") as c:
        assert c.get("/health").status_code == 200
        assert c.get("/health", headers={"host": "localhost"}).status_code == 403
    with TestClient(create_app(translator, replace(SERVE, host="0.0.0.0")), base_url="http://10.1.2.3") as c:
        assert c.get("/health").status_code == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/json"])
def test_a_foreign_page_cannot_post(client, content_type):
    before = calls(client)
    r = client.post("/translate", content=json.dumps({"sentences": ["A dog."]}),
                    headers={"content-type": content_type, "origin": "https://evil.example"})
    assert r.status_code == 403 and "cross-origin" in r.json()["error"]
    assert "access-control-allow-origin" not in r.headers
    r = client.post("/translate", json={"sentences": ["A dog."]}, headers={"origin": "null"})
    assert r.status_code == 403
    assert calls(client) == before
    own = client.post("/translate", json={"sentences": ["A dog."]}, headers={"origin": LOCAL})
    assert own.status_code == 200  # the service's own page


def test_allowed_origins_get_cors(translator):
    cfg = replace(SERVE, allow_origin=("https://tools.example",))
    with TestClient(create_app(translator, cfg), base_url=LOCAL) as c:
        pre = c.options("/translate", headers={"origin": "https://tools.example",
                                               "access-control-request-method": "POST"})
        assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == "https://tools.example"
        assert "content-type" in pre.headers["access-control-allow-headers"]
        r = c.post("/translate", json={"sentences": ["A dog."]}, headers={"origin": "https://tools.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://tools.example"
        assert c.post("/translate", json={"sentences": ["A dog."]},
                      headers={"origin": "https://other.example"}).status_code == 403


@pytest.mark.parametrize("field, entry", [
    ("allow_host", "mt.example.org:8000"), ("allow_host", "https://mt.example.org"), ("allow_host", "::1"),
    ("allow_origin", "tools.example"), ("allow_origin", "https://tools.example/app"), ("allow_origin", "*"),
])
def test_access_lists_refuse_entries_that_could_never_match(field, entry):
    """The guard compares the Host name without its port, and the Origin as scheme://host[:port]:
    an entry of another form would refuse every request it was meant to allow, so it is an error."""
    from aiayn.config import ConfigError
    with pytest.raises(ConfigError, match=f"{field}: {re.escape(repr(entry))} is not a"):
        ServeConfig(host="0.0.0.0", **{field: (entry,)})


def test_access_lists_take_names_and_origins(translator):
    cfg = replace(SERVE, host="0.0.0.0", allow_host=("mt.example.org", "[::1]", "10.0.0.2"),
                  allow_origin=("https://tools.example/", "http://[::1]:8000"))
    with TestClient(create_app(translator, cfg), base_url="http://mt.example.org:8000") as c:
        for origin in ("https://tools.example", "http://[::1]:8000"):
            assert c.post("/translate", json={"sentences": ["A dog."]}, headers={"origin": origin}).status_code == 200
        assert c.get("/health", headers={"host": "[::1]:8000"}).status_code == 200


def test_api_key(translator):
    cfg = replace(SERVE, api_key="s3cret-token")
    assert "s3cret" not in repr(cfg)
    body = {"sentences": ["A dog."]}
    with TestClient(create_app(translator, cfg), base_url=LOCAL) as c:
        assert c.get("/health").status_code == 200  # health and the page stay open
        assert 'id="api-key"' in c.get("/").text
        for headers in ({}, {"authorization": "Bearer wrong"}, {"x-api-key": "s3cret-toke"},
                        {"authorization": "Basic s3cret-token"}):
            r = c.post("/translate", json=body, headers=headers)
            assert r.status_code == 401 and "API key" in r.json()["error"]
            assert r.headers["www-authenticate"] == "Bearer"
        assert c.get("/metrics").status_code == 401
        assert c.post("/translate", json=body, headers={"authorization": "Bearer s3cret-token"}).status_code == 200
        assert c.post("/translate", json=body, headers={"x-api-key": "s3cret-token"}).status_code == 200
        assert c.get("/metrics", headers={"x-api-key": "s3cret-token"}).status_code == 200
    with TestClient(create_app(translator, SERVE), base_url=LOCAL) as c:
        assert 'id="api-key"' not in c.get("/").text


DEEP = b'{"sentences": ["a"], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


@pytest.mark.parametrize("body, status, msg", [
    (b"[" * 1990 + b"]" * 1990, 400, "nested too deeply"),  # within the body limit of 4000 bytes
    (b'{"sentences": ' + b"[" * 1500 + b'"a"' + b"]" * 1500 + b"}", 400, "nested too deeply"),
    (b'{"sentences": ' + b"[" * 500 + b'"a"' + b"]" * 500 + b"}", 422, "sentences[0]"),
    (b'{"sentences": ["a"], "alpha": 1e308}', 422, "alpha: must be in [0, 10]"),
    (b'{"sentences": ["a"], "alpha": 1e999}', 422, "alpha"),
    (b'{"sentences": ["a"], "alpha": Infinity}', 400, "NaN and Infinity"),
    (b'{"sentences": ["a"], "alpha": -Infinity}', 400, "NaN and Infinity"),
    (b'{"sentences": ["a"], "alpha": NaN}', 400, "NaN and Infinity"),
    (b'{"sentences": ["a"], "alpha": "Infinity"}', 422, "alpha"),
    (b'{"sentences": ["a \\ud800 b"]}', 422, "sentences[0]: not valid Unicode"),
    (b'{"sentences": ["ok", "\\udfff"]}', 422, "sentences[1]: not valid Unicode"),
    (b'{"sentences": ["a"], "\\ud800": 1}', 422, "body: a field name is not valid Unicode"),
    (b'{"sentences": ["a", "b"], "prefix": ["", "x\\udc00"]}', 422, "prefix[1]: not valid Unicode"),
    (b'{"sentences": ["a"], "prefix": "\\ud800"}', 422, "prefix: not valid Unicode"),
    (b'{"sentences": ["a"], "x": {"y": ["\\ud800"]}}', 422, "x.y[0]: not valid Unicode"),
    (b'{"sentences": ["a"], "beam": "3"}', 422, "beam"),
    (b'{"sentences": ["a"], "beam": 2.5}', 422, "beam"),
    (b'{"sentences": ["a"], "beam": true}', 422, "beam"),
    (b'{"sentences": ["a"], "beam": 100000000000000000000000000000}', 422, "beam"),
    (b'{"sentences": ["a"], "nbest": 100000000000000000000000000000}', 422, "nbest"),
    (b'{"sentences": ["a"], "attention": "yes"}', 422, "attention"),
    (b'{"sentences": ["a"], "attention": 1}', 422, "attention"),
    (b'{"sentences": [null]}', 422, "sentences[0]"),
    (b'{"sentences": {"a": 1}}', 422, "sentences"),
    (b'"just a string"', 422, "JSON object"),
    (b"", 400, "not JSON"),
    (DEEP, 413, "limit is 4000"),
])
def test_hostile_bodies_get_a_plain_4xx(client, body, status, msg):
    r = client.post("/translate", content=body, headers=JSON)
    assert r.status_code == status, r.text
    error = r.json()["error"]  # always valid JSON, lone surrogates or not
    assert msg in error
    assert "Error" not in error and "Traceback" not in error and len(error) < 400  # no echoed exception
    assert client.post("/translate", json={"sentences": ["ok"]}).status_code == 200


def lone_surrogate_bodies() -> list[bytes]:
    """For every field of the request, a lone surrogate as its value, as a list item and inside a
    list item's text; and one as a field name."""
    bad = "\ud800"
    bodies = [json.dumps({"sentences": ["A dog."], name: value}).encode()  # (json escapes it: "\\ud800")
              for name in TranslateRequest.model_fields for value in (bad, [bad], [f"A {bad} cat."])]
    return [*bodies, json.dumps({"sentences": ["A dog."], bad: 1}).encode()]


def test_a_lone_surrogate_in_any_text_field_is_a_4xx_and_logs_no_traceback(translator, caplog):
    """Every field gets the same check: a 4xx with a message naming the field, and nothing in the
    service's log (its own and uvicorn's loggers) carries a traceback."""
    with LiveServer(create_app(translator, SERVE)) as server:
        uvicorn_log = logging.getLogger("uvicorn")  # (uvicorn's loggers do not propagate to the root)
        uvicorn_log.addHandler(caplog.handler)
        try:
            with caplog.at_level(logging.DEBUG):
                answers = [post_body(server, body) for body in lone_surrogate_bodies()]
        finally:
            uvicorn_log.removeHandler(caplog.handler)
    assert [status for status, _ in answers if not 400 <= status < 500] == []
    assert "Traceback" not in caplog.text and "Exception" not in caplog.text, caplog.text
    prefix = json.dumps({"sentences": ["A dog."], "prefix": ["\ud800"]}).encode()
    assert answers[lone_surrogate_bodies().index(prefix)] == (422, "prefix[0]: not valid Unicode text (a lone surrogate)")


def post_body(server: LiveServer, body: bytes) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("POST", "/translate", body, JSON)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())["error"]
    finally:
        conn.close()


def test_attention_is_off_by_default_and_capped(translator):
    m = translator.model.cfg
    sents = ["Two dogs play in the snow.", "A cat.", "A man."]
    with TestClient(create_app(translator, SERVE), base_url=LOCAL) as c:
        full = c.post("/translate", json={"sentences": sents, "attention": True}).json()
        assert "attention" not in c.post("/translate", json={"sentences": sents}).json()
    sizes = [attention_values(m, len(a["src_tokens"]), len(a["tgt_tokens"])) for a in full["attention"]]
    cap = sizes[0] + sizes[2]  # room for the first and third, not for the second as well
    assert sizes[1] > sizes[2] and sizes[0] + sizes[1] > cap
    with TestClient(create_app(translator, replace(SERVE, max_attention_values=cap)), base_url=LOCAL) as c:
        capped = c.post("/translate", json={"sentences": sents, "attention": True}).json()
    assert capped["attention"][0] == full["attention"][0] and capped["attention"][1] is None
    assert capped["attention"][2] == full["attention"][2]
    assert capped["translations"] == full["translations"]
    with TestClient(create_app(translator, replace(SERVE, max_attention_values=0)), base_url=LOCAL) as c:
        none = c.post("/translate", json={"sentences": sents, "attention": True}).json()
    assert none["attention"] == [None, None, None] and none["translations"] == full["translations"]


def test_attention_answers_are_built_off_the_event_loop(client, monkeypatch):
    seen = []
    real = app_module._response

    def spy(*args):
        try:
            asyncio.get_running_loop()
            seen.append("loop")
        except RuntimeError:
            seen.append("thread")
        return real(*args)

    monkeypatch.setattr(app_module, "_response", spy)
    assert client.post("/translate", json={"sentences": ["A cat."], "attention": True}).status_code == 200
    assert seen == ["thread"]


LINE = re.compile(r'^[a-z_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? [0-9.e+-]+$|^# (HELP|TYPE) [a-z_]+ .+$')


def test_metrics_in_prometheus_text_format(translator):
    with TestClient(create_app(translator, SERVE), base_url=LOCAL) as c:
        for _ in range(3):
            c.post("/translate", json={"sentences": ["A cat."]})
        c.post("/translate", json={"sentences": []})
        c.get("/health", headers={"host": "evil.example"})
        r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    lines = r.text.strip().split("\n")
    assert all(LINE.match(x) for x in lines), [x for x in lines if not LINE.match(x)]
    value = {x.rsplit(" ", 1)[0]: float(x.rsplit(" ", 1)[1]) for x in lines if not x.startswith("#")}
    assert value['aiayn_requests_total{path="/translate",status="200"}'] == 3
    assert value['aiayn_requests_total{path="/translate",status="422"}'] == 1
    assert value['aiayn_requests_total{path="/health",status="403"}'] == 1
    assert value['aiayn_events_total{event="bad_host"}'] == 1
    buckets = [v for k, v in value.items() if k.startswith('aiayn_request_duration_seconds_bucket{path="/translate"')]
    assert buckets == sorted(buckets) and buckets[-1] == 4
    assert value['aiayn_request_duration_seconds_count{path="/translate"}'] == 4
    assert value["aiayn_queue_sentences"] == 0 and value["aiayn_requests_in_flight"] == 1  # this request
    assert value["aiayn_model_calls_total"] >= 1


def test_a_number_of_too_many_digits_is_said_as_such(client):
    """Python converts at most sys.get_int_max_str_digits() digits (4,300; 640 here to fit the body
    limit): valid JSON, so not called NaN or Infinity."""
    import sys
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(640)
    try:
        r = client.post("/translate", content=b'{"sentences": ["a"], "beam": 1' + b"0" * 700 + b"}", headers=JSON)
    finally:
        sys.set_int_max_str_digits(before)
    assert r.status_code == 422 and "more digits than this service reads" in r.json()["error"], r.text


@pytest.mark.parametrize("field", ["beam", "alpha", "nbest", "attention", "prefix", "no_repeat_ngram"])
def test_null_is_an_optional_field_left_out(client, field):
    r = client.post("/translate", json={"sentences": ["a b"], field: None})
    assert r.status_code == 200, r.text
    assert r.json()["translations"] == client.post("/translate", json={"sentences": ["a b"]}).json()["translations"]


@pytest.mark.parametrize("key", ["s3cret\r", " s3cret", "two words", "k\u00e9y", "tab\tkey"])
def test_an_api_key_no_client_can_send_is_refused(key):
    """Header values lose their outer whitespace, and a browser sends é as one Latin-1 byte where
    curl sends its UTF-8: such a key (a key file's CRLF, say) would refuse every request 401."""
    with pytest.raises(ConfigError, match="api_key must be visible ASCII") as err:
        replace(SERVE, api_key=key)
    assert key.strip() not in str(err.value)  # the key is not echoed
