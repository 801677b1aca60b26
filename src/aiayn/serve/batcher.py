"""The batching workers: requests from concurrent clients share one model call.

Background threads (``concurrent_calls``; each makes its model calls one after another) share
the model. Once a request waits, a free worker waits ``wait_ms`` for more (or until
``batch_tokens`` wait: source tokens plus the most output tokens each sentence may produce,
``Job.n_tokens``), then takes up to ``batch_tokens`` from the queue, fairly between clients
(fair.py: each client's requests in order, clients taking turns, a long request spread over
several model calls). It groups what it took by decode settings (``call_settings``: beam search
runs one configuration at a time; greedy requests that differ only in α share a call),
translates each group with one ``Translator.translate_ids`` call (which sorts by length and
pads, §5.1 style batching), smallest group first, and answers each request through its
``Future`` once all its sentences are decoded. A client has at most one model call in
progress: a worker passes over the clients in another worker's calls, so with two workers one
client's long calls never hold up the other clients; and a call gives way to a smaller call beside
it: before each decoding step it waits (up to ``yield_ms`` a step) while a call of fewer tokens
runs whose clients have not used the model more than twice what its own have (each step's time is
charged to the call's clients by their shares of its tokens, forgotten with a half-life of
``SERVED_HALF_LIFE_S``).
So short requests beside a long one run at nearly the speed of an idle service, and a client that
floods small requests gets no priority; under a steady load of short requests a long one may
reach its deadline (503). A failure answers the requests of its group with the
exception; the worker itself keeps running. Queued sentences are capped in all (``Busy``) and
per client (``ClientBusy``).

A request is not decoded (or not decoded further) when, at collection time, its client has gone
(``abandon``), its deadline has passed (``Expired``) or the service is shutting down and its
drain time is over (``ShuttingDown``). A model call in progress stops between two decoding
steps once every request in it has lost its client or passed its deadline (``search``'s
``stop``), so requests nobody waits for no longer hold a worker; they are answered with
``Expired`` (``stopped`` counts such calls). A call in progress is finished during a drain;
``abort`` (a second interrupt) answers every request waiting or in a call ``ShuttingDown`` at once
and stops the calls before their next decoding step.
Attention maps are computed only within a request's budget of weights, which counts every map
computed (``attention_values``), not only those returned.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from concurrent.futures import InvalidStateError

import torch

from aiayn.decode.config import DecodeConfig
from aiayn.decode.search import Hypothesis, Stopped, length_penalty
from aiayn.decode.translator import Translation, Translator
from aiayn.model import ModelConfig
from aiayn.serve.fair import FairQueue, Part, turn_end
from aiayn.serve.job import Job, Result

log = logging.getLogger(__name__)
SERVED_HALF_LIFE_S = 30.0  # how fast a client's use of the model is forgotten, for giving way


class Busy(Exception):
    """The queue is full; the client should retry later (HTTP 503)."""


class ClientBusy(Busy):
    """This client's share of the queue is full; other clients are still served (HTTP 429)."""


class ShuttingDown(Busy):
    """The service is stopping: the request is refused, or was queued and not reached in time (HTTP 503)."""


STOPPED = "the service stopped before the request was translated; retry on another instance"


class Expired(Exception):
    """The request's deadline passed before the model reached it; it was not decoded (HTTP 503)."""


def attention_values(m: ModelConfig, src_len: int, tgt_len: int) -> int:
    """The weights ``Translator.attention`` computes for one output: the encoder's self-attention
    (L x H x S x S), the decoder's (L x H x T x T) and the cross-attention (L x H x T x S)."""
    return m.n_heads * (m.n_layers * src_len * src_len + m.decoder_layers * tgt_len * (tgt_len + src_len))


