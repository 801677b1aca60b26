"""Every request field capped in the units the model spends: a prefix in target tokens, output
tokens in a model call's budget, every attention map computed in ``max_attention_values``; the
caps in /health."""
from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient

from aiayn.config import replace
from aiayn.decode.config import DecodeConfig
from aiayn.decode.translator import Translator
from aiayn.serve.app import create_app
from aiayn.serve.batcher import Batcher, attention_values
from aiayn.serve.job import Job

from .conftest import LOCAL, SERVE


@pytest.fixture(scope="module")
def tiny(untrained_checkpoint) -> Translator:
    torch.set_num_threads(1)
    return Translator.from_checkpoint(untrained_checkpoint, DecodeConfig(beam_size=1, max_len_b=6))


def test_a_prefix_is_capped_in_target_tokens(tiny):
    cfg = replace(SERVE, max_prefix_tokens=5)
    with TestClient(create_app(tiny, cfg), base_url=LOCAL) as c:
        assert c.get("/health").json()["limits"]["max_prefix_tokens"] == 5
        ok = c.post("/translate", json={"sentences": ["a b", "c d"], "prefix": ["a b", ""]})
        assert ok.status_code == 200, ok.text
        r = c.post("/translate", json={"sentences": ["a b", "c d"], "prefix": ["", "a b c d e f g h"]})
    assert r.status_code == 422
    assert r.json()["error"] == "prefix[1]: 8 target tokens exceed the limit of 5"


def test_health_reports_every_cap(tiny):
    with TestClient(create_app(tiny, SERVE), base_url=LOCAL) as c:
        limits = c.get("/health").json()["limits"]
    for name in ("max_sentences", "max_sentence_tokens", "max_request_bytes", "max_beam", "max_alpha",
                 "max_prefix_tokens", "max_no_repeat_ngram", "max_attention_values", "max_queue_sentences",
                 "batch_tokens"):
        assert limits[name] == getattr(SERVE, name), name


def test_no_repeat_ngram_is_a_capped_request_field_with_the_server_s_default(tiny):
    sents = ["a b c d e f", "a a a a b b b b"]
    banned = Translator(tiny.models, tiny.src_tok, tiny.tgt_tok, replace(tiny.cfg, no_repeat_ngram=2))
    want = banned.translate(sents)
    assert want != tiny.translate(sents)  # the untrained model repeats itself
    with TestClient(create_app(tiny, replace(SERVE, max_no_repeat_ngram=3)), base_url=LOCAL) as c:
        health = c.get("/health").json()
        assert health["limits"]["max_no_repeat_ngram"] == 3 and health["defaults"]["no_repeat_ngram"] == 0
        assert c.post("/translate", json={"sentences": sents, "no_repeat_ngram": 2}).json()["translations"] == want
        over = c.post("/translate", json={"sentences": sents, "no_repeat_ngram": 4})
        negative = c.post("/translate", json={"sentences": sents, "no_repeat_ngram": -1})
    assert over.status_code == 422 and over.json()["error"] == "no_repeat_ngram: 4 exceeds the limit of 3"
    assert negative.status_code == 422 and "no_repeat_ngram" in negative.json()["error"]
    with TestClient(create_app(banned, SERVE), base_url=LOCAL) as c:  # the server's default, unless asked
        assert c.get("/health").json()["defaults"]["no_repeat_ngram"] == 2
        assert c.post("/translate", json={"sentences": sents}).json()["translations"] == want
        off = c.post("/translate", json={"sentences": sents, "no_repeat_ngram": 0}).json()["translations"]
    assert off == tiny.translate(sents)


def test_output_tokens_count_in_a_model_calls_budget(tiny):
    cfg = DecodeConfig(beam_size=1, max_len_a=1.0, max_len_b=6)
    assert Job(cfg, [[5] * 4, []], False).n_tokens == 4 + 10  # floor(1 * 4 + 6); an empty line costs nothing
    assert Job(cfg, [[5] * 4], False, prefixes=[[6] * 20]).n_tokens == 4 + 21  # the prefix's length + 1
    # two requests whose sources fit one call's budget, but not with their outputs: two calls
    batcher = Batcher(tiny, wait_ms=300, batch_tokens=30).start()
    try:
        jobs = [batcher.submit(cfg, [[5, 6, 3]], prefixes=[[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]])
                for _ in range(2)]
        for job in jobs:
            job.future.result(timeout=60)
    finally:
        batcher.stop()
    assert batcher.calls == 2


def test_attention_budget_counts_every_map_computed(tiny):
    sents = ["a b c d e f"]
    with TestClient(create_app(tiny, SERVE), base_url=LOCAL) as c:
        full = c.post("/translate", json={"sentences": sents, "attention": True}).json()["attention"][0]
    m = tiny.model.cfg
    S, T = len(full["src_tokens"]), len(full["tgt_tokens"])
    cross = m.decoder_layers * m.n_heads * T * S
    assert attention_values(m, S, T) == m.n_heads * (m.n_layers * S * S + m.decoder_layers * (T * T + T * S))
    for cap, returned in ((cross, False), (attention_values(m, S, T), True)):
        with TestClient(create_app(tiny, replace(SERVE, max_attention_values=cap)), base_url=LOCAL) as c:
            got = c.post("/translate", json={"sentences": sents, "attention": True}).json()["attention"][0]
        assert (got is not None) == returned, cap
