"""Fixtures for the service tests: a translator on the tiny checkpoint and a live server on loopback."""
from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from aiayn.decode.config import DecodeConfig
from aiayn.decode.translator import Translator
from aiayn.serve.app import create_app
from aiayn.serve.config import ServeConfig

LOCAL = "http://localhost"  # TestClient's base URL: a Host the service accepts on loopback
# (no pace: the tests' clients share few addresses; tests/serve/test_pace.py tests the pace)
SERVE = ServeConfig(max_sentences=4, max_sentence_tokens=40, max_request_bytes=4000, max_beam=6,
                    batch_wait_ms=5.0, threads=1, client_requests_per_s=0.0)


@pytest.fixture(scope="session")
def translator(tiny_checkpoint) -> Translator:
    torch.set_num_threads(1)
    return Translator.from_checkpoint(tiny_checkpoint, DecodeConfig(max_len_b=8))


@pytest.fixture(scope="session")
def float_model(tiny_checkpoint):
    """The checkpoint's float32 model as trained (the translator's is its decoding copy), for the
    bounds of float32's roundings (tests/rounding.py)."""
    from aiayn.decode.loading import load_models_for_inference
    return load_models_for_inference(tiny_checkpoint)[0][0]


class LiveServer:
    """The service's uvicorn server (``make_server``) in a thread on 127.0.0.1 (a free port); ``url`` is its address."""

    def __init__(self, app, cfg: ServeConfig = SERVE):
        from aiayn.serve.server import make_server
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        self.server = make_server(app, cfg, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(20)
        self.sock.close()


@pytest.fixture(scope="module")
def live_server(translator):
    with LiveServer(create_app(translator, SERVE)) as server:
        yield server
