"""What the service reads inside uvicorn and h11 (aiayn/serve/server.py) is still there.

``GuardedH11Protocol`` subclasses uvicorn's ``H11Protocol`` and reads its ``conn``, ``cycle``,
``connections``, ``transport``, ``loop`` and ``client``; ``Server`` overrides ``handle_exit`` and
``on_tick``, ``serve`` and ``shutdown`` (whose ``server_state.tasks`` and ``lifespan`` it reads).
uvicorn is pinned in constraints/common.txt; a new pin must pass this file first.
"""
from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

import h11
import uvicorn
from uvicorn.lifespan.on import LifespanOn
from uvicorn.protocols.http.flow_control import CLOSE_HEADER
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

CONSTRAINTS = Path(__file__).resolve().parents[2] / "constraints" / "common.txt"


class FakeTransport(asyncio.Transport):
    def __init__(self):
        super().__init__()
        self.written, self.closed = [], False

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.2", 50000)}.get(name, default)

    def write(self, data):
        self.written.append(data)

    def is_closing(self):
        return self.closed

    def close(self):
        self.closed = True

    def can_write_eof(self):
        return True

    def write_eof(self):
        pass

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass


async def empty_app(scope, receive, send):  # an ASGI app that is never called here
    raise AssertionError("not called")


def test_the_installed_versions_are_the_pinned_ones():
    pins = dict(line.split("==") for line in CONSTRAINTS.read_text().splitlines() if "==" in line)
    assert uvicorn.__version__ == pins["uvicorn"] and h11.__version__ == pins["h11"]


def test_h11_protocol_has_what_the_guard_reads():
    async def run():
        config = uvicorn.Config(empty_app, lifespan="off")
        config.load()
        state = ServerState()
        proto = H11Protocol(config, state, {})
        transport = FakeTransport()
        proto.connection_made(transport)
        assert proto in state.connections and proto.connections is state.connections
        assert proto.transport is transport and proto.client == ("127.0.0.2", 50000)
        assert isinstance(proto.conn, h11.Connection) and proto.conn.their_state is h11.IDLE
        assert proto.cycle is None and isinstance(proto.loop, asyncio.AbstractEventLoop)
        proto.data_received(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n")
        assert proto.conn.their_state is h11.SEND_BODY and proto.cycle is not None
        assert proto.cycle.response_complete is False
        # an early answer's cycle: its ``send`` (wrapped) and ``transport`` (whose close lingers) are attributes
        assert inspect.iscoroutinefunction(proto.cycle.send) and proto.cycle.transport is transport
        assert CLOSE_HEADER == (b"connection", b"close")
        assert callable(getattr(H11Protocol, "handle_events"))
        proto.connection_lost(None)
        assert proto not in state.connections
        for name in ("connection_made", "connection_lost", "data_received", "on_response_complete"):
            assert callable(getattr(H11Protocol, name)), name
    asyncio.run(run())


def test_server_has_what_the_drain_overrides():
    assert list(inspect.signature(uvicorn.Server.handle_exit).parameters) == ["self", "sig", "frame"]
    assert inspect.iscoroutinefunction(uvicorn.Server.on_tick)
    assert list(inspect.signature(uvicorn.Server.on_tick).parameters) == ["self", "counter"]
    for method in ("serve", "shutdown"):  # overridden for a second SIGINT (the answers, the app's shutdown)
        assert inspect.iscoroutinefunction(getattr(uvicorn.Server, method))
        assert list(inspect.signature(getattr(uvicorn.Server, method)).parameters) == ["self", "sockets"]
    server = uvicorn.Server(uvicorn.Config(empty_app))
    assert server.should_exit is False and server.force_exit is False
    assert isinstance(server.server_state.tasks, set)  # the requests in progress
    assert inspect.iscoroutinefunction(LifespanOn.shutdown)  # ``server.lifespan``'s, the app's shutdown
    for option in ("h11_max_incomplete_event_size", "timeout_graceful_shutdown", "timeout_keep_alive"):
        assert option in inspect.signature(uvicorn.Config).parameters, option
