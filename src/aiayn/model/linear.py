"""The model's linear maps, with their rows rounded up on the CPU in reduced precision.

A linear map of a (B,L,D) tensor multiplies M = B x L rows by its weight. On the CPU under bfloat16
(or float16) autocast PyTorch runs it on oneDNN, which builds a kernel (a "primitive") for every
product shape and keeps it in two caches (oneDNN's own and PyTorch's ideep layer), each entry holding
megabytes of generated code and buffers: 4 MB at M = 300 and 13 MB at M = 2,500 for one 512 x 2,048
map forward and backward, measured on this project's 2-core Intel Xeon with AMX. Token-bounded batches
(§5.1) give a new M for nearly every length in the corpus, and a larger corpus has more lengths:
276 distinct row counts at 3,125 tokens a batch on 250,000 WMT-like pairs, 556 on 2,000,000. So
the caches, and the process, grew with the corpus (16 MB a step after 60 steps of the tiny preset
on 250,000 pairs, without end in sight).

``row_multiple`` = q pads the M rows with zero rows up to the next multiple of q, multiplies, and
drops the extra output rows: every row's result is the same product of the same numbers, and the
zero rows add nothing to the weight's gradient, so the outputs and gradients equal the unpadded
map's (tested). With q = 64 the same corpora give 19 and 30 row counts (at most one per 64 rows of
the token bound, whatever the corpus) for 0.9% more rows multiplied. Float32 on the CPU (MKL's
GEMM, no per-shape cache) and other devices are never padded.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def pads_rows(x: Tensor, multiple: int) -> bool:
    """Whether ``row_padded_linear`` pads ``x``: a positive multiple, on the CPU, in reduced precision
    (bfloat16 or float16 autocast, or a bfloat16/float16 input)."""
    if multiple <= 0 or x.device.type != "cpu" or x.dim() < 2:
        return False
    return torch.is_autocast_enabled("cpu") or x.dtype in (torch.bfloat16, torch.float16)


def row_padded_linear(x: Tensor, weight: Tensor, bias: Tensor | None, multiple: int) -> Tensor:
    """``F.linear(x, weight, bias)`` for x (..., D_in) -> (..., D_out), its M = x.numel() / D_in rows
    rounded up to a multiple of ``multiple`` with zero rows where ``pads_rows`` says so."""
    if not pads_rows(x, multiple):
        return F.linear(x, weight, bias)
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.size(-1))  # (M, D_in)
    M = rows.size(0)
    extra = -M % multiple
    if extra == 0:
        return F.linear(x, weight, bias)
    y = F.linear(F.pad(rows, (0, 0, 0, extra)), weight, bias)[:M]  # (M + extra, D_out) -> (M, D_out)
    return y.reshape(*lead, y.size(-1))


class Linear(nn.Linear):
    """``nn.Linear`` (the same parameters and state-dict keys) through ``row_padded_linear``;
    ``row_multiple`` is 0 (off) until ``Transformer.pad_linear_rows`` sets it."""

    row_multiple: int = 0

    def forward(self, x: Tensor) -> Tensor:
        return row_padded_linear(x, self.weight, self.bias, self.row_multiple)
