"""The k best tokens of each row, as beam search takes them (§6.1's beam of K hypotheses).

``select_topk`` is what every beam step asks of the (N, V) log-probabilities; ``topk_rows`` is
``torch.topk`` along rows, faster where k is small against the row.
"""
from __future__ import annotations

import torch
from torch import Tensor

NEG_INF = float("-inf")


def select_topk(log_probs: Tensor, k: int, banned: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's min(k, V) best tokens, best first, never one of ``banned`` (nb,): values and ids
    (N, k) of log_probs (N, V), whose banned columns are overwritten with -inf."""
    log_probs.index_fill_(1, banned, NEG_INF)
    return topk_rows(log_probs, min(k, log_probs.size(1)))


def topk_rows(x: Tensor, k: int, blocks: int = 16) -> tuple[Tensor, Tensor]:
    """The k largest entries of each row of x (R, M), best first: torch.topk(x, k, dim=1).

    torch.topk selects within every row; beam search asks for k = beam size of M = K * V
    candidates, where one pass over the row does most of the work. The columns are split into
    n = M // blocks interleaved blocks {j, j + n, j + 2n, ...}; one elementwise max over the
    ``blocks`` rows of x viewed as (R, blocks, n) gives each block's maximum (it vectorizes; a
    per-row selection does not). The k largest entries lie in the k blocks with the largest
    maxima: if an entry's block is not among them, those k blocks hold k entries at least as
    large, one each. So the answer is topk over those k * blocks entries and the M - n * blocks
    columns left over. Same values as torch.topk; among exactly equal values the indices may
    differ (torch.topk does not specify them either). Rows too short to gain (n < 4k) use
    torch.topk.
    """
    R, M = x.shape
    n = M // blocks
    if n < 4 * k or not x.is_contiguous():
        return x.topk(k, dim=1)
    block_max = x[:, : n * blocks].view(R, blocks, n).amax(dim=1)  # (R, n)
    top_blocks = block_max.topk(k, dim=1).indices  # (R, k)
    idx = (top_blocks[:, :, None] + n * torch.arange(blocks, device=x.device)).view(R, k * blocks)
    if n * blocks < M:
        idx = torch.cat([idx, torch.arange(n * blocks, M, device=x.device).expand(R, -1)], dim=1)
    values, pos = x.gather(1, idx).topk(k, dim=1)
    return values, idx.gather(1, pos)
