"""Fairness between clients (a client is a peer address): connections and queued sentences capped
per client, the batching worker's clients taking turns, and requests sharing model calls answered
as each alone. Live-server tests bind their clients to loopback addresses 127.0.0.2, 127.0.0.3, ..."""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from aiayn.config import replace
from aiayn.decode.config import DecodeConfig
from aiayn.decode.search import length_penalty
from aiayn.decode.translator import Translator
from aiayn.serve.app import create_app
from aiayn.serve.batcher import Batcher, Busy, ClientBusy, rescored
from aiayn.serve.job import Job

from tests.rounding import score_bound

from .conftest import LOCAL, SERVE, LiveServer
from .test_bounds import Gate, metrics_text, read_refusal

SENTS = ["A man is riding a bicycle.", "Two dogs play in the snow.", "A girl.", "People walk down the street."]
GREEDY = DecodeConfig(max_len_b=4, beam_size=1)


def make(translator, **kw) -> Batcher:
    return Batcher(translator, **kw)


def record_calls(batcher: Batcher) -> list[list[tuple[str, int, int]]]:
    """(client, first sentence, end) of every part of every model call, in call order."""
    calls, real = [], batcher._answer

    def recorded(cfg, parts):
        calls.append([(p.job.client, p.start, p.end) for p in parts])
        return real(cfg, parts)

    batcher._answer = recorded
    return calls


def alone(translator, cfg: DecodeConfig, sentences: list[str], model) -> list[list[tuple]]:
    """Each sentence's n-best alone: (text, tokens, score, log_prob, eos, and the bounds of float32's
    roundings on score and log_prob: ``score_bound`` of ``model``, the checkpoint's float32 model)."""
    tr = Translator(translator.model, translator.src_tok, translator.tgt_tok, cfg)
    ids = tr.encode(sentences)
    out = []
    for src, hs in zip(ids, tr.translate_ids(ids)):
        bounds = [score_bound(model, "fp32", torch.tensor(src), h, cfg, tr.ids) for h in hs]
        out.append([(tr.tgt_tok.decode(h.tokens), h.tokens, h.score, h.log_prob, h.eos, bound,
                     bound * length_penalty(h.length, cfg.alpha, cfg.length_norm)) for h, bound in zip(hs, bounds)])
    return out


def answered(result) -> list[list[tuple]]:
    return [[(t.text, t.tokens, t.score, t.log_prob, t.eos) for t in ts] for ts in result.nbest]


def assert_same(got: list[list[tuple]], want: list[list[tuple]]) -> None:
    """The same hypotheses in the same order; score and log_prob within twice ``alone``'s bound of
    float32's roundings (a batch's size and padding change the order of the model's additions, as in
    any batched decoding: each path within the bound of the exact value)."""
    assert [[(x[0], x[1], x[4]) for x in hs] for hs in got] == [[(x[0], x[1], x[4]) for x in hs] for hs in want]
    for g, w in zip((x for hs in got for x in hs), (x for hs in want for x in hs)):
        assert abs(g[2] - w[2]) <= 2 * w[5] and abs(g[3] - w[3]) <= 2 * w[6], (g, w)


def run_all(batcher: Batcher, jobs: list) -> None:
    batcher.start()
    try:
        for job in jobs:
            job.future.result(timeout=60)
    finally:
        batcher.stop()


# -- the fair queue ------------------------------------------------------------------------------


def test_clients_take_turns_and_each_clients_requests_keep_their_order(translator, float_model):
    ids = translator.encode(["A girl."])
    one = Job(GREEDY, ids, False).n_tokens  # a model call's room: one request
    b = make(translator, wait_ms=50, batch_tokens=one, concurrent_calls=1)
    jobs = [b.submit(GREEDY, ids, client=c) for c in ("a", "a", "a", "b", "b", "c")]
    calls = record_calls(b)
    run_all(b, jobs)
    assert [c for call in calls for c, _, _ in call] == ["a", "b", "c", "a", "b", "a"]
    for job in jobs:
        assert_same(answered(job.future.result()), alone(translator, GREEDY, ["A girl."], float_model))


