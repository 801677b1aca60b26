"""No repeated n-grams in an output (not in the paper; fairseq's, CTranslate2's and transformers'
``no_repeat_ngram_size``; ``DecodeConfig.no_repeat_ngram``).

A hypothesis y_1 .. y_L may not take next a token y_{i+n-1} whose window y_i .. y_{i+n-2} equals its
last n - 1 tokens y_{L-n+2} .. y_L (i <= L - n + 1): the n-gram y_i .. y_{i+n-1} would occur twice.
(With n = 1 the window is empty: no token occurs twice.) The search's BOS never counts: it is never
generated, so no later window can equal one that holds it.

All rows at once, with no value read back to the host: compare each row's suffix with every
earlier window (R, L - n + 1, n - 1), then write -inf at the tokens that follow the windows that
match. A step costs O(R * L * n), nothing (R, V)-sized besides the write.
"""
from __future__ import annotations

from torch import Tensor

NEG_INF = float("-inf")


def ban_repeated_ngrams(log_probs: Tensor, history: Tensor, n: int, sink: int,
                        exempt: Tensor | None = None) -> Tensor:
    """log_probs (R, V) with -inf (in place) at every token that would complete an n-gram that its
    row of ``history`` (R, L), the tokens generated so far, already holds; n = 0 bans nothing.

    ``sink``: a token whose log-prob is -inf anyway (the search's pad): the windows that do not
    match write their -inf there, so that every row writes the same number of entries and none is
    selected on the host. ``exempt`` (R,) bool: rows left alone (a forced token comes next).
    """
    R, L = history.shape
    if n < 1 or L < n:  # no earlier n-gram yet
        return log_probs
    windows = history.unfold(1, n - 1, 1)[:, : L - n + 1]  # (R, L-n+1, n-1): y_i .. y_{i+n-2}
    suffix = history[:, L - n + 1:]  # (R, n-1): y_{L-n+2} .. y_L
    match = (windows == suffix[:, None, :]).all(dim=2)  # (R, L-n+1)
    if exempt is not None:
        match &= ~exempt[:, None]
    follow = history[:, n - 1:]  # (R, L-n+1): y_{i+n-1}, the token after window i
    return log_probs.scatter_(1, follow.masked_fill(~match, sink), NEG_INF)
