"""Time and connection bounds on a live server (real sockets): slow headers and bodies, too many
connections, clients that hang up, deadlines, /health while the model is busy, and the drain
on SIGTERM."""
from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor

import pytest

from aiayn.config import replace
from aiayn.decode.config import DecodeConfig
from aiayn.serve.app import create_app

from .conftest import SERVE, LiveServer
from .test_load import get, post

FAST = replace(SERVE, header_timeout_s=0.4, body_timeout_s=0.4, keep_alive_s=0.3)


def connect(server: LiveServer, data: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    if data:
        sock.sendall(data)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    sock.close()
    return out


def read_refusal(sock: socket.socket) -> bytes:
    """What a refused connection gets: the server answers and closes at once, so a request it did not
    read may turn the close into a reset, after the answer."""
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    sock.close()
    return out


def read_response(sock: socket.socket) -> bytes:
    """One whole response (its head and its Content-Length of body) off a kept-alive connection."""
    out = b""
    while b"\r\n\r\n" not in out and (chunk := sock.recv(65536)):
        out += chunk
    head = out.split(b"\r\n\r\n", 1)[0].lower()
    length = int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0]) if b"content-length:" in head else 0
    while len(out) < len(head) + 4 + length and (chunk := sock.recv(65536)):
        out += chunk
    return out


def request_bytes(body: dict, length: int | None = None) -> bytes:
    raw = json.dumps(body).encode()
    head = (f"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw) if length is None else length}\r\n\r\n")
    return head.encode() + raw


class Gate:
    """Holds the batching worker inside its model call until ``open()``; records what it decoded."""

    def __init__(self, batcher):
        self.event, self.entered, self.decoded = threading.Event(), threading.Event(), []
        real = batcher._answer

        def gated(cfg, jobs):
            self.entered.set()
            self.event.wait(30)
            self.decoded += [x for job in jobs for x in job.ids]
            return real(cfg, jobs)

        batcher._answer = gated

    def open(self) -> None:
        self.event.set()


@pytest.fixture
def fast_server(translator):
    with LiveServer(create_app(translator, FAST), FAST) as server:
        yield server


