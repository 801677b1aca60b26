"""The optimizer's update of one step (§5.3): the accumulated gradients' norm, clipped to
``train.clip_norm``, the update taken after the step's numbers are read, or queued before the read
with a device flag that skips it where the step is not finite (fused Adam), and fp16's loss scaler.
"""
from __future__ import annotations

import torch

from aiayn.checkpoint.run import Learner


def update_early(opt, scaler) -> bool:
    """Whether a step's update is queued before its numbers are read (the device then goes on while the
    host reads them): with fused Adam, which takes a device flag that skips its step (``update``'s
    ``skip``); not under fp16's scaler, which has its own."""
    return scaler is None and bool(opt.defaults.get("fused"))


def grad_norm(params: list[torch.Tensor], scaler=None, opt=None) -> torch.Tensor:
    """The accumulated gradients' total 2-norm of ``params`` (``Learner.params``) as a device scalar
    (not read here). Under fp16's loss scaling, of the gradients unscaled first (``scaler.unscale_``
    of ``opt``): inf or NaN where they overflowed, a step whose update the scaler skips."""
    if scaler is not None:
        scaler.unscale_(opt)
    return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])


def update(learner: Learner, clip_norm: float, norm: torch.Tensor | None = None,
           skip: torch.Tensor | None = None) -> None:
    """The optimizer step on the accumulated gradients (under fp16's loss scaling, unscaled by ``grad_norm``
    where ``norm`` is given, else here), clipped to ``clip_norm`` if > 0, then the gradients cleared.
    ``skip`` (fused Adam, no scaler): a float32 flag on the device, 1 = leave the parameters, Adam's
    moments and step count as they are (the fused step's ``found_inf``): the update is queued unread."""
    opt, scaler = learner.opt, learner.scaler
    if scaler is not None and norm is None:
        scaler.unscale_(opt)
    if clip_norm > 0:
        if norm is None:
            torch.nn.utils.clip_grad_norm_(learner.params, clip_norm)
        else:
            torch.nn.utils.clip_grads_with_norm_(learner.params, clip_norm, norm)
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    elif skip is not None:
        if not opt.defaults.get("fused"):
            raise ValueError("update: skip needs a fused optimizer")
        opt.found_inf = skip
        try:
            opt.step()
        finally:
            del opt.found_inf
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)


def not_finite(numbers: torch.Tensor) -> torch.Tensor:
    """``update``'s ``skip`` flag for a step's (7,) numbers (``parallel.pack``): 1.0 where the loss + KL
    or the gradient norm is not finite, the test the host takes after the read."""
    return (~(torch.isfinite(numbers[0] + numbers[2]) & torch.isfinite(numbers[5]))).float()
