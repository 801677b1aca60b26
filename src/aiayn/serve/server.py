"""uvicorn, bounded: header and body read deadlines, a connection limit, and a SIGTERM that drains.

``GuardedH11Protocol`` is uvicorn's h11 protocol with a timer per connection: a client has
``header_timeout_s`` to send a request's headers (else 408 and the connection is closed) and
``body_timeout_s`` (+ ``BODY_GRACE_S``; the app answers 408 first when it reads the body) to send its body;
a connection beyond ``max_connections_per_client`` from one peer address (an IPv6 one by its
network, clients.py) is answered 429, one beyond ``max_connections`` in all 503, and either is
closed at once, not counted among the open connections (so a client that keeps reconnecting
holds no slots); a response sent before the client finished its body says ``connection: close``
and closes the connection after reading and dropping what still comes for ``LINGER_S``. ``Server`` starts
the batcher's drain (``Batcher.begin_shutdown``) when SIGTERM or SIGINT arrives and keeps its
listener open, answering 503, until the queue is empty or the drain time is over; a second SIGINT
answers every request waiting or in a model call 503 (``Batcher.abort``), lets those answers go
out, and the command ends with status 130.
"""
from __future__ import annotations

import asyncio
import errno
import functools
import json
import logging
import os
import signal
import socket
import sys
import time
from collections import Counter
from typing import Callable

import h11
import uvicorn
from uvicorn.protocols.http.flow_control import CLOSE_HEADER
from uvicorn.protocols.http.h11_impl import H11Protocol

from aiayn.errors import UserError
from aiayn.serve.batcher import Batcher
from aiayn.serve.clients import client_key
from aiayn.serve.config import ServeConfig
from aiayn.serve.metrics import Metrics

log = logging.getLogger(__name__)
BODY_GRACE_S = 1.0  # past body_timeout_s before the protocol closes: the app answers 408 first
LINGER_S = 1.0  # how long a connection answered early still reads (and drops) what the client sends


