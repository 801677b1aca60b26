"""A bounded load test on loopback: 50 requests from 8 threads against a live uvicorn server.

Every answer must equal the answer to the same sentence sent alone; requests arriving
together must share model calls. Prints requests/s and latency percentiles (run with -s).
"""
from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np

SENTS = ["A man is riding a bicycle.", "Two dogs play in the snow.", "A girl in a pink dress.",
         "People walk down the street.", "A cat.", "The woman is singing on a stage."]
N_REQUESTS, N_THREADS = 50, 8


def post(url: str, body: dict, timeout: float = 60.0) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/translate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def test_concurrent_clients_get_the_single_request_answers(live_server):
    url = live_server.url
    single = {}
    for s in SENTS:
        for beam in (1, 4):
            status, data = post(url, {"sentences": [s], "beam": beam})
            assert status == 200, data
            single[s, beam] = data["translations"][0]

    rng = random.Random(0)
    requests = [{"sentences": rng.sample(SENTS, rng.randint(1, 3)), "beam": rng.choice((1, 4))}
                for _ in range(N_REQUESTS)]
    requests[7] = {"sentences": "not a list"}  # a bad client in the crowd
    calls_before = get(url + "/health")["model_calls"]

    def timed(body):
        t0 = time.perf_counter()
        status, data = post(url, body)
        return status, data, time.perf_counter() - t0

    t0 = time.perf_counter()
    with ThreadPoolExecutor(N_THREADS) as pool:
        answers = list(pool.map(timed, requests))
    wall = time.perf_counter() - t0

    for body, (status, data, _) in zip(requests, answers):
        if body["sentences"] == "not a list":
            assert status == 422 and "sentences" in data["error"]
            continue
        assert status == 200, data
        assert data["translations"] == [single[s, body["beam"]] for s in body["sentences"]]
    health = get(url + "/health")
    assert health["status"] == "ok" and health["queued"] == 0
    calls = health["model_calls"] - calls_before
    assert calls < N_REQUESTS - 1, "concurrent requests were not batched together"
    lat = np.array([a[2] for a in answers]) * 1000
    print(f"\nload: {N_REQUESTS} requests from {N_THREADS} threads in {wall:.2f}s = {N_REQUESTS / wall:.1f} requests/s; "
          f"latency ms p50 {np.percentile(lat, 50):.0f}, p95 {np.percentile(lat, 95):.0f}, max {lat.max():.0f}; "
          f"{calls} model calls")
