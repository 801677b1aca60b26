"""The batching worker: one model call per settings group, answers in order, failures contained."""
from __future__ import annotations

import logging
import time

import pytest

from aiayn.decode.config import DecodeConfig
from aiayn.decode.translator import Translator
from aiayn.errors import UserError
from aiayn.serve.batcher import Batcher, Busy
from aiayn.serve.job import max_output_tokens

SENTS = ["A man is riding a bicycle.", "Two dogs play in the snow.", "A girl.", ""]


def make(translator, **kw) -> Batcher:
    return Batcher(translator, **kw)


def test_requests_waiting_together_share_one_call_per_settings(translator):
    greedy, beam = DecodeConfig(max_len_b=8, beam_size=1), DecodeConfig(max_len_b=8, beam_size=3, nbest=2)
    b = make(translator, wait_ms=50)
    ids = translator.encode(SENTS)
    futures = [(cfg, k, b.submit(cfg, [ids[k]], attention=(k == 0)).future) for k in range(4) for cfg in (greedy, beam)]
    assert b.queued == 8
    b.start()  # everything is already queued: one collection, two settings groups
    try:
        results = [(cfg, k, f.result(timeout=60)) for cfg, k, f in futures]
    finally:
        b.stop()
    assert b.calls == 2 and b.queued == 0
    for cfg, k, res in results:
        single = Translator(translator.model, translator.src_tok, translator.tgt_tok, cfg).translate_nbest([SENTS[k]])
        assert [[t.text for t in ts] for ts in res.nbest] == [[t.text for t in ts] for ts in single]
        assert (res.attention is not None) == (k == 0)
    assert results[0][2].attention[0]["cross"].shape[1] == translator.model.cfg.n_heads


def test_token_limit_splits_collections(translator):
    cfg = DecodeConfig(max_len_b=2, beam_size=1)
    ids = translator.encode(SENTS[:2])
    b = make(translator, wait_ms=50, batch_tokens=max(map(len, ids)) + 1)  # room for one sentence per call
    futures = [b.submit(cfg, [x]).future for x in ids]
    b.start()
    try:
        [f.result(timeout=60) for f in futures]
    finally:
        b.stop()
    assert b.calls == 2


def test_full_queue_is_busy(translator):
    b = make(translator, max_queue_sentences=2)
    b.submit(DecodeConfig(), [[5, 3]])
    with pytest.raises(Busy, match="limit 2"):
        b.submit(DecodeConfig(), [[5, 3], [6, 3]])


def test_a_failing_call_answers_its_clients_and_the_worker_goes_on(translator):
    cfg = DecodeConfig(max_len_b=2, beam_size=1)
    b = make(translator, wait_ms=0).start()
    try:
        bad = b.submit(cfg, [[10**6, 3]]).future  # no such token id: the embedding lookup fails
        with pytest.raises(UserError, match=r"src: token ids must be in \[0, "):
            bad.result(timeout=60)
        good = b.submit(cfg, translator.encode(["A girl."])).future
        single = Translator(translator.model, translator.src_tok, translator.tgt_tok, cfg).translate(["A girl."])
        assert good.result(timeout=60).nbest[0][0].text == single[0]
        assert b.queued == 0
    finally:
        b.stop()


def test_abandoned_and_expired_jobs_are_not_decoded(translator):
    import time
    from concurrent.futures import CancelledError

    from aiayn.serve.batcher import Expired
    cfg = DecodeConfig(max_len_b=2, beam_size=1)
    b = make(translator, wait_ms=20)
    ids = translator.encode(SENTS[:3])
    gone = b.submit(cfg, [ids[0]])
    late = b.submit(cfg, [ids[1]], deadline=time.monotonic() - 1)
    kept = b.submit(cfg, [ids[2]], deadline=time.monotonic() + 60)
    gone.abandon()
    b.start()
    try:
        assert len(kept.future.result(timeout=60).nbest) == 1
        with pytest.raises(Expired):
            late.future.result(timeout=60)
        with pytest.raises(CancelledError):
            gone.future.result(timeout=60)
    finally:
        b.stop()
    assert b.calls == 1 and b.skipped == 2 and b.queued == 0


