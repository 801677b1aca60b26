"""The learning rate of Eq. 3 and the label-smoothed loss of §5.4.

Shapes: B batch, T target length, V vocabulary.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


def noam_lr(step: int, d_model: int, warmup_steps: int, scale: float = 1.0) -> float:
    """Eq. 3: lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5), times ``scale``.

    ``step`` counts optimizer steps from 1 (step 0 is treated as step 1).
    """
    step = max(step, 1)
    return scale * d_model ** -0.5 * min(step ** -0.5, step * warmup_steps ** -1.5)


class LossSums(NamedTuple):
    loss: Tensor  # sum over non-pad targets of the label-smoothed cross-entropy
    nll: Tensor  # sum of -log p(gold)
    n_tokens: Tensor  # non-pad targets


def smoothed_targets(target: Tensor, vocab_size: int, eps_ls: float, pad_id: int) -> Tensor:
    """The label-smoothed target distribution q (the Annotated Transformer's picture).

    Convention: the gold token gets 1 - eps_ls; eps_ls is spread evenly over the V - 2 other
    tokens that are neither the gold token nor padding; the padding token gets 0; rows whose
    target is padding are all zero (they contribute no loss). target (N,) -> q (N,V).
    """
    q = torch.full((target.numel(), vocab_size), eps_ls / (vocab_size - 2), dtype=torch.float64)
    q.scatter_(1, target.view(-1, 1), 1.0 - eps_ls)
    q[:, pad_id] = 0.0
    q[target.view(-1) == pad_id] = 0.0
    return q


def label_smoothed_loss(logits: Tensor, target: Tensor, eps_ls: float, pad_id: int) -> LossSums:
    """Cross-entropy against ``smoothed_targets`` (§5.4), summed over non-pad positions.

    logits (B,T,V), target (B,T). Computed without materializing q or the (N,V) log-softmax:
    with log p_v = z_v - logsumexp(z),
    loss = -(1-eps) log p_gold - eps/(V-2) (sum_v log p_v - log p_gold - log p_pad).
    Padding positions are dropped before the vocabulary-sized work; it runs in float32 even
    under autocast.
    """
    V = logits.size(-1)
    tgt = target.reshape(-1)
    keep = tgt.ne(pad_id)
    z = logits.reshape(-1, V)[keep].float()  # (N,V) real positions only
    tgt = tgt[keep]
    lse = torch.logsumexp(z, dim=-1)  # (N,)
    gold = z.gather(1, tgt.unsqueeze(1)).squeeze(1) - lse  # log p_gold
    nll = -gold.sum()
    if eps_ls > 0:
        others = (z.sum(-1) - V * lse) - gold - (z[:, pad_id] - lse)
        loss = (1.0 - eps_ls) * nll - eps_ls / (V - 2) * others.sum()
    else:
        loss = nll
    return LossSums(loss, nll, keep.sum())
