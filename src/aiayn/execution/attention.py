"""How a run computes Eq. 1 (``aiayn.model.attention.ScaledDotProductAttention``), put in its place by
``aiayn.execution.apply``:

- on the CPU, with the C kernels (``train.c_kernels``), ``KernelAttention``: forward and backward in
  ``aiayn/kernels/seq_attention.c``, float32 arithmetic on float32 or bfloat16 heads, as the fused path
  does under autocast with ``attn_fp32``; not with attention dropout or weights asked for;
- on the CPU under bf16 autocast with ``attn_fp32``, Eq. 1 in float32;
- on CUDA, the source key mask made additive once for every layer (``additive_key_mask``);
- ``attention_backends``: which of PyTorch's fused kernels CUDA may take.

``tests/execution/test_attention.py`` checks they agree with the model's own attention.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from aiayn.model.attention import ScaledDotProductAttention


def additive_key_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean key mask (B,1,1,S) (True = may attend) as an additive one in ``dtype`` (0, or -inf where
    not), what the fused attention makes of a boolean mask at every call, here made once. Its rows are
    laid out 16 entries apart, as the memory-efficient kernel wants them (it pads a copy at every call
    otherwise)."""
    B, S = mask.size(0), mask.size(-1)
    rows = torch.zeros(B, -(-S // 16) * 16, dtype=dtype, device=mask.device)
    rows[:, :S].masked_fill_(~mask.reshape(B, S), float("-inf"))
    return rows[:, None, None, :S]


def attention_backends(device: torch.device, cudnn: bool = False):
    """A context in which Eq. 1's fused kernels (``attention_fast``) on CUDA are flash, memory-efficient
    or PyTorch's math, and cuDNN's only with ``cudnn``. cuDNN builds an execution plan for every new
    shape: a decoding step's shapes are new at nearly every step (one more key, fewer live rows), a
    training step's at nearly every length-bucketed batch, and in bf16/fp16 on Hopper, where PyTorch
    prefers cuDNN, the time went to building plans. Elsewhere, or with ``cudnn``, nothing changes."""
    if device.type != "cuda" or cudnn:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


class _KernelAttention(torch.autograd.Function):
    """Eq. 1 through the C kernels (``Kernels.seq_attention_forward`` / ``_backward``): q (B,H,T,K),
    k (B,H,S,K), v (B,H,S,Dv) -> (B,T,H*Dv), the heads concatenated, in q's dtype. The backward
    recomputes the weights from the saved log-normalizers (B,H,T) instead of keeping them."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, kernels) -> Tensor:
        out, lse = kernels.seq_attention_forward(q, k, v, mask, causal)
        ctx.save_for_backward(q, k, v, lse)
        ctx.mask, ctx.causal, ctx.kernels = mask, causal, kernels
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        q, k, v, lse = ctx.saved_tensors
        dq, dk, dv = ctx.kernels.seq_attention_backward(q, k, v, ctx.mask, ctx.causal, lse, g)
        return dq, dk, dv, None, None, None


class _LastMask:
    """The additive form of the last boolean key mask seen, shared by every layer of a model: the
    model makes one source mask per forward (or decoding step) for all its layers."""

    def __init__(self):
        self.last: tuple[Tensor, Tensor] | None = None

    def __call__(self, mask: Tensor, dtype: torch.dtype) -> Tensor:
        if self.last is None or self.last[0] is not mask or self.last[1].dtype != dtype:
            self.last = (mask, additive_key_mask(mask, dtype))
        return self.last[1]


class ExecutedAttention(ScaledDotProductAttention):
    """Eq. 1 as the run computes it (module docstring): ``kernels`` (``aiayn.kernels.loader.Kernels``)
    where they apply, else in float32 under autocast with ``attn_fp32``, else the model's own."""

    def __init__(self, p_drop_attn: float, kernels=None, attn_fp32: bool = False, masks: _LastMask | None = None):
        super().__init__(p_drop_attn)
        self.kernels, self.attn_fp32 = kernels, attn_fp32
        self.masks = masks if masks is not None else _LastMask()

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool = False,
                need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        if self._use_kernels(q, k, v, mask, need_weights):
            return _KernelAttention.apply(q, k, v, mask, is_causal, self.kernels), None
        if self._additive(mask, need_weights):
            kind = q.device.type
            mask = self.masks(mask, torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else q.dtype)
        if self._upcast(q):
            # Same math in float32: on CPU the bf16 attention backward is several times slower,
            # and the softmax is safer. The projections around it stay in reduced precision.
            with torch.autocast(q.device.type, enabled=False):
                out, weights = super().forward(q.float(), k.float(), v.float(), mask, is_causal, need_weights)
            return out.to(q.dtype), weights
        return super().forward(q, k, v, mask, is_causal, need_weights)

    @staticmethod
    def _additive(mask: Tensor | None, need_weights: bool) -> bool:
        """A boolean source key mask (B,1,1,S) on CUDA, weights not asked for: made additive."""
        return (mask is not None and mask.dtype == torch.bool and mask.device.type == "cuda" and not need_weights
                and mask.dim() == 4 and mask.size(1) == 1 and mask.size(2) == 1)

    def _upcast(self, q: Tensor) -> bool:
        """Whether Eq. 1 runs in float32 under autocast (``attn_fp32``). Not on CUDA: there the fused
        flash and memory-efficient kernels keep the softmax's running max and sum in float32 while
        reading bf16/fp16 heads, so the upcast would only trade them for the slower float32 kernel."""
        return (self.attn_fp32 and q.device.type != "cuda" and torch.is_autocast_enabled(q.device.type)
                and q.dtype != torch.float32)

    def _use_kernels(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, need_weights: bool) -> bool:
        """The C kernels' cases: given kernels with a fast path for these heads, no weights asked for, no
        attention dropout in play, float32 arithmetic wanted (it is theirs), and tensors they handle
        (``Kernels.supports_heads``)."""
        if self.kernels is None or need_weights or (self.training and self.p_drop_attn > 0):
            return False
        if not self.kernels.seq_attention_fast(q.size(-1), v.size(-1)):
            return False
        if not self.attn_fp32 and (q.dtype != torch.float32 or torch.is_autocast_enabled(q.device.type)):
            return False
        return self.kernels.supports_heads(q, k, v, mask)