def test_shutdown_refuses_new_jobs_and_drops_queued_ones_after_the_drain(translator):
    from aiayn.serve.batcher import ShuttingDown
    cfg = DecodeConfig(max_len_b=2, beam_size=1)
    b = make(translator, wait_ms=0)
    queued = b.submit(cfg, translator.encode(["A girl."]))
    b.begin_shutdown(drain_s=0.0)
    with pytest.raises(ShuttingDown, match="shutting down"):
        b.submit(cfg, translator.encode(["A dog."]))
    b.start()
    try:
        with pytest.raises(ShuttingDown, match="shut down before the model reached"):
            queued.future.result(timeout=60)
    finally:
        b.stop()
    assert b.calls == 0 and b.queued == 0


def test_abort_answers_the_call_in_progress_and_the_queue_and_ends_the_workers(translator, monkeypatch):
    """``abort`` (a second Ctrl-C): the request in a model call and the one waiting are answered
    ``ShuttingDown`` at once; the call stops before its next decoding step, the workers end."""
    import threading

    from aiayn.serve.batcher import ShuttingDown
    cfg = DecodeConfig(max_len_b=50, beam_size=1)
    b = make(translator, wait_ms=0, concurrent_calls=1)
    in_step, aborted = threading.Event(), threading.Event()
    steps = count_steps(monkeypatch, 1, lambda: in_step.set() or aborted.wait(60))  # the call holds in step 1
    b.start()
    try:
        running = b.submit(cfg, translator.encode(["A man is riding a bicycle."]), client="a")
        assert in_step.wait(60)
        waiting = b.submit(cfg, translator.encode(["A dog."]), client="a")  # its client's call is in progress
        b.abort()
        for job in (running, waiting):
            with pytest.raises(ShuttingDown, match="stopped before the request was translated"):
                job.future.result(timeout=0)  # answered by ``abort`` itself, not by the worker
    finally:
        aborted.set()
        b.stop(timeout=60)
    assert not b.working and b.queued == 0 and len(steps) <= 2  # step 1, and one whose stop check it passed

def count_steps(monkeypatch, k: int = 0, at_k=None) -> list[int]:
    """Counts the model's decoding steps (``CachedDecoder._logits``: one per step of greedy and beam
    search alike) in the list it returns; in step ``k`` it calls ``at_k()``, in the worker, so the
    stop check before step k + 1 sees what it changed."""
    from aiayn.decode.adapter import CachedDecoder
    steps, logits = [], CachedDecoder._logits

    def counted(self, *args, **kw):
        steps.append(1)
        if len(steps) == k:
            at_k()
        return logits(self, *args, **kw)
    monkeypatch.setattr(CachedDecoder, "_logits", counted)
    return steps


def leave(job) -> None:
    job.abandon()


def pass_deadline(job) -> None:
    job.deadline = time.monotonic() - 1.0  # as if the clock had run past it


LONG = dict(min_len=50, max_len_b=50)  # 50 decoding steps at least


@pytest.mark.parametrize("beam", [1, 3])
@pytest.mark.parametrize("first, second", [(leave, leave), (pass_deadline, pass_deadline), (leave, pass_deadline)])
def test_a_call_stops_at_the_step_after_no_request_in_it_is_wanted(translator, monkeypatch, beam, first, second):
    """Two requests in one model call of 50 steps or more: in step 5 the first loses its client or its
    deadline passes, and so does the second: the call makes no sixth step, and answers Expired."""
    from aiayn.serve.batcher import Expired
    cfg = DecodeConfig(beam_size=beam, **LONG)
    b = make(translator, wait_ms=50)
    one = b.submit(cfg, translator.encode(["A girl."]), deadline=time.monotonic() + 600)
    two = b.submit(cfg, translator.encode(["Two dogs play in the snow."]), deadline=time.monotonic() + 600)
    steps = count_steps(monkeypatch, 5, lambda: (first(one), second(two)))
    b.start()  # both queued already: one call
    try:
        for job, how in ((one, first), (two, second)):
            if how is pass_deadline:
                with pytest.raises(Expired, match="while the model decoded it; decoding stopped"):
                    job.future.result(timeout=60)
    finally:
        b.stop()  # (returns once the worker's call has ended)
    assert len(steps) == 5 and b.stopped == 1 and b.calls == 1


