"""Counters of the service, rendered for GET /metrics in Prometheus' text exposition format (0.0.4).

    aiayn_requests_total{path,status}          answered requests
    aiayn_request_duration_seconds{path}       latency histogram (arrival of the headers to the answer)
    aiayn_requests_in_flight                   requests being handled now
    aiayn_queue_sentences                      sentences waiting for the model
    aiayn_model_calls_total                    model calls of the batching worker
    aiayn_skipped_requests_total               requests dropped undecoded (client gone, deadline, shutdown)
    aiayn_stopped_model_calls_total            model calls stopped part way: none of their requests was wanted
    aiayn_connections                          open client connections
    aiayn_events_total{event}                  header_timeout, body_timeout, connection_refused,
                                               client_connection_refused, client_queue_full, client_gone,
                                               client_paced, deadline, bad_host, bad_origin, unauthorized
Everything runs on the event loop, so plain integers suffice.
"""
from __future__ import annotations

import math
from collections import Counter

PATHS = ("/", "/health", "/metrics", "/translate")
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, math.inf)


def path_label(path: str) -> str:
    """The path as a label: one of ``PATHS`` or "other" (so clients cannot grow the series)."""
    return path if path in PATHS else "other"


class Metrics:
    """Request counts by path and status, latency histograms by path, in-flight requests and events."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()
        self.buckets: dict[str, list[int]] = {p: [0] * len(BUCKETS) for p in (*PATHS, "other")}
        self.seconds: Counter[str] = Counter()
        self.in_flight = 0
        self.connections = 0
        self.events: Counter[str] = Counter()

    def observe(self, path: str, status: int, seconds: float) -> None:
        label = path_label(path)
        self.requests[label, status] += 1
        self.seconds[label] += seconds
        counts = self.buckets[label]
        for i, le in enumerate(BUCKETS):
            if seconds <= le:
                counts[i] += 1

    def render(self, queue_sentences: int, model_calls: int, skipped: int, stopped: int = 0) -> str:
        lines = ["# HELP aiayn_requests_total Answered HTTP requests by path and status.",
                 "# TYPE aiayn_requests_total counter"]
        lines += [f'aiayn_requests_total{{path="{p}",status="{s}"}} {n}' for (p, s), n in sorted(self.requests.items())]
        lines += ["# HELP aiayn_request_duration_seconds Time from a request's headers to its answer.",
                  "# TYPE aiayn_request_duration_seconds histogram"]
        for p, counts in self.buckets.items():
            if not counts[-1]:
                continue
            lines += [f'aiayn_request_duration_seconds_bucket{{path="{p}",le="{_le(le)}"}} {n}'
                      for le, n in zip(BUCKETS, counts)]
            lines += [f'aiayn_request_duration_seconds_sum{{path="{p}"}} {self.seconds[p]:.6f}',
                      f'aiayn_request_duration_seconds_count{{path="{p}"}} {counts[-1]}']
        gauges = [("requests_in_flight", "gauge", "Requests being handled now.", self.in_flight),
                  ("queue_sentences", "gauge", "Sentences waiting for the model.", queue_sentences),
                  ("connections", "gauge", "Open client connections.", self.connections),
                  ("model_calls_total", "counter", "Model calls of the batching worker.", model_calls),
                  ("skipped_requests_total", "counter", "Requests dropped before decoding.", skipped),
                  ("stopped_model_calls_total", "counter", "Model calls stopped between decoding steps.", stopped)]
        for name, kind, text, value in gauges:
            lines += [f"# HELP aiayn_{name} {text}", f"# TYPE aiayn_{name} {kind}", f"aiayn_{name} {value}"]
        lines += ["# HELP aiayn_events_total Refusals and timeouts by kind.", "# TYPE aiayn_events_total counter"]
        lines += [f'aiayn_events_total{{event="{e}"}} {n}' for e, n in sorted(self.events.items())]
        return "\n".join(lines) + "\n"


def _le(x: float) -> str:
    return "+Inf" if math.isinf(x) else repr(x)
