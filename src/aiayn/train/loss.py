"""The loss a training step takes over one batch: §5.4's label-smoothed cross-entropy
(``SmoothedLoss``) and R-Drop (Liang et al., 2021; ``train.rdrop_alpha``), a wrapper of it that
feeds each batch twice, through two dropout masks, and adds the symmetric KL of the two passes.

Each returns ``Terms``: the objective that backward takes (a sum over the batch's target tokens;
the step scales it by 1 / (``passes`` x the step's tokens)) and the batch's (3,) float64 sums per
pass (loss, NLL, KL), which stay on the device. Shapes: B batch, S source, T target length.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from aiayn.train import runtime as rt
from aiayn.train.fused_loss import autocast_inputs
from aiayn.train.objective import label_smoothed_loss, rdrop_kl


class Terms(NamedTuple):
    objective: torch.Tensor  # what backward takes, before the step's scale
    sums: torch.Tensor  # (3,) float64: loss, NLL and KL sums of the batch, per pass


def twice(x: torch.Tensor) -> torch.Tensor:
    """A batch stacked on itself along B (R-Drop's two passes in one forward): (B,...) -> (2B,...)."""
    return torch.cat([x, x])


class SmoothedLoss:
    """§5.4: the label-smoothed cross-entropy of a batch, summed over its target tokens. ``fused``
    (``train.fused_loss``): the net returns the projection's inputs and the loss takes the logits a
    chunk of rows at a time (``aiayn.train.fused_loss``); ``kernels``: the C kernels of the CPU, or None."""

    passes = 1  # forward passes per batch
    kl_logged = False

    def __init__(self, eps_ls: float, pad_id: int, kernels=None, fused: bool = False):
        self.eps_ls, self.pad_id, self.kernels, self.fused = eps_ls, pad_id, kernels, fused

    def sums(self, logits, target: torch.Tensor):
        """``label_smoothed_loss`` of ``logits`` (B,T,V) against ``target`` (B,T)."""
        return label_smoothed_loss(logits, target, self.eps_ls, self.pad_id, self.kernels)

    def __call__(self, net, b, place: rt.Place) -> Terms:
        with rt.autocast(place.device, place.precision):
            logits = net(b.src, b.tgt_in, project=not self.fused, src_padded=b.src_padded)  # (B,T,V), or PreSoftmax
            logits = autocast_inputs(logits) if self.fused else logits
        sums = self.sums(logits, b.tgt_out)
        zero = torch.zeros((), dtype=torch.float64, device=place.device)
        return Terms(sums.loss, torch.stack([sums.loss.detach().double(), sums.nll.detach().double(), zero]))


class RDrop:
    """R-Drop around ``inner``: the batch stacked twice (one forward of 2B rows, each half its own
    dropout mask), the two passes' losses plus ``alpha`` times their symmetric KL (``rdrop_kl``,
    over the non-pad positions). Needs the logits, so never fused. The sums are per pass."""

    passes = 2
    kl_logged = True

    def __init__(self, inner: SmoothedLoss, alpha: float):
        self.inner, self.alpha, self.kernels = inner, alpha, inner.kernels

    def __call__(self, net, b, place: rt.Place) -> Terms:
        with rt.autocast(place.device, place.precision):
            logits = net(twice(b.src), twice(b.tgt_in), project=True, src_padded=b.src_padded)  # (2B,T,V)
        sums = self.inner.sums(logits, twice(b.tgt_out))
        kl = rdrop_kl(logits, b.tgt_out, self.inner.pad_id)
        objective = sums.loss + self.alpha * kl
        return Terms(objective, torch.stack([sums.loss.detach().double() / 2, sums.nll.detach().double() / 2,
                                             kl.detach().double()]))


def make_loss(eps_ls: float, pad_id: int, kernels, fused: bool, rdrop_alpha: float) -> SmoothedLoss | RDrop:
    """§5.4's loss (``train.eps_ls``), wrapped by R-Drop where ``rdrop_alpha`` > 0 (``train.rdrop_alpha``)."""
    loss = SmoothedLoss(eps_ls, pad_id, kernels, fused)
    return RDrop(loss, rdrop_alpha) if rdrop_alpha > 0 else loss
