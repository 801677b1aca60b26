"""The exponential moving average of the weights (``train.ema_decay``): ema = d * ema + (1 - d) *
weights after every update, validated instead of the raw weights and written to ``ema.pt``. The
paper averages checkpoints instead (§6.1, ``aiayn average``).
"""
from __future__ import annotations

import contextlib

import torch


class WeightAverage:
    """A float32 copy of ``model``'s parameters, averaged with decay ``ema_decay``; it starts from
    ``saved`` (a state dict of the model, as ``state_dict`` gives it) where that holds a parameter,
    else from the weights now."""

    def __init__(self, model: torch.nn.Module, ema_decay: float, device: torch.device, saved: dict | None = None):
        self.model, self.decay = model, ema_decay
        saved = saved or {}
        self.ema = [saved[k].to(device, torch.float32) if k in saved else p.detach().float().clone()
                    for k, p in model.named_parameters()]

    def update(self) -> None:
        """ema <- d * ema + (1 - d) * weights, after an update (one fused call over all parameters)."""
        params = [p.detach().float() for p in self.model.parameters()]
        torch._foreach_lerp_(self.ema, params, 1.0 - self.decay)

    def state_dict(self) -> dict:
        """The moving average as a state dict of the model (its buffers as they are)."""
        names = [k for k, _ in self.model.named_parameters()]
        out = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        out.update({k: e.detach().to("cpu", out[k].dtype).clone() for k, e in zip(names, self.ema)})
        return out

    @contextlib.contextmanager
    def weights(self):
        """The model holds the moving average inside the block (validation), its own weights after."""
        params = list(self.model.parameters())
        kept = [p.detach().clone() for p in params]
        with torch.no_grad():
            torch._foreach_copy_(params, [e.to(p.dtype) for e, p in zip(self.ema, params)])
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(params, kept)