def test_slow_headers_get_408_and_are_closed(fast_server):
    t0 = time.monotonic()
    sock = connect(fast_server, b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and nothing more
    answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 3
    t0 = time.monotonic()
    assert read_until_closed(connect(fast_server)) .startswith(b"HTTP/1.1 408")  # a silent connection too
    assert time.monotonic() - t0 < 3
    assert get(fast_server.url + "/health")["status"] == "ok"


def test_a_trickled_header_does_not_reset_the_timer(fast_server):
    sock = connect(fast_server)
    t0 = time.monotonic()
    with pytest.raises(OSError):
        for _ in range(40):
            sock.sendall(b"X")  # one byte every 0.1 s: the headers never end
            time.sleep(0.1)
    assert time.monotonic() - t0 < 3
    sock.close()


def test_slow_bodies_get_408_and_are_closed(fast_server):
    raw = request_bytes({"sentences": ["A dog."]}, length=200)
    t0 = time.monotonic()
    answer = read_until_closed(connect(fast_server, raw))  # 200 bytes announced, fewer sent
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.4 s" in answer
    assert time.monotonic() - t0 < 3
    assert 'aiayn_events_total{event="body_timeout"} 1' in metrics_text(fast_server)
    # a body nobody reads (404) cannot hold the connection either
    sock = connect(fast_server, b"POST /nope HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\nab")
    assert read_until_closed(sock).startswith(b"HTTP/1.1 404")


def test_keep_alive_then_slow_second_request(fast_server):
    sock = connect(fast_server, request_bytes({"sentences": ["A dog."]}))
    first = sock.recv(65536)
    assert first.startswith(b"HTTP/1.1 200")
    sock.sendall(b"POST /translate HTTP/1.1\r\n")  # the next request's headers never end
    t0 = time.monotonic()
    read_until_closed(sock)
    assert time.monotonic() - t0 < 3


def test_an_idle_keep_alive_connection_waits_for_keep_alive_s_not_header_timeout_s(translator):
    """Between requests a kept-alive connection is idle, not slow: it gets no 408 after header_timeout_s
    (a client sending its next request then would read that 408 as its answer), and it stays open for
    keep_alive_s; the next request's headers have header_timeout_s from its first byte."""
    cfg = replace(SERVE, header_timeout_s=0.3, body_timeout_s=0.4, keep_alive_s=3.0)
    with LiveServer(create_app(translator, cfg), cfg) as server:
        sock = connect(server, request_bytes({"sentences": ["A dog."]}))
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        time.sleep(0.9)  # idle: past header_timeout_s, within keep_alive_s
        sock.sendall(request_bytes({"sentences": ["A dog."]}))
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        assert 'event="header_timeout"' not in metrics_text(server)
        time.sleep(0.9)
        sock.sendall(b"POST /translate HTTP/1.1\r\n")  # a next request whose headers never end
        t0 = time.monotonic()
        assert read_until_closed(sock).startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 2.5


def test_connections_beyond_the_limit_get_503(translator):
    cfg = replace(SERVE, max_connections=3)
    with LiveServer(create_app(translator, cfg), cfg) as server:
        held = [connect(server) for _ in range(3)]
        time.sleep(0.2)
        extra = read_refusal(connect(server, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"))
        assert extra.startswith(b"HTTP/1.1 503") and b"too many connections" in extra
        for sock in held:
            sock.close()
        time.sleep(0.2)
        assert get(server.url + "/health")["status"] == "ok"
        assert 'aiayn_events_total{event="connection_refused"} 1' in metrics_text(server)


def metrics_text(server: LiveServer) -> str:
    import urllib.request
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as resp:
        return resp.read().decode()


def test_a_request_whose_client_left_is_not_decoded(translator):
    with LiveServer(create_app(translator, SERVE)) as server:
        gate = Gate(server.app.state.batcher)
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(post, server.url, {"sentences": ["A man is riding a bicycle."]})
            assert gate.entered.wait(10)  # the worker is busy with the first request
            leaver = connect(server, request_bytes({"sentences": ["Two dogs play in the snow."]}))
            deadline = time.monotonic() + 10
            while server.app.state.batcher.queued < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            leaver.close()  # the client hangs up while its request is queued
            while 'event="client_gone"' not in metrics_text(server) and time.monotonic() < deadline:
                time.sleep(0.02)
            health_t0 = time.monotonic()
            assert get(server.url + "/health")["queued"] >= 1  # /health answers while the model is busy
            assert time.monotonic() - health_t0 < 1
            gate.open()
            assert first.result(30)[0] == 200
        assert post(server.url, {"sentences": ["A cat."]})[0] == 200
        decoded = {tuple(x) for x in gate.decoded}
        assert tuple(translator.encode(["Two dogs play in the snow."])[0]) not in decoded
        assert tuple(translator.encode(["A cat."])[0]) in decoded
        assert server.app.state.batcher.skipped == 1 and server.app.state.batcher.queued == 0


def test_a_model_call_stops_at_the_next_step_when_its_client_hangs_up(translator, monkeypatch):
    """The only request of a model call of 50 steps or more: its client hangs up while the call is in
    its third step (held there until the service has seen it go); the call makes no fourth step."""
    from aiayn.decode.translator import Translator
    from aiayn.serve.job import Job

    from .test_batcher import LONG, count_steps
    long = Translator(translator.model, translator.src_tok, translator.tgt_tok, DecodeConfig(beam_size=2, **LONG))
    in_step, seen_gone = threading.Event(), threading.Event()
    abandon = Job.abandon
    monkeypatch.setattr(Job, "abandon", lambda job: (abandon(job), seen_gone.set()))
    steps = count_steps(monkeypatch, 3, lambda: (in_step.set(), seen_gone.wait(10)))
    with LiveServer(create_app(long, SERVE)) as server:
        sock = connect(server, request_bytes({"sentences": ["Two dogs play in the snow."]}))
        assert in_step.wait(30)
        sock.close()
        assert seen_gone.wait(10)
        batcher = server.app.state.batcher
        deadline = time.monotonic() + 30
        while batcher.calls < 1 and time.monotonic() < deadline:  # (the call ends after its third step)
            time.sleep(0.01)
        assert batcher.stopped == 1 and len(steps) == 3
        assert 'event="client_gone"} 1' in metrics_text(server)


def test_a_request_past_its_deadline_gets_503_and_is_not_decoded(translator):
    cfg = replace(SERVE, request_timeout_s=0.5)
    with LiveServer(create_app(translator, cfg), cfg) as server:
        gate = Gate(server.app.state.batcher)
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(post, server.url, {"sentences": ["A man is riding a bicycle."]})
            assert gate.entered.wait(10)
            t0 = time.monotonic()
            status, data = post(server.url, {"sentences": ["Two dogs play in the snow."]})
            assert status == 503 and "deadline" in data["error"] and time.monotonic() - t0 < 3
            gate.open()
            first.result(30)  # itself past its deadline by now: 503 or 200, it was being decoded
        assert post(server.url, {"sentences": ["A cat."]})[0] == 200
        assert tuple(translator.encode(["Two dogs play in the snow."])[0]) not in {tuple(x) for x in gate.decoded}


def test_sigterm_finishes_or_refuses_queued_work_within_the_bound(translator):
    cfg = replace(SERVE, shutdown_timeout_s=1.0)
    server = LiveServer(create_app(translator, cfg), cfg).__enter__()
    try:
        gate = Gate(server.app.state.batcher)
        with ThreadPoolExecutor(4) as pool:
            first = pool.submit(post, server.url, {"sentences": ["A man is riding a bicycle."]})
            assert gate.entered.wait(10)
            queued = [pool.submit(post, server.url, {"sentences": [s], "beam": 2})
                      for s in ("A cat.", "A dog.", "A girl.")]
            deadline = time.monotonic() + 10
            while server.app.state.batcher.queued < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            t0 = time.monotonic()
            server.server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
            with pytest.raises(urllib.error.HTTPError) as health:  # 503: a load balancer's probe fails
                get(server.url + "/health")
            assert health.value.code == 503 and json.loads(health.value.read())["status"] == "shutting down"
            status, data = post(server.url, {"sentences": ["Too late."]})
            assert status == 503 and "shutting down" in data["error"]
            time.sleep(1.3)  # past the drain time: the queued requests are refused, not decoded
            gate.open()
            assert first.result(30)[0] == 200  # the model call in progress is finished
            answers = [f.result(30) for f in queued]
        assert all(s == 503 and "shut down" in d["error"] for s, d in answers), answers
        server.thread.join(10)
        assert not server.thread.is_alive() and time.monotonic() - t0 < 5
    finally:
        server.__exit__(None, None, None)


def test_sigterm_on_an_idle_service_exits_without_waiting_for_the_drain_time(translator):
    cfg = replace(SERVE, shutdown_timeout_s=30.0)
    server = LiveServer(create_app(translator, cfg), cfg).__enter__()
    try:
        assert post(server.url, {"sentences": ["A cat."]})[0] == 200
        t0 = time.monotonic()
        server.server.handle_exit(signal.SIGTERM, None)
        server.thread.join(10)
        assert not server.thread.is_alive() and time.monotonic() - t0 < 3
    finally:
        server.__exit__(None, None, None)


def read_answer(sock: socket.socket) -> bytes:
    """One complete response (head and its Content-Length of body) read from ``sock``."""
    out = b""
    while b"\r\n\r\n" not in out:
        out += sock.recv(65536)
    head = out.split(b"\r\n\r\n", 1)[0].lower()
    length = int(head.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
    while len(out) < len(head) + 4 + length:
        out += sock.recv(65536)
    return out


@pytest.mark.parametrize("client_close", [False, True])
def test_an_answer_before_the_body_says_close_and_reads_what_still_comes(live_server, client_close):
    """413 before the body is read: the answer says ``connection: close`` (a keep-alive client would
    send its next request into a closing connection), and the connection goes on reading what the
    client still sends before it ends (closing with unread data resets it, losing the answer)."""
    head = (f"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: 10000000\r\n{'Connection: close' if client_close else ''}\r\n\r\n")
    sock = connect(live_server, head.encode())
    answer = read_answer(sock)
    assert answer.startswith(b"HTTP/1.1 413") and b"connection: close\r\n" in answer.lower()
    for _ in range(8):  # the client still sends its body, within LINGER_S
        sock.sendall(b"x" * 65536)
        time.sleep(0.01)
    assert read_until_closed(sock) == b""  # then an end of stream, no reset


def test_a_keep_alive_client_goes_on_after_a_413(live_server):
    conn = http.client.HTTPConnection("127.0.0.1", live_server.port, timeout=60)
    for body, status in ((b"x" * 1_000_000, 413), (json.dumps({"sentences": ["A dog."]}).encode(), 200)):
        conn.request("POST", "/translate", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == status and json.loads(resp.read())
    conn.close()
