"""The training step's parts, called by hand: the loop's forward and backward passes
(``TrainStep.passes``) of one process, without the C kernels or padded rows, and its numbers read."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from aiayn.checkpoint.run import Learner
from aiayn.train.fused_loss import fused_loss_on
from aiayn.train.loss import SmoothedLoss
from aiayn.train.parallel import OneProcess
from aiayn.train.runtime import Dist, Place
from aiayn.train.step import TrainStep


def passes(model, batches: list, t, scale, device: torch.device, precision: str) -> tuple[torch.Tensor, float]:
    """(3,) loss, NLL and KL sums on the device and the counted FLOPs of ``batches``, each batch's
    objective times ``scale``, gradients accumulated in ``model`` (``t``: its ``TrainConfig``)."""
    place = Place(Dist(), device, precision)
    loss = SmoothedLoss(t.eps_ls, model.cfg.pad_id, None, fused_loss_on(t.fused_loss, device))
    no_optimizer = SimpleNamespace(defaults={})  # the passes take no step (and build no optimizer, which imports triton)
    stepper = TrainStep(Learner(model, no_optimizer), loss, OneProcess(place), None)
    return stepper.passes(batches, scale)


def read_step(sums: torch.Tensor, norm: torch.Tensor | None, local_tokens: float, device: torch.device,
              clock_s: float = 0.0, flops: float = 0.0) -> tuple[float, ...]:
    """One process's numbers of a step on the host: (loss, nll, kl, tokens, clock, norm, flops)."""
    ranks = OneProcess(Place(Dist(), device, "fp32"))
    r = ranks.read(ranks.numbers(sums, norm, None, clock_s, flops), local_tokens, clock_s, flops)
    return r.loss, r.nll, r.kl, r.tokens, clock_s, r.norm, r.flops