def test_a_call_goes_on_while_one_of_its_requests_is_wanted(translator, monkeypatch):
    """In step 5 one request's client leaves and the other's stays: the call decodes to the end, and
    the one left gets the answer it gets alone."""
    cfg = DecodeConfig(beam_size=2, **LONG)
    b = make(translator, wait_ms=50)
    gone = b.submit(cfg, translator.encode(["A girl."]))
    kept = b.submit(cfg, translator.encode(["Two dogs play in the snow."]), deadline=time.monotonic() + 600)
    steps = count_steps(monkeypatch, 5, lambda: leave(gone))
    b.start()
    try:
        out = kept.future.result(timeout=60)
    finally:
        b.stop()
    single = Translator(translator.model, translator.src_tok, translator.tgt_tok, cfg).translate_nbest(
        ["Two dogs play in the snow."])
    assert [t.text for t in out.nbest[0]] == [t.text for t in single[0]]
    assert b.stopped == 0 and b.calls == 1 and len(steps) >= 50


@pytest.mark.parametrize("yield_ms", [0.0, 5000.0])
def test_a_long_call_gives_way_to_a_smaller_one_beside_it(translator, monkeypatch, yield_ms):
    import threading
    from aiayn.decode.adapter import CachedDecoder
    steps, step = [], CachedDecoder.step_topk

    def slow(self, *args, **kw):  # (thread, time) of every beam step; sleeping lets the other call run
        steps.append((threading.current_thread().name, time.monotonic()))
        time.sleep(0.01)
        return step(self, *args, **kw)
    monkeypatch.setattr(CachedDecoder, "step_topk", slow)
    long_cfg, short_cfg = DecodeConfig(beam_size=2, min_len=120, max_len_b=120), DecodeConfig(beam_size=2, min_len=20,
                                                                                            max_len_b=20)
    b = make(translator, wait_ms=0, concurrent_calls=2, yield_ms=yield_ms).start()
    try:
        long = b.submit(long_cfg, translator.encode(SENTS[:3]), client="10.0.0.1")
        while len(steps) < 40:  # (a call waits no longer in all than it has stepped)
            time.sleep(0.005)
        short = b.submit(short_cfg, translator.encode(["A girl."]), client="10.0.0.2")
        short.future.result(timeout=60)
        long.future.result(timeout=60)
    finally:
        b.stop()
    long_thread = steps[0][0]
    mine = [t for name, t in steps if name != long_thread]
    assert len(mine) >= 20
    beside = sum(1 for name, t in steps if name == long_thread and mine[0] < t < mine[-1])
    if yield_ms:
        assert beside <= 2, beside  # at most the step in progress when the short call came
    else:
        assert beside >= 10, beside  # the two calls take turns


