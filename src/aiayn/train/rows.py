"""The per-row statistics of §5.4's label-smoothed loss that the plain loss (``objective``) and the
fused one (``fused_loss``) share. Shapes: N rows (target positions), V vocabulary.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class LossSums(NamedTuple):
    loss: Tensor  # sum over non-pad targets of the label-smoothed cross-entropy
    nll: Tensor  # sum of -log p(gold)
    n_tokens: Tensor  # non-pad targets


def acc_dtype(z: Tensor) -> torch.dtype:
    return torch.float64 if z.dtype == torch.float64 else torch.float32


def smoothed_row_losses(log_z: Tensor, sum_z: Tensor, z_gold: Tensor, z_pad: Tensor, eps_ls: float,
                        V: int) -> tuple[Tensor, Tensor]:
    """Per row, from log Z, sum_v z_v, z_gold and z_pad (N,): the loss against ``smoothed_targets``
    and the NLL (N,), padding rows not masked (``_SmoothedCrossEntropy`` says how)."""
    eps_o = eps_ls / (V - 2)
    nll = log_z - z_gold
    return log_z - (1.0 - eps_ls) * z_gold - eps_o * (sum_z - z_gold - z_pad), nll
