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

    logits (B,T,V), target (B,T). Computed without materializing q:
    loss = -(1-eps) log p_gold - eps/(V-2) (sum_v log p_v - log p_gold - log p_pad).
    One fused log-softmax over all positions (upcast to float32 inside the kernel under
    autocast); padding positions are masked on the (N,) vectors. Measured 2x faster than a
    logsumexp formulation that first gathers the real positions (bench notes in BENCHMARKS.md).
    """
    V = logits.size(-1)
    z = logits.reshape(-1, V)  # (N,V)
    tgt = target.reshape(-1)
    keep = tgt.ne(pad_id)
    up = torch.float32 if z.dtype in (torch.bfloat16, torch.float16) else None
    lprobs = torch.log_softmax(z, dim=-1, dtype=up)  # (N,V)
    gold = lprobs.gather(1, tgt.unsqueeze(1)).squeeze(1)  # (N,) log p_gold
    nll = -gold
    if eps_ls > 0:
        others = lprobs.sum(-1) - gold - lprobs[:, pad_id]
        loss = (1.0 - eps_ls) * nll - eps_ls / (V - 2) * others
    else:
        loss = nll
    zero = loss.new_zeros(())
    return LossSums(torch.where(keep, loss, zero).sum(), torch.where(keep, nll, zero).sum(), keep.sum())