def test_a_long_request_is_spread_over_calls_and_shares_them_with_others(translator, float_model):
    ids = translator.encode(["A girl."])
    four = 4 * Job(GREEDY, ids, False).n_tokens  # a model call's room: four sentences, two for each client
    b = make(translator, wait_ms=50, batch_tokens=four, concurrent_calls=1)
    long = b.submit(GREEDY, ids * 6, client="a")
    short = b.submit(GREEDY, ids, client="b")
    calls = record_calls(b)
    run_all(b, [long, short])
    assert calls == [[("a", 0, 2), ("b", 0, 1), ("a", 2, 3)], [("a", 3, 6)]]
    assert_same(answered(long.future.result()), alone(translator, GREEDY, ["A girl."] * 6, float_model))
    assert_same(answered(short.future.result()), alone(translator, GREEDY, ["A girl."], float_model))


def test_one_clients_full_share_does_not_refuse_another(translator):
    b = make(translator, max_queue_sentences=7, max_queued_per_client=3)
    b.submit(GREEDY, [[5, 3], [6, 3]], client="a")
    b.submit(GREEDY, [[5, 3]], client="a")
    with pytest.raises(ClientBusy, match="this client has 3 sentences waiting for the model \\(limit 3 per client\\)"):
        b.submit(GREEDY, [[5, 3]], client="a")
    b.submit(GREEDY, [[5, 3]] * 3, client="b")
    assert b.queued == 6 and b.queued_clients == 2
    with pytest.raises(Busy, match="6 sentences are waiting for the model \\(limit 7\\)") as refused:
        b.submit(GREEDY, [[5, 3]] * 2, client="c")
    assert not isinstance(refused.value, ClientBusy)


def test_a_clients_call_in_progress_does_not_hold_up_another_client(translator, float_model):
    b = make(translator, wait_ms=0, concurrent_calls=2)
    held, release, real = threading.Event(), threading.Event(), b._answer

    def answer(cfg, parts):
        if parts[0].job.client == "a":
            held.set()
            assert release.wait(30)
        return real(cfg, parts)

    b._answer = answer
    b.start()
    try:
        first = b.submit(GREEDY, translator.encode(SENTS[:1]), client="a")
        assert held.wait(30)  # one worker is in a's call
        again = b.submit(GREEDY, translator.encode(SENTS[1:2]), client="a")  # waits: a has a call in progress
        other = b.submit(GREEDY, translator.encode(SENTS[2:3]), client="b")
        assert_same(answered(other.future.result(timeout=60)), alone(translator, GREEDY, SENTS[2:3], float_model))
        assert not first.future.done() and not again.future.done() and b.queued == 1
        release.set()
        assert_same(answered(again.future.result(timeout=60)), alone(translator, GREEDY, SENTS[1:2], float_model))
        assert first.future.result(timeout=60)
    finally:
        release.set()
        b.stop()


# -- shared model calls answer as each request alone -----------------------------------------------


def test_greedy_scores_for_any_alpha_are_those_of_a_search_with_that_alpha(translator):
    ids = translator.encode(SENTS)
    shared = Translator(translator.model, translator.src_tok, translator.tgt_tok, GREEDY).translate_ids(ids)
    for alpha in (0.0, 0.6, 1.7):
        cfg = replace(GREEDY, alpha=alpha)
        own = Translator(translator.model, translator.src_tok, translator.tgt_tok, cfg).translate_ids(ids)
        assert rescored(shared, alpha, translator.device) == own


# everything in one collection, one worker; requests split over calls made by two workers at once
@pytest.mark.parametrize("batch_tokens, workers", [(4096, 1), (60, 2)])
def test_requests_sharing_calls_get_the_answers_they_get_alone(translator, float_model, batch_tokens, workers):
    beam = DecodeConfig(max_len_b=4, beam_size=3)
    wanted = [("a", replace(GREEDY, alpha=0.0), SENTS[:3]), ("b", replace(GREEDY, alpha=0.6), SENTS[1:]),
              ("c", replace(GREEDY, alpha=1.7), SENTS[:1]), ("a", replace(beam, nbest=2), SENTS),
              ("d", replace(beam, alpha=1.2), SENTS[2:]), ("b", replace(GREEDY, alpha=0.6), [""])]
    b = make(translator, wait_ms=100, batch_tokens=batch_tokens, concurrent_calls=workers)
    jobs = [b.submit(cfg, translator.encode(sents), client=c) for c, cfg, sents in wanted]
    run_all(b, jobs)
    for (_, cfg, sents), job in zip(wanted, jobs):
        assert_same(answered(job.future.result()), alone(translator, cfg, sents, float_model))
    if batch_tokens == 4096:
        assert b.calls == 3  # greedy at three α: one call; beam search at two α: two


# -- live server: connections and queue shares per client address -------------------------------------


