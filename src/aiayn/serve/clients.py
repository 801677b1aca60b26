"""Who a client is: the key of its queue share, its pace and its connection count.

A client is its peer IP address, with two refinements:

- **IPv6 networks.** A site is given at least a /64 (RFC 6177) and each of its hosts may take
  any address in it (SLAAC, RFC 4862; temporary addresses, RFC 8981), so one machine can be
  2^64 peers. An IPv6 client is therefore its address's first ``ipv6_prefix`` bits (64 by
  default; 128 = each address its own client). An IPv4-mapped address (``::ffff:a.b.c.d``) is
  its IPv4 address.
- **Trusted proxies.** ``X-Forwarded-For`` is believed only from peers named as trusted proxies
  (``forwarded_allow_ips``; none by default, when the header is ignored), as uvicorn's
  ``--forwarded-allow-ips`` and nginx's ``set_real_ip_from`` do. Each proxy appends the address
  it saw, so the list is read from the right: the first entry that is not a trusted proxy was
  written by one, and is the client; what lies left of it is the client's own claim.
"""
from __future__ import annotations

import ipaddress
from typing import Iterable, Sequence

from aiayn.config import ConfigError

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def trusted_networks(entries: Iterable[str]) -> tuple[Network, ...]:
    """The networks of ``forwarded_allow_ips`` entries (an address is a network of one)."""
    out = []
    for entry in entries:
        try:
            out.append(ipaddress.ip_network(entry.strip().strip("[]"), strict=False))
        except ValueError:
            raise ConfigError(f"forwarded_allow_ips: {entry!r} is not an IP address or network "
                              "(like 10.0.0.2 or 10.0.0.0/8)") from None
    return tuple(out)


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address of an ``X-Forwarded-For`` entry or peer (``a.b.c.d``, ``a.b.c.d:port``,
    an IPv6 address, ``[v6]:port``), or None when it is not one."""
    text = text.strip()
    if text.startswith("[") and "]" in text:
        text = text[1:text.index("]")]
    elif text.count(":") == 1:
        text = text.split(":")[0]
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _trusted(address: ipaddress.IPv4Address | ipaddress.IPv6Address | None, trusted: Sequence[Network]) -> bool:
    if address is None:
        return False
    if address.version == 6 and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return any(address in net for net in trusted)


def client_address(peer: str, forwarded_for: Sequence[str], trusted: Sequence[Network]) -> str:
    """The client's address: ``peer``, or, when ``peer`` is a trusted proxy, the right-most entry of
    the ``X-Forwarded-For`` values (``forwarded_for``, in header order) that is not one (the left-most
    when all are). An entry that is not an IP address ends the search with the peer as the client
    (a trusted proxy writes addresses)."""
    if not forwarded_for or not _trusted(_address(peer), trusted):
        return peer
    entries = [e.strip() for value in forwarded_for for e in value.split(",") if e.strip()]
    for entry in reversed(entries):
        address = _address(entry)
        if address is None:
            return peer
        if not _trusted(address, trusted):
            return str(address)
    return str(_address(entries[0])) if entries else peer


def client_key(address: str, ipv6_prefix: int) -> str:
    """The client of ``address``: an IPv4 address itself, an IPv6 one its network of ``ipv6_prefix``
    bits (``2001:db8::/64``; 128: the address); anything else (a Unix socket) as it is."""
    ip = _address(address)
    if ip is None:
        return address
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    if ip.version == 6 and ipv6_prefix < 128:
        return str(ipaddress.IPv6Network((int(ip), ipv6_prefix), strict=False))  # (int: without a zone id)
    return str(ip)
