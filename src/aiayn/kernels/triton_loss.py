"""§5.4's label-smoothed loss over a chunk of logits rows, and its gradient written in their place (Triton).

One program per row of z (c,V): a first pass over the row keeps the running maximum m, the sum
d of exp(z - m) (online softmax: Milakov and Gimelshein, 2018) and the sum s of z; with
log Z = m + log d and eps' = eps / (V - 2), the row's
  nll  = log Z - z_g
  loss = log Z - (1 - eps) z_g - eps' (s - z_g - z_pad)
(the formulas of ``aiayn.train.objective._SmoothedCrossEntropy``). A second pass writes
d loss / d z = softmax(z) - q over the row in z's dtype, with q = 1 - eps at the gold token, 0 at
padding and eps' elsewhere. A row whose target is padding counts nothing and gets a zero gradient.
Statistics in float32. Importing this module imports triton (the ``[gpu]`` extra); with
``TRITON_INTERPRET=1`` set before the import, the kernel runs on CPU tensors (the tests).
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

_MAX_BLOCK = 32768  # columns per step of a row's loop: V = 37,000 takes two


@triton.jit
def _smoothed_ce_rows(z_ptr, tgt_ptr, loss_ptr, nll_ptr, stride, V, pad_id, eps_ls, eps_o,
                      GRAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_ptr += row * stride
    g = tl.load(tgt_ptr + row)
    if g == pad_id:  # no loss, zero gradient
        if GRAD:
            for start in range(0, V, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                tl.store(z_ptr + cols, tl.zeros([BLOCK], dtype=z_ptr.dtype.element_ty), mask=cols < V)
        tl.store(loss_ptr + row, 0.0)
        tl.store(nll_ptr + row, 0.0)
        return
    m = -float("inf")
    d = 0.0
    s = 0.0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(z_ptr + cols, mask=cols < V, other=-float("inf")).to(tl.float32)  # (BLOCK,)
        m_new = tl.maximum(m, tl.max(z, 0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        s += tl.sum(tl.where(cols < V, z, 0.0), 0)
        m = m_new
    log_z = m + tl.log(d)
    z_g = tl.load(z_ptr + g).to(tl.float32)
    z_pad = tl.load(z_ptr + pad_id).to(tl.float32)
    tl.store(nll_ptr + row, log_z - z_g)
    tl.store(loss_ptr + row, log_z - (1.0 - eps_ls) * z_g - eps_o * (s - z_g - z_pad))
    if GRAD:  # z_g and z_pad are read above, before this pass overwrites them
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            z = tl.load(z_ptr + cols, mask=cols < V, other=0.0).to(tl.float32)
            q = tl.where(cols == g, 1.0 - eps_ls, tl.where(cols == pad_id, 0.0, eps_o))
            grad = tl.exp(z - log_z) - q
            tl.store(z_ptr + cols, grad.to(z_ptr.dtype.element_ty), mask=cols < V)


def smoothed_ce_rows(z: Tensor, tgt: Tensor, eps_ls: float, pad_id: int, loss: Tensor, nll: Tensor,
                     grad: bool) -> None:
    """Per row of z (c,V): ``loss`` and ``nll`` (c,) float32 written (0 where ``tgt`` (c,) is
    padding); with ``grad``, z overwritten by d loss / d z (zero on padding rows). z contiguous."""
    c, V = z.shape
    block = min(_MAX_BLOCK, triton.next_power_of_2(V))
    _smoothed_ce_rows[(c,)](z, tgt, loss, nll, z.stride(0), V, pad_id, float(eps_ls), eps_ls / (V - 2),
                            GRAD=grad, BLOCK=block, num_warps=32 if block >= 8192 else 8)

