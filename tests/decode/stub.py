"""A stub decoder for search tests: next-token probabilities come from hand-written tables.

``tables[key][prefix] = {token: prob}``: key is the sentence's first source token, prefix the
tuple of generated tokens so far (BOS excluded). Unlisted tokens have probability 0; unlisted
prefixes use ``default`` (else uniform; or, with ``random_vocab``, a pseudo-random distribution that depends
only on key and prefix). Records the number of rows of every step call.
"""
from __future__ import annotations

import math
import zlib

import torch

from tests.arith import gamma

PAD, UNK, BOS, EOS = 0, 1, 2, 3


def table_value(got: float, exact: float, n: int) -> bool:
    """A score or log-probability of a table's hypothesis of n tokens against its exact value: each
    float32 log-probability rounded once (u of it), their sum (γ_{n-1} of the sum of their magnitudes,
    which is |the sum|: all <= 0), the division by the penalty (u, and the penalty's own u):
    γ_{n+3} of |exact|."""
    return abs(got - exact) <= float(gamma(n + 3)) * abs(exact)


class TableState:
    def __init__(self, keys: list[int], prefixes: list[tuple[int, ...]]):
        self.keys = keys
        self.prefixes = prefixes

    def reorder(self, idx: torch.Tensor) -> "TableState":
        ix = idx.tolist()
        return TableState([self.keys[i] for i in ix], [self.prefixes[i] for i in ix])


class TableDecoder:
    def __init__(self, tables=None, V: int = 8, default=None, random_vocab: bool = False,
                 dtype=torch.float32):
        self.tables = tables or {}
        self.V = V
        self.default = default
        self.random_vocab = random_vocab
        self.dtype = dtype
        self.rows_per_step: list[int] = []
        self.max_len_seen: int | None = None

    def start(self, src: torch.Tensor, max_len: int) -> TableState:
        self.max_len_seen = max_len
        return TableState(src[:, 0].tolist(), [None] * src.size(0))

    def step(self, tokens: torch.Tensor, state: TableState):
        self.rows_per_step.append(tokens.numel())
        prefixes = [() if p is None else p + (t,) for p, t in zip(state.prefixes, tokens.tolist())]
        rows = [self._log_probs(k, p) for k, p in zip(state.keys, prefixes)]
        return torch.stack(rows), TableState(state.keys, prefixes)

    def _log_probs(self, key: int, prefix: tuple[int, ...]) -> torch.Tensor:
        table = self.tables.get(key, {}).get(prefix)
        if table is None and self.random_vocab:
            return self._random(key, prefix)
        table = table if table is not None else self.default
        if table is None:  # rows of dead beam slots (after EOS, or -inf candidates): anything goes
            return torch.full((self.V,), -math.log(self.V), dtype=self.dtype)
        p = torch.zeros(self.V, dtype=torch.float64)
        for tok, prob in table.items():
            p[tok] = prob
        return p.log().to(self.dtype)

    def _random(self, key: int, prefix: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(zlib.crc32(repr((key, prefix)).encode()))
        logits = 2.0 * torch.randn(self.V, generator=g, dtype=torch.float64)
        logits[[PAD, UNK, BOS]] = float("-inf")
        logits[EOS] += 0.4 * len(prefix) - 1.0  # EOS grows likelier with length
        return logits.log_softmax(0).to(self.dtype)