def call_settings(cfg: DecodeConfig) -> DecodeConfig:
    """The settings of the model call that decodes a request with settings ``cfg``: ``cfg`` itself,
    except for greedy search (beam 1, no sampling, no MBR), where α = 0. Greedy search never reads α
    to choose a token; it only divides a finished output's sum of log-probabilities by lp(|Y|)
    (search.py), so greedy requests that differ only in α share a call and ``rescored`` gives each
    its scores. In beam search α decides which finished hypotheses are kept and when a sentence's
    search stops, so there requests with different α keep separate calls."""
    if cfg.beam_size == 1 and not cfg.sampling and not cfg.mbr:
        return dataclasses.replace(cfg, alpha=0.0)
    return cfg


def rescored(hyps: list[list[Hypothesis]], alpha: float, device: torch.device) -> list[list[Hypothesis]]:
    """Greedy hypotheses scored with length penalty ``alpha``, bit for bit as the search scores them:
    its float64 sum of log-probabilities, on its device, divided by lp(|Y|) as a Python float."""
    def score(h: Hypothesis) -> float:
        log_prob = torch.tensor([h.log_prob], dtype=torch.float64, device=device)
        return (log_prob / length_penalty(float(h.length), alpha)).item()

    return [[dataclasses.replace(h, score=score(h)) for h in hs] for hs in hyps]


