"""Per-client pacing of requests: a client that sends faster than ``rate`` requests a second on
average is held, not refused, until its rate allows (as nginx's ``limit_req`` with a burst holds
excess requests).

The fair queue (``serve.fair``) shares the model between clients, but every request also costs the
service's one event loop its parsing, encoding and answer; a client sending small requests back to
back on its every connection takes that from the others without ever waiting for the model. Held
requests keep their connections, so a client can have at most ``max_connections_per_client`` held,
and its rate falls to ``rate``.

The rule is the generic cell rate algorithm (GCRA, ITU-T I.371), the virtual-scheduling form of a
token bucket: each client has a theoretical arrival time ``tat``; a request arriving at ``now`` may
pass at ``max(now, tat - (burst - 1) / rate)``, and moves ``tat`` to ``max(now, tat) + 1 / rate``
(a request refused because its wait would pass its deadline moves nothing).
So ``burst`` requests at once pass unheld, and over any long span a client passes at most ``rate``
a second.
"""
from __future__ import annotations


class Pacer:
    """Hold times of requests by client (``hold``); ``rate`` <= 0: none held."""

    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, max(1, burst)
        self._tat: dict[str, float] = {}  # client -> theoretical arrival time
        self.held = 0  # requests that were held

    def hold(self, client: str, now: float, limit: float = float("inf")) -> float:
        """Seconds the request of ``client`` arriving at ``now`` (a monotonic clock) waits before it is
        handled (0: at once), its place in the client's pace taken; a wait of ``limit`` or more is
        returned without taking a place (the request is refused, and a refused request does not push
        the client's later ones back)."""
        if self.rate <= 0:
            return 0.0
        interval = 1.0 / self.rate
        tat = max(now, self._tat.get(client, now))
        wait = max(now, tat - (self.burst - 1) * interval) - now
        if wait >= limit:
            return wait
        self._tat[client] = tat + interval
        if len(self._tat) > 4096:  # forget clients whose pace is back at rest
            self._tat = {c: t for c, t in self._tat.items() if t > now}
        if wait > 0:
            self.held += 1
        return wait