def test_small_requests_of_a_client_that_used_the_model_more_get_no_priority(translator, monkeypatch):
    """A client that has used the model for a while sends small requests back to back; another
    client's larger request comes: the larger call does not wait for the small ones (their client
    has used the model more than twice what its own has), as it would wait for another's."""
    import threading
    from aiayn.decode.adapter import CachedDecoder
    steps, step = [], CachedDecoder.step_topk

    def slow(self, tokens, *args, **kw):  # (rows, time) of every beam step
        steps.append((tokens.numel(), time.monotonic()))
        time.sleep(0.01)
        return step(self, tokens, *args, **kw)
    monkeypatch.setattr(CachedDecoder, "step_topk", slow)
    small, large = DecodeConfig(beam_size=2, min_len=20, max_len_b=20), DecodeConfig(beam_size=2, min_len=60, max_len_b=60)
    b = make(translator, wait_ms=0, concurrent_calls=2, yield_ms=5000.0).start()
    done, heavy = threading.Event(), "10.0.0.1"

    def small_requests():  # one row of beam 2: 2 rows a step
        while not done.is_set():
            b.submit(small, translator.encode(["A girl."]), client=heavy).future.result(30)
    try:
        b.submit(large, translator.encode(["A girl."]), client=heavy).future.result(30)  # the heavy client's past use
        feeder = threading.Thread(target=small_requests)
        feeder.start()
        while not any(rows == 2 for rows, _ in steps[-3:]):
            time.sleep(0.005)
        t0 = time.monotonic()
        light = b.submit(large, translator.encode(SENTS[:3]), client="10.0.0.2")  # 3 rows of beam 2: 6 rows
        light.future.result(30)
        took = time.monotonic() - t0
        done.set()
        feeder.join(30)
    finally:
        b.stop()
    mine = [t for rows, t in steps if rows == 6]
    beside = sum(1 for rows, t in steps if rows == 2 and mine[0] < t < mine[-1])
    # waiting for each small call (about 0.25 s) before each of its 60 steps would take 15 s
    assert len(mine) >= 60 and beside >= 20 and took < 5.0, (len(mine), beside, took)


def test_a_call_with_two_parts_of_a_request_whose_client_left_keeps_the_worker(translator, caplog):
    """Two clients share a call's tokens: A's four sentences go in as two parts (its share is two),
    B's between them. Both clients leave after the call took their sentences, before it decodes
    them: nothing is decoded, nothing is logged, and the one worker serves the next request."""
    cfg = DecodeConfig(beam_size=1, max_len_b=4)
    x = translator.encode(["A girl."])[0]
    cost = len(x) + max_output_tokens(cfg, len(x))
    b = make(translator, wait_ms=50, batch_tokens=5 * cost, concurrent_calls=1)  # share: 2 of A's sentences
    real, taken = b._answer, []

    def clients_leave(call_cfg, parts):
        taken.append([(p.job.client, p.start, p.end) for p in parts])
        for part in parts:
            part.job.abandon()
        return real(call_cfg, parts)

    b._answer = clients_leave
    a, other = b.submit(cfg, [x] * 4, client="A"), b.submit(cfg, [x], client="B")
    b.start()
    try:
        deadline = time.monotonic() + 30
        while not (taken and b.queued == 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        b._answer = real
        later = b.submit(cfg, [x], client="C")
        assert later.future.result(timeout=10).nbest[0]  # the worker is still there
    finally:
        b.stop()
    assert taken[0] == [("A", 0, 2), ("B", 0, 1), ("A", 2, 4)] and b.calls == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_cuda_graphs_keep_one_step_decoder_a_worker(translator, monkeypatch):
    # (the device's answer mocked: the CPU runs the graphs' step without capturing it)
    from aiayn.decode.graphs import GraphDecoder
    monkeypatch.setattr("aiayn.decode.translator.replays_graphs", lambda device: True)
    starts = []
    start = GraphDecoder.start
    monkeypatch.setattr(GraphDecoder, "start", lambda self, src, n: starts.append(self) or start(self, src, n))
    cfg = DecodeConfig(max_len_b=8, beam_size=3, cuda_graphs=True)
    b = make(translator, wait_ms=0, concurrent_calls=1).start()
    try:
        answers = [b.submit(cfg, [ids]).future.result(timeout=60) for ids in translator.encode(SENTS[:2])]
    finally:
        b.stop()
    assert b.calls == 2 and all(a.nbest[0] for a in answers)
    assert len(starts) == 2 and starts[0] is starts[1]  # one worker, one step decoder: its graphs captured once
