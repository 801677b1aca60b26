"""§5.4's label-smoothed loss fused with the pre-softmax projection of §3.4 (``train.fused_loss``).

The plain path takes the logits z = h W^T (N,V) whole, then the loss over them, and writes their
gradient (N,V) in backward: 25,000 target tokens x 37,000 types is 1.9 GB in bf16, written and read
several times per step. Here the rows go in chunks (``_CHUNK_ELEMENTS``): per chunk, its logits
z_c = h_c W^T (c,V) by one matmul; the loss of its rows and d loss / d z_c = softmax(z_c) - q written
over z_c in place (``aiayn.kernels.triton_loss`` on CUDA, ``torch_rows`` elsewhere); then
  grad_h_c = dz_c W          grad_W += dz_c^T h_c
So the gradients are complete when forward ends (the chunks are not kept), and backward only
multiplies them by the loss's incoming gradient (a scalar). Only one chunk of logits exists at a
time; the logits are never stored nor computed twice (the approach of Liger-Kernel's fused linear
cross-entropy, whose smoothing, PyTorch's, gives the gold token 1 - eps + eps/V and padding eps/V,
so it cannot take §5.4's q of ``smoothed_targets``).

Each chunk's logits are taken in the dtype the plain projection would use (``autocast_inputs``:
bf16 under bf16 autocast), their statistics in float32 as in ``objective._SmoothedCrossEntropy``, and
grad_W accumulates in float32 over the chunks; the sums and gradients equal the plain path's up to
rounding (tests/train/test_fused_loss.py; tests/gpu/test_fused_loss.py on CUDA).
"""
from __future__ import annotations

import functools
import logging
from typing import Callable

import torch
from torch import Tensor

from aiayn.model.transformer import PreSoftmax
from aiayn.train.rows import LossSums, acc_dtype, smoothed_row_losses

log = logging.getLogger(__name__)

_CHUNK_ELEMENTS = 2 ** 26  # logits per chunk: 128 MiB in bf16; 1,813 rows at V = 37,000

Rows = Callable[[Tensor, Tensor, float, int, Tensor, Tensor, bool], None]


@functools.lru_cache(maxsize=None)
def triton_rows() -> Rows | None:
    """The Triton kernel's entry (``aiayn.kernels.triton_loss.smoothed_ce_rows``), or None where
    triton does not import (said once)."""
    try:
        from aiayn.kernels import triton_loss
    except ImportError as exc:
        log.info("train.fused_loss: triton unavailable (%s); pip install 'aiayn[gpu]' for the CUDA kernel", exc)
        return None
    return triton_loss.smoothed_ce_rows


def fused_loss_on(fused_loss: str, device: torch.device) -> bool:
    """``train.fused_loss`` resolved for a device: auto = on for CUDA where triton imports."""
    if fused_loss == "auto":
        return device.type == "cuda" and triton_rows() is not None
    return fused_loss == "on"


def torch_rows(z: Tensor, tgt: Tensor, eps_ls: float, pad_id: int, loss: Tensor, nll: Tensor, grad: bool) -> None:
    """``triton_loss.smoothed_ce_rows`` in PyTorch operations: per row of z (c,V) the loss and NLL
    written to ``loss`` and ``nll`` (c,) (0 on padding rows); with ``grad`` z overwritten by
    d loss / d z = softmax(z) - q (0 on padding rows)."""
    V = z.size(1)
    zf = z.to(acc_dtype(z))  # (c,V); z itself in float32 and float64
    log_z = torch.logsumexp(zf, dim=-1)  # (c,)
    z_gold = zf.gather(1, tgt.unsqueeze(1)).squeeze(1)
    row_loss, row_nll = smoothed_row_losses(log_z, zf.sum(-1), z_gold, zf[:, pad_id], eps_ls, V)
    w = tgt.ne(pad_id).to(zf.dtype)
    loss.copy_(row_loss * w)
    nll.copy_(row_nll * w)
    if grad:
        eps_o = eps_ls / (V - 2)
        p = zf.sub_(log_z[:, None]).exp_()  # (c,V) softmax
        p.sub_(eps_o)
        p[:, pad_id] += eps_o  # q_pad = 0
        p.scatter_add_(1, tgt[:, None], p.new_full((p.size(0), 1), eps_o - (1.0 - eps_ls)))  # q_gold = 1 - eps
        z.copy_(p.mul_(w[:, None]))


