"""POST /translate, GET /health, GET / and the limits, through FastAPI's test client."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from aiayn.config import ConfigError, replace
from aiayn.decode.config import DecodeConfig
from aiayn.decode.search import Hypothesis
from aiayn.decode.translator import Translator
from aiayn.model.transformer import count_preset_parameters
from aiayn.serve.app import create_app
from aiayn.serve.page import parameters_text

from tests.rounding import score_bound
from tests.arith import softmax_sum_bound

from .conftest import LOCAL, SERVE

SENTS = ["A man is riding a bicycle.", "Two dogs play in the snow.", ""]


@pytest.fixture(scope="module")
def client(translator):
    with TestClient(create_app(translator, SERVE), base_url=LOCAL) as c:
        yield c


def reference(translator, cfg: DecodeConfig, sentences):
    return Translator(translator.model, translator.src_tok, translator.tgt_tok, cfg).translate_nbest(sentences)


def test_health(client, translator):
    r = client.get("/health")
    assert r.status_code == 200
    data = r.json()
    assert data["status"] == "ok" and data["model"]["n_layers"] == 2
    # no name or pair given (checkpoints record no languages): none shown rather than guessed
    assert data["model"]["name"] is None and data["model"]["languages"] is None
    assert data["model"]["parameters"] == count_preset_parameters(translator.model.cfg)  # not the packed copy's
    assert data["defaults"] == {"beam": 4, "alpha": 0.6, "no_repeat_ngram": 0} and data["limits"]["max_sentences"] == 4


def test_health_answers_head(client):
    """HEAD /health (load balancers' probes, curl -I): GET's status without the body, not 405."""
    r = client.head("/health")
    assert r.status_code == 200 and r.content == b"" and r.headers["content-type"] == "application/json"
    assert client.head("/health", headers={"host": "elsewhere.example"}).status_code == 403  # the same guard


def test_a_sentence_limit_that_keeps_no_token_is_refused():
    with pytest.raises(ConfigError, match="max_sentence_tokens must be >= 2"):
        replace(SERVE, max_sentence_tokens=1)


def test_translate_matches_the_translator(client, translator):
    r = client.post("/translate", json={"sentences": SENTS})
    assert r.status_code == 200, r.text
    data = r.json()
    ref = reference(translator, translator.cfg, SENTS)
    assert data["translations"] == [ts[0].text if ts else "" for ts in ref]
    assert data["translations"][2] == "" and data["beam"] == 4 and data["alpha"] == 0.6
    assert "nbest" not in data and "attention" not in data


def test_translate_settings_nbest_and_attention(client, translator, float_model):
    body = {"sentences": SENTS[:2], "beam": 3, "alpha": 0.0, "nbest": 3, "attention": True}
    data = client.post("/translate", json=body).json()
    cfg = DecodeConfig(max_len_b=8, beam_size=3, alpha=0.0, nbest=3)
    ref = reference(translator, cfg, SENTS[:2])
    assert [[h["text"] for h in hs] for hs in data["nbest"]] == [[t.text for t in ts] for ts in ref]
    for src, hs, ts in zip(translator.encode(SENTS[:2]), data["nbest"], ref):  # up to float32's roundings
        for h, t in zip(hs, ts):
            hyp = Hypothesis(t.tokens, t.score, t.log_prob, len(t.tokens) + t.eos, t.eos)
            assert abs(h["score"] - t.score) <= 2 * score_bound(float_model, "fp32", torch.tensor(src), hyp, cfg,
                                                                translator.ids)
    assert data["translations"] == [ts[0].text for ts in ref]
    L, H = translator.model.cfg.n_layers, translator.model.cfg.n_heads
    for att, ts, sent in zip(data["attention"], ref, SENTS):
        cross = np.array(att["cross"])
        S, T = len(translator.encode([sent])[0]), len(ts[0].tokens) + ts[0].eos
        assert cross.shape == (L, H, T, S)
        assert att["src_tokens"][-1] == "</s>" and len(att["tgt_tokens"]) == T
        assert (np.abs(cross.sum(-1) - 1.0) <= float(softmax_sum_bound(S, decimals=4))).all()  # over the source keys
        assert all(round(w, 4) == w for w in cross.ravel())  # 4 decimals, as the docs say (not float32's 0.2045000046)


@pytest.mark.parametrize("body, status, msg", [
    (b"{not json", 400, "not JSON"),
    (b"\xff\xfe", 400, "not JSON"),
    (b"[1, 2]", 422, "JSON object"),
    (b"{}", 422, "sentences: Field required"),
    (json.dumps({"sentences": "one string"}).encode(), 422, "sentences"),
    (json.dumps({"sentences": [1, 2]}).encode(), 422, "sentences[0]: "),
    (json.dumps({"sentences": []}).encode(), 422, "at least one sentence"),
    (json.dumps({"sentences": ["a"], "colour": 1}).encode(), 422, "colour: Extra inputs"),
    (json.dumps({"sentences": ["a"], "beam": 0}).encode(), 422, "beam"),
    (json.dumps({"sentences": ["a"], "beam": 7}).encode(), 422, "beam: 7 exceeds the limit of 6"),
    (json.dumps({"sentences": ["a"], "beam": 2, "nbest": 3}).encode(), 422, "nbest: 3 exceeds beam (2); give nbest <= beam"),
    (json.dumps({"sentences": ["a"], "alpha": -1}).encode(), 422, "alpha"),
    (json.dumps({"sentences": ["a"] * 5}).encode(), 413, "5 sentences; the limit is 4"),
    (json.dumps({"sentences": ["a", "the dog " * 30]}).encode(), 422,
     "exceed the limit of 40 (the server's --max-sentence-tokens, or the model's max_positions with learned "
     "positions); split the sentence"),
    (json.dumps({"sentences": ["x" * 5000]}).encode(), 413, "limit is 4000"),
])
def test_bad_requests_get_4xx_with_a_message(client, body, status, msg):
    r = client.post("/translate", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert msg in r.json()["error"]
    assert client.post("/translate", json={"sentences": ["ok"]}).status_code == 200  # still serving


def test_a_body_that_begins_with_a_byte_order_mark_is_read(client):
    """RFC 8259 section 8.1: a parser may ignore a BOM; PowerShell's UTF-8 writes one."""
    body = b"\xef\xbb\xbf" + json.dumps({"sentences": ["A dog."]}).encode()
    r = client.post("/translate", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["translations"] == \
        client.post("/translate", json={"sentences": ["A dog."]}).json()["translations"]


def test_chunked_body_over_the_limit_is_refused(client):
    r = client.post("/translate", content=iter([b'{"sentences": ["', b"y" * 3000, b"y" * 3000, b'"]}']),
                    headers={"content-type": "application/json"})
    assert r.status_code == 413 and "exceeds the limit of 4000 bytes" in r.json()["error"]


def test_unknown_routes_answer_json_errors(client):
    assert client.get("/nope").status_code == 404 and "error" in client.get("/nope").json()
    r = client.get("/translate")
    assert r.status_code == 405 and "error" in r.json()
    assert r.headers["allow"] == "POST"  # a 405 names the methods the resource has (RFC 9110 §15.5.6)
    assert set(client.delete("/health").headers["allow"].split(", ")) == {"GET", "HEAD"}


@pytest.mark.parametrize("path", ["/", "/health", "/metrics"])
def test_every_get_route_answers_head(client, path):
    """HEAD is GET without the body on every GET route (RFC 9110 §9.3.2: curl -I, link checkers)."""
    got, head = client.get(path), client.head(path)
    assert head.status_code == got.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == got.headers["content-type"]


def test_page_is_self_contained(client):
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert 'id="source"' in page and 'id="translate"' in page and 'value="4"' in page
    assert "<script src" not in page and "http://" not in page and "https://" not in page
    assert ".innerHTML" not in page  # user text goes in with textContent only
    assert 'id="model-size"' in page and 'id="model-name"' not in page and 'id="model-pair"' not in page


def test_the_model_line_names_the_model_and_escapes_its_name(translator):
    cfg = replace(SERVE, model_name="<b>m</b>.pt", languages="en-de")
    with TestClient(create_app(translator, cfg), base_url=LOCAL) as c:
        model = c.get("/health").json()["model"]
        page = c.get("/").text
    assert model["name"] == "<b>m</b>.pt" and model["languages"] == {"source": "en", "target": "de"}
    assert '<b id="model-name">&lt;b&gt;m&lt;/b&gt;.pt</b>' in page and '<span id="model-pair">en \u2192 de</span>' in page
    assert f'<span id="model-size">{parameters_text(model["parameters"])}</span>' in page


@pytest.mark.parametrize("languages", ["en", "en-de-fr", "-de", "en_US-<b>", "e n-de"])
def test_a_language_pair_is_two_codes(languages):
    with pytest.raises(ConfigError, match="languages must be SRC-TGT"):
        replace(SERVE, languages=languages)


@pytest.mark.parametrize("n, text", [(63_082_496, "63.1M parameters"), (999, "999 parameters"),
                                     (999_960, "1.0M parameters"), (212_992, "213.0K parameters"),
                                     (2_500_000_000, "2.5B parameters")])
def test_parameters_text(n, text):
    assert parameters_text(n) == text


def test_an_internal_failure_is_a_500_and_the_service_goes_on(translator, monkeypatch):
    app = create_app(translator, SERVE)
    with TestClient(app, raise_server_exceptions=False, base_url=LOCAL) as client:
        real = app.state.batcher._answer

        def broken(cfg, jobs):
            raise RuntimeError("model exploded")

        monkeypatch.setattr(app.state.batcher, "_answer", broken)
        r = client.post("/translate", json={"sentences": ["A cat."]})
        assert r.status_code == 500 and r.json()["error"] == "internal error (logged by the service)"
        monkeypatch.setattr(app.state.batcher, "_answer", real)
        r = client.post("/translate", json={"sentences": ["A cat."]})
        assert r.status_code == 200 and r.json()["translations"] == translator.translate(["A cat."])
        assert client.get("/health").json()["queued"] == 0


def test_an_ensemble_is_served_as_an_ensemble(translator):
    # a second model: the tiny one with its weights moved; the service must decode with both
    import copy

    import torch
    other = copy.deepcopy(translator.model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ens = Translator([translator.model, other], translator.src_tok, translator.tgt_tok, translator.cfg)
    with TestClient(create_app(ens, SERVE), base_url=LOCAL) as c:
        assert c.get("/health").json()["model"]["ensemble"] == 2
        r = c.post("/translate", json={"sentences": SENTS})
    assert r.status_code == 200, r.text
    assert r.json()["translations"] == ens.translate(SENTS)
    assert ens.translate(SENTS) != translator.translate(SENTS)
