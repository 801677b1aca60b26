"""Who a client is (serve/clients.py): the peer address; X-Forwarded-For only from trusted proxies
(none by default); an IPv6 client by its /64. Live-server tests tell clients apart by their pace:
0.1 request a second, burst 1, a 2 s deadline, so a client's second request is refused 429 at once."""
from __future__ import annotations

import asyncio
import http.client
import json

import pytest
import uvicorn
from uvicorn.server import ServerState

from aiayn.config import ConfigError, replace
from aiayn.serve.app import create_app
from aiayn.serve.clients import client_address, client_key, trusted_networks
from aiayn.serve.config import ServeConfig
from aiayn.serve.metrics import Metrics
from aiayn.serve.server import guarded_protocol, make_server

from .conftest import SERVE, LiveServer
from .test_uvicorn_internals import FakeTransport

ONE_EACH = replace(SERVE, client_requests_per_s=0.1, client_burst=1, request_timeout_s=2.0)
PROXY = "127.0.0.1"  # the tests' peer: the reverse proxy when it is trusted


def post(server: LiveServer, forwarded_for: str | None = None) -> int:
    """The status of one small POST /translate from 127.0.0.1, with the X-Forwarded-For given."""
    headers = {"Content-Type": "application/json"}
    if forwarded_for is not None:
        headers["X-Forwarded-For"] = forwarded_for
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("POST", "/translate", json.dumps({"sentences": ["A dog."]}), headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


@pytest.mark.parametrize("peer, forwarded, client", [
    ("127.0.0.2", ["203.0.113.7"], "127.0.0.2"),  # not a trusted proxy: the header is ignored
    (PROXY, [], PROXY),
    (PROXY, ["203.0.113.7"], "203.0.113.7"),
    (PROXY, ["198.51.100.1, 203.0.113.7"], "203.0.113.7"),  # the left entry is the client's own claim
    (PROXY, ["198.51.100.1", "203.0.113.7"], "203.0.113.7"),  # two header lines read as one list
    (PROXY, ["203.0.113.7, 10.1.2.3"], "203.0.113.7"),  # a second trusted proxy (10.0.0.0/8) in the chain
    (PROXY, ["10.0.0.5, 10.1.2.3"], "10.0.0.5"),  # every entry trusted: the left-most
    (PROXY, ["203.0.113.7:4711"], "203.0.113.7"),
    (PROXY, ["[2001:db8::1]:443"], "2001:db8::1"),
    (PROXY, ["203.0.113.7, not-an-address"], PROXY),  # not what a proxy writes: the peer
    ("::ffff:127.0.0.1", ["203.0.113.7"], "203.0.113.7"),  # an IPv4-mapped peer is its IPv4 address
])
def test_client_address_believes_only_trusted_proxies(peer, forwarded, client):
    assert client_address(peer, forwarded, trusted_networks(["127.0.0.1", "10.0.0.0/8"])) == client


@pytest.mark.parametrize("address, bits, key", [
    ("203.0.113.7", 64, "203.0.113.7"),
    ("2001:db8:1:2:aaaa::1", 64, "2001:db8:1:2::/64"),
    ("2001:db8:1:2:ffff:ffff:ffff:ffff", 64, "2001:db8:1:2::/64"),
    ("2001:db8:1:2:aaaa::1", 128, "2001:db8:1:2:aaaa::1"),
    ("2001:db8:1:2:aaaa::1", 48, "2001:db8:1::/48"),
    ("fe80::1%eth0", 64, "fe80::/64"),
    ("::ffff:203.0.113.7", 64, "203.0.113.7"),
    ("testclient", 64, "testclient"),  # not an IP address (a Unix socket, the test client): as it is
])
def test_client_key_is_an_ipv6_network_of_the_prefix_bits(address, bits, key):
    assert client_key(address, bits) == key


def test_client_settings_are_checked():
    with pytest.raises(ConfigError, match="forwarded_allow_ips: 'proxy.example' is not an IP address or network"):
        ServeConfig(forwarded_allow_ips=("10.0.0.1", "proxy.example"))
    for bits in (0, 129):
        with pytest.raises(ConfigError, match="client_ipv6_prefix must be in"):
            ServeConfig(client_ipv6_prefix=bits)
    assert ServeConfig().forwarded_allow_ips == () and ServeConfig().client_ipv6_prefix == 64


def test_uvicorn_does_not_read_proxy_headers(translator):
    server = make_server(create_app(translator, SERVE), SERVE)
    assert server.config.proxy_headers is False


def test_x_forwarded_for_is_ignored_by_default(translator):
    """Five requests from 127.0.0.1, each naming another address: one client, so four are refused
    (uvicorn on its own believes the header from loopback peers: every request a new client)."""
    with LiveServer(create_app(translator, ONE_EACH), ONE_EACH) as server:
        assert [post(server, f"203.0.113.{i}") for i in range(5)] == [200, 429, 429, 429, 429]


def test_a_trusted_proxy_names_the_client(translator):
    """From a trusted proxy each forwarded address is a client; what the client itself puts in the
    header (left of what the proxy appended) changes nothing."""
    cfg = replace(ONE_EACH, forwarded_allow_ips=(PROXY,))
    with LiveServer(create_app(translator, cfg), cfg) as server:
        assert [post(server, f"203.0.113.{i}") for i in range(3)] == [200, 200, 200]
        assert post(server, "198.51.100.9, 203.0.113.0") == 429  # a forged left part: still 203.0.113.0
        assert post(server) == 200  # the proxy's own request: the proxy is the client


@pytest.mark.parametrize("bits, statuses", [(64, [200, 429, 200]), (128, [200, 200, 200])])
def test_an_ipv6_client_is_its_64(translator, bits, statuses):
    """Two addresses of one /64 are one client (with 128 bits, two); another /64 is another client."""
    cfg = replace(ONE_EACH, forwarded_allow_ips=(PROXY,), client_ipv6_prefix=bits)
    with LiveServer(create_app(translator, cfg), cfg) as server:
        assert [post(server, a) for a in ("2001:db8:0:1::1", "2001:db8:0:1::2", "2001:db8:0:2::1")] == statuses


def test_connections_are_counted_per_ipv6_64():
    """Two connections per client: a third from another address of the same /64 is refused 429, one
    from another /64 is not."""
    cfg = replace(SERVE, max_connections_per_client=2)

    class Peer(FakeTransport):
        def __init__(self, address: str):
            super().__init__()
            self.address = address

        def get_extra_info(self, name, default=None):
            return {"sockname": ("::1", 8000), "peername": (self.address, 50000)}.get(name, default)

    async def connect(protocol, address: str) -> Peer:
        config = uvicorn.Config(lambda scope, receive, send: None, lifespan="off")
        config.load()
        transport = Peer(address)
        protocol(config, state, {}).connection_made(transport)
        return transport

    async def run() -> list[bool]:
        protocol = guarded_protocol(cfg, Metrics())
        peers = [await connect(protocol, f"2001:db8:0:1::{i}") for i in (1, 2, 3)]
        return [p.closed for p in peers] + [(await connect(protocol, "2001:db8:0:2::1")).closed]

    state = ServerState()
    closed = asyncio.run(run())
    assert closed == [False, False, True, False]