def autocast_inputs(pre: PreSoftmax) -> PreSoftmax:
    """``pre`` (``Transformer.pre_softmax``) in the dtype the plain projection takes under the autocast
    in force, inside its region (bf16 under bf16 autocast), so the chunks' logits are its logits."""
    kind = pre.h.device.type  # autocast's state is per kind of device
    if not torch.is_autocast_enabled(kind):
        return pre
    dtype = torch.get_autocast_dtype(kind)
    return PreSoftmax(pre.h.to(dtype), pre.weight.to(dtype))


def fused_label_smoothed_loss(pre: PreSoftmax, target: Tensor, eps_ls: float, pad_id: int,
                              rows: Rows | None = None, chunk_rows: int | None = None) -> LossSums:
    """``objective.label_smoothed_loss`` of the logits h W^T, a chunk of rows at a time.

    pre: h (B,T,D) and W (V,D) (``Transformer.pre_softmax``); target (B,T). ``rows`` does a
    chunk's loss and gradient (None: the Triton kernel for CUDA tensors where triton imports, else
    ``torch_rows``); ``chunk_rows`` rows per chunk (None: ``_CHUNK_ELEMENTS`` // V). The NLL is a
    statistic here: no gradient flows through it.
    """
    h, W = pre.h.reshape(-1, pre.h.size(-1)), pre.weight  # (N,D), (V,D)
    tgt = target.reshape(-1)
    if rows is None:
        kernel = triton_rows() if h.is_cuda and h.dtype in (torch.float32, torch.bfloat16, torch.float16) else None
        rows = kernel or torch_rows
    chunk = chunk_rows or max(1, _CHUNK_ELEMENTS // W.size(0))
    grad_on = torch.is_grad_enabled()
    need = (grad_on and h.requires_grad, grad_on and W.requires_grad)
    loss, nll = _FusedSmoothedCrossEntropy.apply(h, W, tgt, (float(eps_ls), int(pad_id)), (rows, chunk), need)
    return LossSums(loss, nll, tgt.ne(pad_id).sum())


class _FusedSmoothedCrossEntropy(torch.autograd.Function):
    """Summed loss and NLL of the logits h W^T (h (N,D), W (V,D)) with gold ids (N,), in chunks
    of rows; the gradients w.r.t. h and W are computed here, in forward, where ``need`` asks."""

    @staticmethod
    def forward(ctx, h: Tensor, W: Tensor, tgt: Tensor, smoothing: tuple[float, int], plan: tuple[Rows, int],
                need: tuple[bool, bool]):
        """``smoothing``: (eps_ls, pad_id); ``plan``: (the chunk's ``Rows`` function, rows per chunk)."""
        (eps_ls, pad_id), (rows, chunk) = smoothing, plan
        N = h.size(0)
        acc = acc_dtype(h)
        loss = torch.empty(N, dtype=acc, device=h.device)
        nll = torch.empty(N, dtype=acc, device=h.device)
        grad_h = torch.empty(h.shape, dtype=acc, device=h.device) if need[0] else None
        grad_W = torch.zeros(W.shape, dtype=acc, device=W.device) if need[1] else None
        for i in range(0, N, chunk):
            j = min(N, i + chunk)
            z = h[i:j] @ W.t()  # (c,V), becomes d loss / d z
            rows(z, tgt[i:j], eps_ls, pad_id, loss[i:j], nll[i:j], any(need))
            if grad_h is not None:
                grad_h[i:j] = z @ W  # (c,D)
            if grad_W is not None:
                if grad_W.dtype == z.dtype:
                    grad_W.addmm_(z.t(), h[i:j])
                else:
                    grad_W += z.t() @ h[i:j]  # (V,D) in z's dtype, summed in float32
        ctx.save_for_backward(grad_h, grad_W)
        ctx.dtypes = h.dtype, W.dtype
        nll_sum = nll.sum()
        ctx.mark_non_differentiable(nll_sum)
        return loss.sum(), nll_sum

    @staticmethod
    def backward(ctx, g_loss: Tensor, g_nll: Tensor):
        grads = [None if g is None else (g * g_loss).to(dtype) for g, dtype in zip(ctx.saved_tensors, ctx.dtypes)]
        return *grads, None, None, None, None