def raw_response(status: int, reason: str, message: str) -> bytes:
    """A complete HTTP/1.1 ``{"error": message}`` response that closes the connection."""
    body = json.dumps({"error": message}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode() + body


class LingeringClose:
    """A connection's transport as one request's cycle sees it, whose ``close`` is the protocol's
    ``_linger``: uvicorn closes at once after a ``connection: close`` answer, and a close while the
    client still sends its body resets the connection, which may lose the answer."""

    def __init__(self, protocol):
        self.protocol = protocol

    def __getattr__(self, name: str):
        return getattr(self.protocol.transport, name)

    def close(self) -> None:
        self.protocol._linger()


def guarded_protocol(cfg: ServeConfig, metrics: Metrics) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the read deadlines and connection limits of ``cfg``."""
    per_client: Counter[str] = Counter()  # open connections by peer address

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._timer: asyncio.TimerHandle | None = None
            self._phase, self._lingering, self._counted = None, False, False
            self._kept_alive = False  # a response went out: the client may send its next request or idle
            # uvicorn's peer (host, port), an IPv6 one by its network (clients.py)
            self._peer = client_key(self.client[0], cfg.client_ipv6_prefix) if self.client else ""
            if per_client[self._peer] >= cfg.max_connections_per_client:
                self._refuse(429, "Too Many Requests", "client_connection_refused",
                             f"too many connections from this address (limit {cfg.max_connections_per_client}); "
                             "retry after closing one")
            elif len(self.connections) > cfg.max_connections:
                self._refuse(503, "Service Unavailable", "connection_refused", "too many connections; retry later")
            else:
                self._counted = True
                per_client[self._peer] += 1
                metrics.connections += 1
                self._follow()

        def _refuse(self, status: int, reason: str, event: str, message: str) -> None:
            """Answer and close at once, out of the connection counts: a refused client holds no slot."""
            metrics.events[event] += 1
            self.connections.discard(self)
            self.transport.write(raw_response(status, reason, message))
            self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._counted:
                self._counted = False
                metrics.connections -= 1
                per_client[self._peer] -= 1
                if not per_client[self._peer]:
                    del per_client[self._peer]
            self._arm(None)
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._lingering:  # answered and closing: the rest of the request is read and dropped
                return
            if self._phase is h11.IDLE and self._timer is None:  # a kept-alive connection's next request begins
                self._arm(cfg.header_timeout_s, "header_timeout")
            super().data_received(data)
            self._follow()

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not None and self.cycle is not cycle:  # a request began (its task runs later)
                self.cycle.send = functools.partial(self._send, self.cycle, self.cycle.send)

        async def _send(self, cycle, send: Callable, message: dict) -> None:
            """uvicorn's ``send`` of ``cycle``, except that an answer started before the request's body
            was read says ``connection: close`` (the rest of the body is dropped, so the connection
            cannot carry a next request), and uvicorn's close after it lingers (``_linger``)."""
            if message["type"] == "http.response.start" and self.conn.their_state is h11.SEND_BODY:
                headers = list(message.get("headers", []))
                message = {**message, "headers": headers + [CLOSE_HEADER] * (CLOSE_HEADER not in headers)}
                cycle.transport = LingeringClose(self)
            await send(message)

        def on_response_complete(self) -> None:
            if self.conn.their_state is h11.SEND_BODY:  # answered before the body was read: nobody reads it
                self._linger()
            self._kept_alive = True
            super().on_response_complete()
            self._follow()

        def _linger(self) -> None:
            """Close after the answer, reading (and dropping) what the client still sends for up to
            ``LINGER_S``: closing with unread data would reset the connection and lose the answer."""
            self._lingering = True
            try:
                if self.transport.can_write_eof():
                    self.transport.write_eof()
            except OSError:  # the client is gone already
                self.transport.close()
                return
            self._arm(LINGER_S, "")

        def _follow(self) -> None:
            """Re-arm the timer when the client's side moves: waiting for headers, then for a body."""
            state = self.conn.their_state
            if state is self._phase or self._lingering or self.transport.is_closing():
                return
            self._phase = state
            if state is h11.IDLE:  # the first request's headers are due from the connect; between requests
                # the connection is idle, closed by uvicorn after keep_alive_s (a 408 then would be read as
                # the answer to the client's next request), and the next one's deadline starts at its
                # first byte (data_received)
                self._arm(None if self._kept_alive else cfg.header_timeout_s, "header_timeout")
            elif state is h11.SEND_BODY:
                self._arm(cfg.body_timeout_s + BODY_GRACE_S, "body_timeout")
            else:
                self._arm(None)

        def _arm(self, seconds: float | None, event: str = "") -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = None if seconds is None else self.loop.call_later(seconds, self._expire, event)

        def _expire(self, event: str) -> None:
            self._timer = None
            if self.transport.is_closing():
                return
            if event:
                metrics.events[event] += 1
            if event == "header_timeout" and (self.cycle is None or self.cycle.response_complete):
                self.transport.write(raw_response(408, "Request Timeout", "the request headers came too slowly"))
            self.transport.close()

    return GuardedH11Protocol


FORCED_ANSWERS_S = 2.0  # after a second SIGINT: time for the 503 answers of the requests in progress to go out
FORCED_WORKERS_S = 2.0  # ... and for the model calls to stop at their next step, before the process ends anyway
FORCED_EXIT = 130  # the exit status after a second SIGINT (128 + SIGINT, as a shell reports Ctrl-C)


class Server(uvicorn.Server):
    """uvicorn's server whose exit signal first tells the batcher to drain (``shutdown_timeout_s``).

    uvicorn closes its listener at the first tick after the signal; here it waits until the
    batcher is drained, so a client that connects meanwhile is told 503 "shutting down" (and
    retries elsewhere) instead of finding the port closed. A second SIGINT stops at once: the
    requests waiting or in a model call are answered 503 (``Batcher.abort``), and ``run`` returns
    (``force_exit`` set) once their answers went out and the calls stopped, within
    ``FORCED_ANSWERS_S`` + ``FORCED_WORKERS_S``. The batcher is told from the event loop, not from
    the signal handler, which interrupts the loop's thread anywhere, perhaps holding the
    batcher's lock.
    """

    def __init__(self, config: uvicorn.Config, batcher: Batcher, drain_s: float,
                 banner: Callable[[int], str] | None = None):
        super().__init__(config)
        self.batcher, self.drain_s = batcher, drain_s
        self.banner = banner  # of the port listened on, logged once it is bound (``startup``)
        self.draining = False  # a signal came: the batcher drains before the listener closes
        self._loop: asyncio.AbstractEventLoop | None = None

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        """Serve; without ``sockets``, first check that ``--host``/``--port`` can be listened on
        (``check_listen``): uvicorn would log its bind error and exit 3 after starting up."""
        if sockets is None:
            check_listen(self.config.host, self.config.port)
        try:
            super().run(sockets=sockets)
        finally:
            if self.force_exit:
                self._stop_workers()

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets=sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's startup, then the banner with the port bound: with ``--port 0`` the one the
        system chose, which a client needs (not 0)."""
        await super().startup(sockets=sockets)
        listening = [s for server in getattr(self, "servers", []) for s in server.sockets or ()]
        if self.banner is not None and listening:
            log.info("%s", self.banner(listening[0].getsockname()[1]))

    def handle_exit(self, sig, frame) -> None:
        again = self.should_exit and sig == signal.SIGINT  # uvicorn's rule for a forced exit
        super().handle_exit(sig, frame)
        self.draining = True
        if again:
            log.info("signal %s again: stopping now; requests waiting or in progress get 503", sig)
            self._in_loop(self.batcher.abort)
        else:
            log.info("signal %s: new requests get 503; queued work is finished for %.1f s", sig, self.drain_s)
            self._in_loop(functools.partial(self.batcher.begin_shutdown, self.drain_s))

    def _in_loop(self, tell: Callable[[], None]) -> None:
        """``tell`` run by the event loop (at once where none runs)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            tell()
        else:
            loop.call_soon_threadsafe(tell)

    async def on_tick(self, counter: int) -> bool:
        stop = await super().on_tick(counter)
        return stop and (self.force_exit or not self.draining or self.batcher.drained)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown, whose requests still in a model call when its graceful time is nearly
        over are answered 503 (``Batcher.abort``); after a second SIGINT, then the 503 answers of the requests in
        progress sent (uvicorn would cancel their tasks, which answers a plain 500), and the app's
        own shutdown (which uvicorn skips then: the batcher's workers end), each bounded."""
        # a call still running when uvicorn's graceful time is nearly over (it then cancels the request's
        # task, a plain 500): its requests answered 503 first, the call stopped at its next step
        graceful = self.config.timeout_graceful_shutdown
        late = None if graceful is None else asyncio.get_running_loop().call_later(
            max(0.0, graceful - FORCED_ANSWERS_S), self.batcher.abort)
        try:
            await super().shutdown(sockets=sockets)
        finally:
            if late is not None:
                late.cancel()
        if not self.force_exit:
            return
        end = time.monotonic() + FORCED_ANSWERS_S
        while self.server_state.tasks and time.monotonic() < end:
            await asyncio.sleep(0.01)
        try:
            await asyncio.wait_for(self.lifespan.shutdown(), FORCED_WORKERS_S)
        except asyncio.TimeoutError:
            pass  # (``_stop_workers`` ends the process)

    def _stop_workers(self) -> None:
        """After a second SIGINT: the batcher's workers ended (their calls stop at the next decoding
        step), waiting ``FORCED_WORKERS_S`` at most; a worker still inside a model step then ends the
        process with ``FORCED_EXIT`` at once (Python's exit would abort in it)."""
        self.batcher.stop(timeout=FORCED_WORKERS_S)
        if self.batcher.working:
            log.warning("a model step did not end within %.0f s; exiting without it", FORCED_WORKERS_S)
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(FORCED_EXIT)


def check_listen(host: str, port: int) -> None:
    """A ``UserError`` naming ``host:port`` when a listener cannot be bound there (the port taken by
    another service, an address this machine does not have, a name that does not resolve). Each of
    the addresses ``host`` resolves to is bound once and released as asyncio's ``create_server``
    (uvicorn's listener) binds them: with SO_REUSEADDR and IPV6_V6ONLY, an address the machine
    lacks skipped (an IPv6 ``localhost`` where IPv6 is off) unless none is left, so that a port
    uvicorn could take passes and a port held by a listening socket fails."""
    where = f"--host {host} --port {port}"
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        raise UserError(f"{where}: cannot resolve the host ({getattr(exc, 'strerror', None) or exc})") from None
    missing, bound = None, False
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                missing = missing or (address, exc)
                continue
            hint = "; another service listens there: stop it or choose another --port" if exc.errno == errno.EADDRINUSE else ""
            raise UserError(f"{where}: cannot listen on {address[0]} port {address[1]} "
                            f"({exc.strerror or exc}){hint}") from None
        bound = True
    if not bound and missing is not None:
        (address, exc) = missing
        raise UserError(f"{where}: cannot listen on {address[0]} port {address[1]} ({exc.strerror or exc})")


def make_server(app, cfg: ServeConfig, banner: Callable[[int], str] | None = None, **uvicorn_kw) -> Server:
    """The uvicorn server of ``app`` (from ``create_app``) with the bounds of ``cfg``, logging
    ``banner(port)`` once it listens (after ``check_listen``; the port bound). uvicorn's own
    proxy headers are off (by default it believes X-Forwarded-For from loopback peers): the app reads
    X-Forwarded-For itself, from the proxies ``cfg.forwarded_allow_ips`` names (clients.py)."""
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, http=guarded_protocol(cfg, app.state.metrics),
                            timeout_keep_alive=cfg.keep_alive_s, lifespan="on", proxy_headers=False,
                            h11_max_incomplete_event_size=cfg.max_header_bytes,
                            timeout_graceful_shutdown=cfg.shutdown_timeout_s + 5, **uvicorn_kw)
    return Server(config, app.state.batcher, cfg.shutdown_timeout_s, banner)
