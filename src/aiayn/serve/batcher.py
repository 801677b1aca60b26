"""The batching worker: requests from concurrent clients share one model call.

One background thread owns the model. It takes the first waiting request, keeps collecting
requests that arrive within ``wait_ms`` until their tokens reach ``batch_tokens`` (source tokens
plus the most output tokens each sentence may produce, ``Job.n_tokens``),
groups the collected requests by decode settings (a frozen ``DecodeConfig``; beam search runs
one configuration at a time), translates each group with one ``Translator.translate_ids``
call (which sorts by length and pads, §5.1 style batching), and answers each request through
its ``Future``. A failure answers the requests of its group with the exception; the worker
itself keeps running.

A request is never decoded when, at collection time, its client has gone (``abandon``), its
deadline has passed (``Expired``) or the service is shutting down and its drain time is over
(``ShuttingDown``). Attention maps are computed only within a request's budget of weights,
which counts every map computed (``attention_values``), not only those returned.
"""
from __future__ import annotations

import logging
import math
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Sequence

from aiayn.data.vocab import Tokenizer
from aiayn.decode.config import DecodeConfig
from aiayn.decode.translator import Translation, Translator
from aiayn.model import ModelConfig, Transformer

log = logging.getLogger(__name__)


class Busy(Exception):
    """The queue is full; the client should retry later (HTTP 503)."""


class ShuttingDown(Busy):
    """The service is stopping: the request is refused, or was queued and not reached in time (HTTP 503)."""


class Expired(Exception):
    """The request's deadline passed before the model reached it; it was not decoded (HTTP 503)."""


@dataclass
class Result:
    nbest: list[list[Translation]]  # per sentence, best first ([] for an empty sentence)
    attention: list[dict | None] | None  # per sentence: Translator.attention of the best output


@dataclass(eq=False)
class Job:
    """One request waiting for the model; its ``future`` gives a ``Result``."""

    cfg: DecodeConfig
    ids: list[list[int]]  # source ids + EOS per sentence ([] when empty)
    attention: bool
    attention_values: int | None = None  # most attention weights to return (None: no limit)
    deadline: float | None = None  # time.monotonic() after which the job is not decoded
    abandoned: bool = False  # the client left: not decoded, no attention computed
    prefixes: list[list[int]] | None = None  # forced target ids per sentence ([] for none)
    future: Future = field(default_factory=Future)

    def abandon(self) -> None:
        """The client will not read the answer: drop the job if it has not started."""
        self.abandoned = True
        self.future.cancel()

    @property
    def n_tokens(self) -> int:
        """What the job spends of a model call's ``batch_tokens``: every sentence's source tokens
        plus the most output tokens its search may produce (``max_output_tokens``)."""
        prefixes = self.prefixes or [[]] * len(self.ids)
        return sum(len(x) + max_output_tokens(self.cfg, len(x), len(p)) for x, p in zip(self.ids, prefixes) if x)


def max_output_tokens(cfg: DecodeConfig, src_len: int, prefix_len: int = 0) -> int:
    """The search's output limit for a source of ``src_len`` tokens (EOS included): floor(a * |x| + b),
    at least 1, raised to a forced prefix's length + 1 (``aiayn.decode.search.max_output_lengths``)."""
    return max(1, math.floor(cfg.max_len_a * src_len + cfg.max_len_b), prefix_len + 1)


def attention_values(m: ModelConfig, src_len: int, tgt_len: int) -> int:
    """The weights ``Translator.attention`` computes for one output: the encoder's self-attention
    (L x H x S x S), the decoder's (L x H x T x T) and the cross-attention (L x H x T x S)."""
    return m.n_heads * (m.n_layers * src_len * src_len + m.decoder_layers * tgt_len * (tgt_len + src_len))


