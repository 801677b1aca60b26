"""The batching worker's queue, fair between clients: FIFO per client, clients take turns.

A client is a peer address (``Job.client``). Each client's requests wait in arrival order;
the clients with waiting work form a ring. A turn hands the model the next sentences of the
first client's first request, up to a share of the model call's tokens; then that client goes
to the back of the ring. So a client that queues many or long requests gets its turns like any
other, and one long request is decoded over several model calls (``Part``), the sentences of
other clients' requests in between. A client with a model call in progress is passed over and
keeps its place (``head(busy)``), so that with several calls at once no client holds two.
(Round-robin with a quantum, as deficit round-robin (Shreedhar & Varghese 1995) has, counted
in tokens; no deficit is carried over: a turn whose next sentence is over its share still takes
that one sentence.)
"""
from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Container

from aiayn.serve.job import Job


@dataclass(eq=False)
class Part:
    """Sentences ``start:end`` of a job, decoded in one model call."""

    job: "Job"
    start: int
    end: int

    @property
    def ids(self) -> list[list[int]]:
        return self.job.ids[self.start:self.end]

    @property
    def prefixes(self) -> list[list[int]]:
        return (self.job.prefixes or [[]] * len(self.job.ids))[self.start:self.end]

    @property
    def n_tokens(self) -> int:
        return sum(self.job.costs[self.start:self.end])


class FairQueue:
    """Jobs waiting for the model, FIFO per client, clients in a ring (module docstring). Counts the
    sentences and tokens not yet handed to the model, in all and per client. Not thread-safe: the
    ``Batcher`` holds its lock around every call."""

    def __init__(self) -> None:
        self._ring: OrderedDict[str, deque[Job]] = OrderedDict()  # clients with waiting work, next turn first
        self.sentences = 0
        self.tokens = 0
        self.per_client: Counter[str] = Counter()

    def __bool__(self) -> bool:
        return bool(self._ring)

    @property
    def clients(self) -> int:
        """Clients with waiting work."""
        return len(self._ring)

    def push(self, job: "Job") -> None:
        self._ring.setdefault(job.client, deque()).append(job)
        self._count(job, len(job.ids), sum(job.costs))

    def head(self, busy: Container[str] = ()) -> "Job | None":
        """The first job of the client whose turn it is, passing over ``busy`` clients (they keep their
        place); None when nothing else waits."""
        return next((jobs[0] for client, jobs in self._ring.items() if client not in busy), None)

    def take(self, job: "Job", end: int) -> Part:
        """Sentences of ``job`` (a ``head``) from its first not yet taken up to ``end``; its client's
        turn ends."""
        client = job.client
        part = Part(job, job.next, end)
        job.next = end
        self._count(job, -(end - part.start), -part.n_tokens)
        if end == len(job.ids):
            self._ring[client].popleft()
        if self._ring[client]:
            self._ring.move_to_end(client)
        else:
            del self._ring[client]
        return part

    def drop(self, job: "Job") -> None:
        """Remove ``job`` (a ``head``) with its sentences not yet taken; its client keeps its turn."""
        client = job.client
        self._ring[client].popleft()
        if not self._ring[client]:
            del self._ring[client]
        self._count(job, -(len(job.ids) - job.next), -sum(job.costs[job.next:]))

    def clear(self) -> list["Job"]:
        """Remove every waiting job (the service stops at once); the jobs removed."""
        jobs = [job for waiting in self._ring.values() for job in waiting]
        self._ring.clear()
        self.sentences = self.tokens = 0
        self.per_client.clear()
        return jobs

    def _count(self, job: "Job", sentences: int, tokens: int) -> None:
        self.sentences += sentences
        self.tokens += tokens
        self.per_client[job.client] += sentences
        if not self.per_client[job.client]:
            del self.per_client[job.client]


def turn_end(costs: list[int], start: int, share: int, room: int, first: bool) -> int:
    """Where a turn that begins at sentence ``start`` ends: the sentences whose tokens fit both the
    client's ``share`` and the call's ``room``; at least one if it fits ``room``, or if the call is
    still empty (``first``: a sentence over the whole budget is decoded alone)."""
    end, spent = start, 0
    limit = min(share, room)
    while end < len(costs) and spent + costs[end] <= limit:
        spent += costs[end]
        end += 1
    if end == start < len(costs) and (costs[start] <= room or first):
        end += 1
    return end
