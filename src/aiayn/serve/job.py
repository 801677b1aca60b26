"""A request as the batching workers hold it (``Job``): its sentences' ids, what each costs of a
model call (``max_output_tokens``), how far it is decoded, and the ``Future`` that answers it
with a ``Result``. Shared by the workers (batcher.py) and their fair queue (fair.py)."""
from __future__ import annotations

import math
from concurrent.futures import Future
from dataclasses import dataclass, field

from aiayn.decode.config import DecodeConfig
from aiayn.decode.translator import Translation


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
    client: str = ""  # the client's address: its place in the fair queue
    future: Future = field(default_factory=Future)
    costs: list[int] = field(init=False)  # per sentence: what it spends of a model call's batch_tokens
    next: int = field(default=0, init=False)  # sentences handed to the model so far
    hyps: list = field(init=False)  # per sentence: its hypotheses, once its model call has ended
    decoded: int = field(default=0, init=False)
    started: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        prefixes = self.prefixes or [[]] * len(self.ids)
        self.costs = [len(x) + max_output_tokens(self.cfg, len(x), len(p)) if x else 0
                      for x, p in zip(self.ids, prefixes)]
        self.hyps = [None] * len(self.ids)

    def abandon(self) -> None:
        """The client will not read the answer: drop the job if it has not started (and the rest of
        it if it has)."""
        self.abandoned = True
        self.future.cancel()

    @property
    def n_tokens(self) -> int:
        """What the job spends of a model call's ``batch_tokens``: every sentence's source tokens
        plus the most output tokens its search may produce (``max_output_tokens``)."""
        return sum(self.costs)

    def begin(self) -> bool:
        """Whether a model call should decode the job's next sentences (False: cancelled, left by its
        client after it started, or answered already); the first call marks its future running. (A
        future takes ``set_running_or_notify_cancel`` once when cancelled: a second call raises, and
        one call may hold two parts of a job whose client left after they were taken.)"""
        if self.started:
            return not (self.abandoned or self.future.done())
        if self.future.cancelled():
            return False
        self.started = self.future.set_running_or_notify_cancel()
        return self.started

    def fail(self, exc: BaseException) -> None:
        """Answer with ``exc``, unless the job was answered or cancelled already."""
        if not self.started:
            if self.future.cancelled() or not self.future.set_running_or_notify_cancel():
                return
            self.started = True
        if not self.future.done():
            self.future.set_exception(exc)


def max_output_tokens(cfg: DecodeConfig, src_len: int, prefix_len: int = 0) -> int:
    """The search's output limit for a source of ``src_len`` tokens (EOS included): floor(a * |x| + b),
    at least 1, raised to a forced prefix's length + 1 (``aiayn.decode.search.max_output_lengths``)."""
    return max(1, math.floor(cfg.max_len_a * src_len + cfg.max_len_b), prefix_len + 1)