class Batcher:
    """Collects requests for ``wait_ms`` (up to ``batch_tokens`` source tokens) into one model call per settings."""

    def __init__(self, model: Transformer | Sequence[Transformer], src_tok: Tokenizer, tgt_tok: Tokenizer, *, wait_ms: float = 5.0,
                 batch_tokens: int = 4096, max_queue_sentences: int = 2048):
        self.model, self.src_tok, self.tgt_tok = model, src_tok, tgt_tok
        self.wait_s, self.batch_tokens, self.max_queue = wait_ms / 1000.0, batch_tokens, max_queue_sentences
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._carry: Job | None = None  # collected but over the token limit: first in the next call
        self._lock = threading.Lock()
        self.queued = 0  # sentences submitted and not yet taken by the model
        self.calls = 0  # model calls (one per settings group)
        self.skipped = 0  # requests dropped undecoded (client gone, deadline passed, shutdown)
        self._drain_until: float | None = None  # set by begin_shutdown
        self._thread = threading.Thread(target=self._run, name="aiayn-batcher", daemon=True)

    def start(self) -> "Batcher":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def begin_shutdown(self, drain_s: float) -> None:
        """Refuse new requests (``ShuttingDown``); queued ones are decoded for ``drain_s`` seconds more,
        the rest are answered with ``ShuttingDown``."""
        with self._lock:
            if self._drain_until is None:
                self._drain_until = time.monotonic() + drain_s

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
               prefixes: list[list[int]] | None = None) -> Job:
        """Queue one request; its ``future`` gives a ``Result``. Raises ``Busy`` when the queue is
        full and ``ShuttingDown`` after ``begin_shutdown``."""
        with self._lock:
            if self._drain_until is not None:
                raise ShuttingDown("the service is shutting down; retry on another instance")
            if self.queued + len(ids) > self.max_queue:
                raise Busy(f"{self.queued} sentences are waiting for the model (limit {self.max_queue}); retry later")
            self.queued += len(ids)
        job = Job(cfg, ids, attention, attention_values, deadline, prefixes=prefixes)
        self._queue.put(job)
        return job

    def _live(self, job: Job) -> bool:
        """Whether to decode ``job``; a dropped job is answered (or was cancelled) here."""
        now = time.monotonic()
        if job.abandoned or job.future.cancelled():
            error = None
        elif job.deadline is not None and now > job.deadline:
            error = Expired("the request's deadline passed before the model reached it")
        elif self._drain_until is not None and now > self._drain_until:
            error = ShuttingDown("the service shut down before the model reached this request")
        else:
            return True
        if error is not None and job.future.set_running_or_notify_cancel():
            job.future.set_exception(error)
        self.skipped += 1
        return False

    def _collect(self) -> list[Job] | None:
        """The jobs of the next model call(s); None when stopped."""
        first = self._carry if self._carry is not None else self._queue.get()
        self._carry = None
        if first is None:
            return None
        jobs, tokens = [first], first.n_tokens
        deadline = time.monotonic() + self.wait_s
        while tokens < self.batch_tokens:
            try:
                job = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if job is None:
                self._queue.put(None)  # stop after answering what was collected
                break
            if tokens + job.n_tokens > self.batch_tokens:
                self._carry = job
                break
            jobs.append(job)
            tokens += job.n_tokens
        return jobs

    def _run(self) -> None:
        while (jobs := self._collect()) is not None:
            groups: dict[DecodeConfig, list[Job]] = {}
            dropped = 0
            for job in jobs:
                if self._live(job):
                    groups.setdefault(job.cfg, []).append(job)
                else:
                    dropped += len(job.ids)
            with self._lock:
                self.queued -= dropped
            for cfg, group in groups.items():
                with self._lock:  # (before any answer: a client that has its answer sees itself counted out)
                    self.queued -= sum(len(job.ids) for job in group)
                try:
                    self._answer(cfg, group)
                except Exception as exc:  # noqa: BLE001 -- answer the clients, keep serving
                    log.exception("translation failed for %d requests", len(group))
                    for job in group:
                        if not job.future.done():
                            job.future.set_exception(exc)

    def _answer(self, cfg: DecodeConfig, jobs: list[Job]) -> None:
        """One ``translate_ids`` call for all sentences of ``jobs`` (same settings), then each answer."""
        jobs = [job for job in jobs if job.future.set_running_or_notify_cancel()]  # drop cancelled ones
        if not jobs:
            return
        translator = Translator(self.model, self.src_tok, self.tgt_tok, cfg)
        ids = [x for job in jobs for x in job.ids]
        t0 = time.perf_counter()
        prefixes = [x for job in jobs for x in (job.prefixes or [[]] * len(job.ids))]
        hyps = translator.translate_ids(ids, prefixes if any(prefixes) else None)
        self.calls += 1
        log.debug("%d requests, %d sentences in one call: %.1f ms", len(jobs), len(ids),
                  1000 * (time.perf_counter() - t0))
        start = 0
        for job in jobs:
            mine = hyps[start:start + len(job.ids)]
            nbest = [[Translation(self.tgt_tok.decode(h.tokens), h.tokens, h.score, h.log_prob, h.eos) for h in hs]
                     for hs in mine]
            att = self._attention(translator, job, mine) if job.attention and not job.abandoned else None
            job.future.set_result(Result(nbest, att))
            start += len(job.ids)

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
