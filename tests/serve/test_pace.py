"""Per-client pacing (``serve.pace``): a client faster than ``client_requests_per_s`` is held, not
refused, before any of its request is read; other clients are not held."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from aiayn.config import ConfigError, replace
from aiayn.serve.app import create_app
from aiayn.serve.config import ServeConfig
from aiayn.serve.pace import Pacer

from .conftest import SERVE, LiveServer
from .test_bounds import metrics_text
from .test_fairness import post_from


def test_pacer_golden():
    """Rate 2 a second (an interval of 0.5 s), burst 3: the tolerance is (3 - 1) x 0.5 = 1 s ahead of
    the arrival. Four at t = 0: three pass, the fourth waits until its theoretical time less the
    tolerance, 1.5 - 1 = 0.5; one more at 0.1 waits until 2.0 - 1 = 1.0 (0.9 s); another client is
    not held; at t = 10 the pace is back at rest."""
    pacer = Pacer(2.0, 3)
    assert [pacer.hold("a", 0.0) for _ in range(4)] == [0.0, 0.0, 0.0, 0.5]
    assert pacer.hold("a", 0.1) == pytest.approx(0.9)
    assert pacer.hold("b", 0.1) == 0.0
    assert pacer.hold("a", 10.0) == 0.0
    assert pacer.held == 2


def test_pacer_long_run_rate_and_off():
    """100 requests at once at 2 a second, burst 3: the last waits (100 - 3) x 0.5 s; rate 0 holds none."""
    pacer = Pacer(2.0, 3)
    assert [pacer.hold("a", 0.0) for _ in range(100)][-1] == pytest.approx(48.5)
    off = Pacer(0.0, 1)
    assert {off.hold("a", 0.0) for _ in range(100)} == {0.0} and off.held == 0


def test_a_refused_request_takes_no_place():
    """A wait at or over ``limit`` is returned without taking a place in the pace: rate 1, burst 1,
    at t = 0 one passes, a second would wait 1 s (over a limit of 0.5: refused), and a third at
    t = 0.6 still waits only 0.4 s, as if the refused one had not come."""
    pacer = Pacer(1.0, 1)
    assert pacer.hold("a", 0.0, limit=0.5) == 0.0
    assert pacer.hold("a", 0.0, limit=0.5) == pytest.approx(1.0)
    assert pacer.hold("a", 0.6, limit=0.5) == pytest.approx(0.4)
    assert pacer.held == 1


def test_pace_settings_are_checked():
    with pytest.raises(ConfigError, match="client_requests_per_s"):
        ServeConfig(client_requests_per_s=-1)
    with pytest.raises(ConfigError, match="client_burst"):
        ServeConfig(client_burst=0)


def test_a_client_faster_than_its_pace_is_held_and_others_are_not(translator):
    """Pace 4 a second, burst 1: three requests at once from one address take at least 2 x 0.25 s,
    all answered 200; a request of another address meanwhile is answered without a hold; /health
    names the pace and /metrics counts the held requests."""
    cfg = replace(SERVE, client_requests_per_s=4.0, client_burst=1)
    with LiveServer(create_app(translator, cfg), cfg) as server:
        post_from(server, "127.0.0.9", {"sentences": ["A cat."]})  # the first model call sets things up
        with ThreadPoolExecutor(4) as pool:
            t0 = time.monotonic()
            fast = [pool.submit(post_from, server, "127.0.0.2", {"sentences": ["A dog."]}) for _ in range(3)]
            time.sleep(0.05)
            other_t0 = time.monotonic()
            assert post_from(server, "127.0.0.3", {"sentences": ["A dog."]})[0] == 200
            other_s = time.monotonic() - other_t0
            assert [f.result(30)[0] for f in fast] == [200, 200, 200]
            fast_s = time.monotonic() - t0
        assert fast_s >= 0.5 and other_s < 0.45
        assert 'event="client_paced"} 2' in metrics_text(server)


def test_a_hold_past_the_deadline_is_refused(translator):
    """Pace 0.1 a second (one request in 10 s), burst 1, deadline 2 s: the second request would wait
    10 s, past its deadline, so it is refused 429 at once and says when to retry."""
    cfg = replace(SERVE, client_requests_per_s=0.1, client_burst=1, request_timeout_s=2.0)
    with LiveServer(create_app(translator, cfg), cfg) as server:
        assert post_from(server, "127.0.0.2", {"sentences": ["A dog."]})[0] == 200
        t0 = time.monotonic()
        status, data = post_from(server, "127.0.0.2", {"sentences": ["A dog."]})
        assert status == 429 and time.monotonic() - t0 < 1.5
        assert "more than 0.1 requests a second from this address; retry in" in data["error"]
        assert post_from(server, "127.0.0.3", {"sentences": ["A dog."]})[0] == 200