def connect_from(server: LiveServer, source: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10, source_address=(source, 0))


def health_on(sock: socket.socket) -> bytes:
    """GET /health on a kept-alive connection: the answer's head and body."""
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    data = b""
    while b"}" not in data:  # the JSON body's end
        data += sock.recv(65536)
    return data


def test_a_client_over_its_connection_cap_is_refused_while_others_connect(translator):
    cfg = replace(SERVE, max_connections=4, max_connections_per_client=2)
    with LiveServer(create_app(translator, cfg), cfg) as server:
        held = [connect_from(server, "127.0.0.2") for _ in range(2)]
        assert all(health_on(s).startswith(b"HTTP/1.1 200") for s in held)
        refused = [connect_from(server, "127.0.0.2") for _ in range(5)]
        for sock in refused:
            answer = read_refusal(sock)
            assert answer.startswith(b"HTTP/1.1 429") and b"too many connections from this address (limit 2)" in answer
        # refused connections do not count against max_connections: two more clients still fit
        others = [connect_from(server, "127.0.0.3"), connect_from(server, "127.0.0.4")]
        assert all(health_on(s).startswith(b"HTTP/1.1 200") for s in others)
        assert read_refusal(connect_from(server, "127.0.0.5")).startswith(b"HTTP/1.1 503")  # the global cap
        held.pop().close()
        deadline = time.monotonic() + 10
        while True:  # the server sees the close a moment later
            answer = health_on(again := connect_from(server, "127.0.0.2")) if time.monotonic() < deadline else b""
            if not answer.startswith(b"HTTP/1.1 429"):
                break
            again.close()
            time.sleep(0.02)
        assert answer.startswith(b"HTTP/1.1 200")
        for sock in [*held, *refused, *others, again]:
            sock.close()
        text = metrics_text(server)
        assert 'event="client_connection_refused"} 5' in text and 'event="connection_refused"} 1' in text


def post_from(server: LiveServer, source: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60, source_address=(source, 0))
    try:
        conn.request("POST", "/translate", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def wait_for(predicate, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_one_clients_full_queue_share_does_not_refuse_another_client(translator):
    cfg = replace(SERVE, max_queued_per_client=4, concurrent_calls=1)
    with LiveServer(create_app(translator, cfg), cfg) as server:
        batcher = server.app.state.batcher
        gate = Gate(batcher)  # the worker is held in its first model call
        with ThreadPoolExecutor(3) as pool:
            first = pool.submit(post_from, server, "127.0.0.4", {"sentences": ["A cat."]})
            assert gate.entered.wait(10)
            full = pool.submit(post_from, server, "127.0.0.2", {"sentences": SENTS})  # the whole share
            assert wait_for(lambda: batcher.queued == 4)
            status, data = post_from(server, "127.0.0.2", {"sentences": ["A dog."]})
            assert status == 429 and "this client has 4 sentences waiting for the model (limit 4 per client)" \
                in data["error"]
            assert post_from(server, "127.0.0.2", {"sentences": "not a list"})[0] == 429  # refused before it is read
            other = pool.submit(post_from, server, "127.0.0.3", {"sentences": ["A dog."]})
            assert wait_for(lambda: batcher.queued == 5)  # queued, not refused
            health = json.loads(health_on(s := connect_from(server, "127.0.0.5")).split(b"\r\n\r\n", 1)[1])
            s.close()
            assert health["queued"] == 5 and health["queued_clients"] == 2
            gate.open()
            assert [f.result(30)[0] for f in (first, full, other)] == [200, 200, 200]
        assert 'event="client_queue_full"} 2' in metrics_text(server)


# -- /health and the documentation ---------------------------------------------------------------------


def test_health_and_docs_name_the_per_client_caps(translator):
    cfg = replace(SERVE, max_connections_per_client=3, max_queued_per_client=40)
    with TestClient(create_app(translator, cfg), base_url=LOCAL) as c:
        health = c.get("/health").json()
    assert health["queued_clients"] == 0
    assert {k: health["limits"][k] for k in ("max_connections", "max_connections_per_client",
                                             "max_queued_per_client")} == {
        "max_connections": 64, "max_connections_per_client": 3, "max_queued_per_client": 40}
    docs = (Path(__file__).resolve().parents[2] / "docs" / "serve.md").read_text(encoding="utf-8")
    for name in ("--max-connections-per-client", "--max-queued-per-client", "queued_clients",
                 "client_connection_refused", "client_queue_full", "429"):
        assert name in docs, name
