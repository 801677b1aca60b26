"""Access rules of the service as an ASGI layer in front of the app: the size of the headers, Host
and Origin checks, the optional API key, CORS for allowed origins, and the request counters of /metrics.

A browser page on another site can POST to a service on 127.0.0.1 (a ``text/plain`` form needs
no preflight), and DNS rebinding can give it the service's own origin under a foreign name.
So every request must name an allowed host (``ServeConfig.allowed_hosts``), and a request that
carries an ``Origin`` must come from the service's own page or an ``allow_origin`` entry.
"""
from __future__ import annotations

import hmac
import json
import time
from typing import Awaitable, Callable

from aiayn.serve.config import ServeConfig
from aiayn.serve.metrics import Metrics

KEYED_PATHS = ("/translate", "/metrics")  # paths that need the API key when one is set
Send = Callable[[dict], Awaitable[None]]


def split_host(host: str) -> str:
    """The name of a Host header value without its port, lower case ('[::1]:8000' -> '[::1]')."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[:host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


async def answer(send: Send, status: int, message: str, headers: list[tuple[bytes, bytes]] = ()) -> None:
    """A complete ``{"error": message}`` response."""
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """ASGI middleware: refuse large headers (431), foreign hosts and origins (403) and missing keys (401), answer CORS
    preflights of allowed origins, and count every request in ``metrics``."""

    def __init__(self, app, cfg: ServeConfig, metrics: Metrics):
        self.app, self.cfg, self.metrics = app, cfg, metrics
        self.hosts = {h.lower() for h in cfg.allowed_hosts}
        self.origins = {o.rstrip("/").lower() for o in cfg.allow_origin}
        self.key = cfg.api_key.encode()

    def refusal(self, scope: dict) -> tuple[int, str, str] | None:
        """(status, message, event) of a request these rules refuse, or None."""
        if sum(len(k) + len(v) + 4 for k, v in scope["headers"]) > self.cfg.max_header_bytes:
            return 431, f"the request headers exceed {self.cfg.max_header_bytes} bytes", "headers_too_large"
        host = _header(scope, b"host")
        if "*" not in self.hosts and (host is None or split_host(host) not in self.hosts):
            return 403, "this Host is not allowed (see --allow-host)", "bad_host"
        origin = _header(scope, b"origin")
        if origin is not None and origin.rstrip("/").lower() != f"{scope['scheme']}://{(host or '').lower()}" \
                and origin.rstrip("/").lower() not in self.origins:
            return 403, "cross-origin requests are not allowed (see --allow-origin)", "bad_origin"
        if self.key and scope["path"] in KEYED_PATHS and scope["method"] != "OPTIONS" and not self.keyed(scope):
            return 401, "a valid API key is required (Authorization: Bearer KEY)", "unauthorized"
        return None

    def keyed(self, scope: dict) -> bool:
        auth = _header(scope, b"authorization") or ""
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else (_header(scope, b"x-api-key") or "")
        return hmac.compare_digest(given.encode("latin-1"), self.key)  # constant time

    def cors(self, scope: dict) -> list[tuple[bytes, bytes]]:
        origin = _header(scope, b"origin")
        if origin is None or origin.rstrip("/").lower() not in self.origins:
            return []
        return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]

    async def __call__(self, scope: dict, receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status, cors = time.perf_counter(), 500, self.cors(scope)

        async def counted(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if cors:
                    message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        self.metrics.in_flight += 1
        try:
            refused = self.refusal(scope)
            if refused is not None:
                self.metrics.events[refused[2]] += 1
                auth = [(b"www-authenticate", b"Bearer")] if refused[0] == 401 else []
                await answer(counted, refused[0], refused[1], auth)
            elif cors and scope["method"] == "OPTIONS":  # a preflight of an allowed origin
                await counted({"type": "http.response.start", "status": 204, "headers": [
                    (b"access-control-allow-methods", b"GET, POST"), (b"access-control-max-age", b"600"),
                    (b"access-control-allow-headers", b"content-type, authorization, x-api-key")]})
                await counted({"type": "http.response.body", "body": b""})
            else:
                await self.app(scope, receive, counted)
        finally:
            self.metrics.in_flight -= 1
            self.metrics.observe(scope["path"], status, time.perf_counter() - t0)
