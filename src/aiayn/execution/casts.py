"""The linear maps' weights cast to autocast's dtype once per forward, in one batched copy.

Under bf16 (or fp16) autocast every ``F.linear`` casts its float32 weight and bias at its use: one
cast operation per tensor in the forward and one cast of its gradient back in the backward, each
dispatched, recorded and launched on its own (the GPU demo's small model issues hundreds a step, a
host cost while the device waits: BENCHMARKS.md §7, ``bench/host_step.py``). ``WeightCasts`` makes
the same casts for all the maps at the start of the model's forward, as one ``_foreach_copy_``, and
the gradients' casts back as one more; the maps (``linear.RowPaddedLinear``) take the cast tensors,
which autocast passes through as they are. The numbers are autocast's: the same round-to-nearest
cast of each weight, the same bf16 products, each weight's bf16 gradient summed over its uses before
the one cast back to float32, as autocast's cached cast sums them. The tied embedding, which its
lookups use in float32, keeps autocast's own cast (``train.cast_weights_once``).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn


class _CastAll(torch.autograd.Function):
    """float32 tensors -> copies in ``dtype`` (one batched copy); gradients back in each input's dtype."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.dtypes = [t.dtype for t in tensors]
        out = [torch.empty_like(t, dtype=dtype) for t in tensors]
        torch._foreach_copy_(out, list(tensors))
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        have = [i for i, g in enumerate(grads) if g is not None]
        back = [torch.empty_like(grads[i], dtype=ctx.dtypes[i]) for i in have]
        if back:
            torch._foreach_copy_(back, [grads[i] for i in have])
        out: list[Tensor | None] = [None] * len(grads)
        for i, g in zip(have, back):
            out[i] = g
        return (None, *out)


class WeightCasts:
    """The weights and biases of ``maps`` (modules with ``weight`` and ``bias``), cast once at each
    forward of the model under autocast (``attach``), looked up by the maps (``get``)."""

    def __init__(self, maps: list[nn.Module]):
        self.tensors = [t for m in maps for t in (m.weight, m.bias) if t is not None]
        self.cast: dict[int, Tensor] | None = None  # id(float32 tensor) -> its cast, during a forward

    def attach(self, model: nn.Module) -> list:
        """Hooks on ``model``'s forward: the casts made before it, dropped after it (the autograd graph
        keeps what its backward needs). Returns the hooks' handles."""
        return [model.register_forward_pre_hook(self._before), model.register_forward_hook(self._after)]

    def _before(self, module: nn.Module, args) -> None:
        device = self.tensors[0].device.type if self.tensors else "cpu"
        if not self.tensors or not torch.is_autocast_enabled(device):
            self.cast = None
            return
        dtype = torch.get_autocast_dtype(device)
        self.cast = dict(zip(map(id, self.tensors), _CastAll.apply(dtype, *self.tensors)))

    def _after(self, module: nn.Module, args, output) -> None:
        self.cast = None

    def get(self, t: Tensor | None) -> Tensor | None:
        """``t``'s cast in this forward, or ``t`` itself (no forward under autocast, or not one of them)."""
        if t is None or self.cast is None:
            return t
        return self.cast.get(id(t), t)