class Batcher:
    """Collects requests for ``wait_ms`` (up to ``batch_tokens`` tokens), fairly between clients, into
    one model call per settings; ``concurrent_calls`` workers. Every call decodes with
    ``translator``'s models (its decoding copies) and tokenizers, under the call's own settings."""

    def __init__(self, translator: Translator, *, wait_ms: float = 5.0, batch_tokens: int = 4096,
                 max_queue_sentences: int = 2048, max_queued_per_client: int | None = None,
                 concurrent_calls: int = 2, yield_ms: float = 250.0):
        self.model, self.src_tok, self.tgt_tok = translator.models, translator.src_tok, translator.tgt_tok
        self.wait_s, self.batch_tokens, self.max_queue = wait_ms / 1000.0, batch_tokens, max_queue_sentences
        self.max_per_client = max_queue_sentences if max_queued_per_client is None else max_queued_per_client
        self._waiting = FairQueue()  # sentences submitted and not yet taken by the model
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)  # told of every new job and of stop
        self._stopping = False
        self._busy: Counter[str] = Counter()  # parts in model calls in progress, by client
        self.yield_s = yield_ms / 1000.0
        # model calls in progress: id -> (tokens, ``Part.n_tokens`` summed; client -> share of them)
        self._running: dict[int, tuple[int, dict[str, float]]] = {}
        self._calls: dict[int, list[Part]] = {}  # model calls in progress: id -> their parts (``abort``)
        self._aborted = False  # ``abort``: every request answered, the calls stop at their next step
        self._running_changed = threading.Condition()
        self._call_ids = 0
        self._served: dict[str, float] = {}  # client -> model seconds used, decayed (``SERVED_HALF_LIFE_S``)
        self._served_at = time.monotonic()
        self.calls = 0  # model calls (one per settings group)
        self.skipped = 0  # requests dropped undecoded (client gone, deadline passed, shutdown)
        self.stopped = 0  # model calls stopped part way: none of their requests was still wanted
        self._drain_until: float | None = None  # set by begin_shutdown
        self._thread = threading.local()  # what a worker thread keeps across its calls (``_kept_decoder``)
        self._threads = [threading.Thread(target=self._run, name=f"aiayn-batcher-{i}", daemon=True)
                         for i in range(concurrent_calls)]

    @property
    def queued(self) -> int:
        """Sentences submitted and not yet taken by the model."""
        return self._waiting.sentences

    @property
    def queued_clients(self) -> int:
        """Clients with sentences waiting for the model."""
        return self._waiting.clients

    def start(self) -> "Batcher":
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Decode what waits, then end the workers (waiting at most ``timeout`` seconds for them)."""
        with self._ready:
            self._stopping = True
            self._ready.notify_all()
        end = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))

    @property
    def working(self) -> bool:
        """Whether a worker thread is still running (after ``stop``: one inside a model step)."""
        return any(thread.is_alive() for thread in self._threads)

    def begin_shutdown(self, drain_s: float) -> None:
        """Refuse new requests (``ShuttingDown``); queued ones are decoded for ``drain_s`` seconds more,
        the rest are answered with ``ShuttingDown``."""
        with self._lock:
            if self._drain_until is None:
                self._drain_until = time.monotonic() + drain_s

    def abort(self) -> None:
        """Stop at once (a second interrupt): every request waiting or in a model call is answered
        ``ShuttingDown`` now, the calls stop before their next decoding step and the workers end."""
        with self._ready:
            self._aborted = self._stopping = True
            if self._drain_until is None:
                self._drain_until = time.monotonic()
            jobs = self._waiting.clear()
            self._ready.notify_all()
        with self._running_changed:
            jobs += [part.job for parts in self._calls.values() for part in parts]
            self._running_changed.notify_all()  # a call giving way to another goes on to its stop
        for job in jobs:
            job.fail(ShuttingDown(STOPPED))

    @property
    def shutting_down(self) -> bool:
        return self._drain_until is not None

    @property
    def drained(self) -> bool:
        """Shutting down, and nothing waits for the model any more (or the drain time is over)."""
        with self._lock:
            return self._drain_until is not None and (self.queued == 0 or time.monotonic() > self._drain_until)

    def submit(self, cfg: DecodeConfig, ids: list[list[int]], attention: bool = False, *,
               attention_values: int | None = None, deadline: float | None = None,
               prefixes: list[list[int]] | None = None, client: str = "") -> Job:
        """Queue one request of ``client``; its ``future`` gives a ``Result``. Raises ``ClientBusy``
        when the client's share of the queue is full, ``Busy`` when the queue is full and
        ``ShuttingDown`` after ``begin_shutdown``."""
        job = Job(cfg, ids, attention, attention_values, deadline, prefixes=prefixes, client=client)
        with self._lock:
            if self._drain_until is not None:
                raise ShuttingDown("the service is shutting down; retry on another instance")
            self._check_client(client, len(ids))
            if self.queued + len(ids) > self.max_queue:
                raise Busy(f"{self.queued} sentences are waiting for the model (limit {self.max_queue}); retry later")
            self._waiting.push(job)
            self._ready.notify_all()
        return job

    def check_client(self, client: str, sentences: int = 1) -> None:
        """Raise ``ClientBusy`` if ``sentences`` more from ``client`` would exceed its share of the queue
        (asked before a request is read, a client whose share is full costs no parsing or encoding)."""
        with self._lock:
            self._check_client(client, sentences)

    def _check_client(self, client: str, sentences: int) -> None:
        mine = self._waiting.per_client[client]
        if mine + sentences > self.max_per_client:
            raise ClientBusy(f"this client has {mine} sentences waiting for the model (limit {self.max_per_client} "
                             "per client); retry when they are answered")

    @staticmethod
    def _gone(job: Job, now: float) -> bool:
        """The job's client left or its deadline passed (for good: neither is undone)."""
        return job.abandoned or job.future.cancelled() or (job.deadline is not None and now > job.deadline)

    def _live(self, job: Job) -> bool:
        """Whether to decode ``job``'s next sentences; a dropped job is answered (or was cancelled) here:
        ``Expired`` past its deadline, ``ShuttingDown`` past the drain time."""
        if job.future.done() and not job.future.cancelled():
            return False  # answered already: a model call with its earlier sentences failed
        now = time.monotonic()
        if self._gone(job, now):
            if not (job.abandoned or job.future.cancelled()):  # (a client that left reads no answer)
                job.fail(Expired("the request's deadline passed before the model reached it"))
        elif self._drain_until is not None and now > self._drain_until:
            job.fail(ShuttingDown("the service shut down before the model reached it"))
        else:
            return True
        self.skipped += 1
        return False

    def _collect(self) -> list[Part] | None:
        """The parts of the next model call(s): once a request of a client without a call in progress
        waits, more are awaited for ``wait_ms`` (or until ``batch_tokens`` wait), then taken
        (``_take``); None when stopped and nothing waits for this worker."""
        with self._ready:
            while self._waiting.head(self._busy) is None:
                if self._stopping:
                    return None  # (what waits for a busy client, the worker with its call takes)
                self._ready.wait()
            deadline = time.monotonic() + self.wait_s
            while not self._stopping and self._waiting.tokens < self.batch_tokens:
                if (left := deadline - time.monotonic()) <= 0:
                    break
                self._ready.wait(left)
            return self._take()

    def _take(self) -> list[Part]:
        """Up to ``batch_tokens`` from the fair queue, the clients taking turns: a turn takes the next
        sentences of the client's first request up to a share of ``batch_tokens`` (divided by the
        clients waiting), and the call is full when the next turn's first sentence does not fit."""
        parts: list[Part] = []
        room = self.batch_tokens
        share = max(1, self.batch_tokens // max(1, self._waiting.clients))
        while (job := self._waiting.head(self._busy)) is not None:
            if not self._live(job):
                self._waiting.drop(job)
                continue
            end = turn_end(job.costs, job.next, share, room, first=not parts)
            if end == job.next < len(job.ids):
                break  # first in the next call
            parts.append(self._waiting.take(job, end))
            room -= parts[-1].n_tokens
        self._busy.update(part.job.client for part in parts)
        return parts

    def _run(self) -> None:
        while (parts := self._collect()) is not None:
            groups: dict[DecodeConfig, list[Part]] = {}
            for part in parts:
                groups.setdefault(call_settings(part.job.cfg), []).append(part)
            for cfg, group in sorted(groups.items(), key=lambda g: sum(p.n_tokens for p in g[1])):  # smallest first
                try:
                    self._answer(cfg, group)
                except Exception as exc:  # noqa: BLE001 -- answer the clients, keep serving
                    log.exception("translation failed for %d requests", len(group))
                    for part in group:
                        part.job.fail(exc)
                finally:
                    with self._ready:  # the group's clients may be taken by any worker again
                        self._busy.subtract(part.job.client for part in group)
                        self._busy = +self._busy
                        self._ready.notify_all()

    def _kept_decoder(self, cfg: DecodeConfig):
        """With ``cuda_graphs``, this worker thread's step decoder, made at its first call and kept, so that
        its CUDA graphs are captured once, not at every call (one search at a time uses it: the thread's);
        else None (each call's ``Translator`` makes its own)."""
        if not cfg.cuda_graphs:
            return None
        if getattr(self._thread, "decoder", None) is None:
            self._thread.decoder = Translator(self.model, None, None, cfg).decoder
        return self._thread.decoder

    def _answer(self, cfg: DecodeConfig, parts: list[Part]) -> None:
        """One ``translate_ids`` call with settings ``cfg`` (``call_settings``) for the sentences of
        ``parts``, then the answer of each request whose last sentences they were."""
        parts = [part for part in parts if part.job.begin()]  # drop cancelled ones
        if not parts:
            return
        translator = Translator(self.model, self.src_tok, self.tgt_tok, cfg, self._kept_decoder(cfg))
        ids = [x for part in parts for x in part.ids]
        t0 = time.perf_counter()
        prefixes = [x for part in parts for x in part.prefixes]

        me = self._enter(parts)
        last = time.monotonic()

        def stop() -> bool:  # before every decoding step: give way, then: is any request still wanted?
            nonlocal last
            now = time.monotonic()
            self._charge(me, now - last)
            last = now + self._give_way(me)
            # (a call is finished during a drain, stopped by ``abort``)
            return self._aborted or all(self._gone(part.job, last) for part in parts)

        try:
            hyps = translator.translate_ids(ids, prefixes if any(prefixes) else None, stop=stop)
        except Stopped:  # every request's client left or its deadline passed, for good; or ``abort``
            for part in parts:
                part.job.fail(ShuttingDown(STOPPED) if self._aborted else
                              Expired("the request's deadline passed while the model decoded it; decoding stopped"))
            with self._lock:
                self.calls += 1
                self.stopped += 1
            log.info("a model call of %d requests stopped part way: none was still wanted", len(parts))
            return
        finally:
            self._leave(me)
        with self._lock:
            self.calls += 1
        log.debug("%d requests, %d sentences in one call: %.1f ms", len(parts), len(ids),
                  1000 * (time.perf_counter() - t0))
        start = 0
        for part in parts:
            job, mine = part.job, hyps[start:start + len(part.ids)]
            start += len(part.ids)
            job.hyps[part.start:part.end] = mine if job.cfg.alpha == cfg.alpha else \
                rescored(mine, job.cfg.alpha, translator.device)
            job.decoded += part.end - part.start
            if job.decoded < len(job.ids):
                continue
            nbest = [[Translation(self.tgt_tok.decode(h.tokens), h.tokens, h.score, h.log_prob, h.eos) for h in hs]
                     for hs in job.hyps]
            att = self._attention(translator, job, job.hyps) if job.attention and not job.abandoned else None
            try:
                job.future.set_result(Result(nbest, att))
            except InvalidStateError:  # answered meanwhile (``abort``)
                pass

    def _enter(self, parts: list[Part]) -> int:
        """Record a model call as running, with each client's share of its tokens; its id."""
        size = sum(part.n_tokens for part in parts) or 1
        shares: dict[str, float] = {}
        for part in parts:
            shares[part.job.client] = shares.get(part.job.client, 0.0) + part.n_tokens / size
        with self._running_changed:
            self._call_ids += 1
            self._running[self._call_ids] = size, shares
            self._calls[self._call_ids] = parts
            return self._call_ids

    def _leave(self, me: int) -> None:
        with self._running_changed:
            del self._running[me], self._calls[me]
            self._running_changed.notify_all()

    def _charge(self, me: int, seconds: float) -> None:
        """A step of call ``me`` took ``seconds``: its clients' served time grows by their shares of it
        (all served times halve every ``SERVED_HALF_LIFE_S``)."""
        with self._running_changed:
            now = time.monotonic()
            decay = 0.5 ** ((now - self._served_at) / SERVED_HALF_LIFE_S)
            self._served_at = now
            self._served = {c: v * decay for c, v in self._served.items() if v * decay > 1e-3}
            for client, share in self._running[me][1].items():
                self._served[client] = self._served.get(client, 0.0) + share * seconds

    def _served_by(self, call: int) -> float:
        return sum(share * self._served.get(client, 0.0) for client, share in self._running[call][1].items())

    def _gives_way_to(self, me: int, other: int) -> bool:
        """Whether call ``me`` waits for ``other``: a smaller call, of clients that have not used the
        model more than twice what ``me``'s have (a client that floods small requests gets no priority)."""
        return self._running[other][0] < self._running[me][0] and self._served_by(other) <= 2 * self._served_by(me)

    def _give_way(self, me: int) -> float:
        """Wait (``yield_s`` at most) while a call beside this one is one it gives way to; the seconds
        waited."""
        if self.yield_s <= 0:
            return 0.0
        with self._running_changed:
            start = time.monotonic()
            end = start + self.yield_s
            while (not self._aborted and any(self._gives_way_to(me, k) for k in self._running if k != me)
                   and (left := end - time.monotonic()) > 0):
                self._running_changed.wait(left)
            return time.monotonic() - start

    @staticmethod
    def _attention(translator: Translator, job: Job, hyps: list) -> list[dict | None]:
        """``Translator.attention`` of each best output, in order, while the weights it computes
        (``attention_values``) fit the job's budget; None for the others and for empty sentences."""
        m = translator.model.cfg
        left = job.attention_values
        out: list[dict | None] = []
        for x, hs in zip(job.ids, hyps):
            size = attention_values(m, len(x), len(hs[0].tokens) + hs[0].eos) if hs else 0
            if not hs or (left is not None and size > left):
                out.append(None)
                continue
            if left is not None:
                left -= size
            out.append(translator.attention(x, hs[0].tokens, hs[0].eos))
        return out
