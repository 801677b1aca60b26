"""The model's linear maps, with their rows rounded up on the CPU in reduced precision (``pad_linear_rows``
in ``aiayn.execution`` puts ``RowPaddedLinear`` and ``RowPaddedEmbedding`` in place of the model's maps).

On the CPU under bfloat16 (or float16) PyTorch multiplies through oneDNN, which builds and keeps a
kernel, megabytes each, for every row count M = B x L it sees; token-bounded batches (§5.1) bring a
new M for nearly every sentence length, so the process grew with the corpus (docs/history.md, "The
linear maps' row counts"). ``row_bits`` = b keeps the b leading bits of M: the rows are padded with
zero rows up to the next multiple of 2^(bit_length(M) - b) (M < 2^b stays as it is), the product
taken, and the extra output rows dropped: the outputs equal the unpadded map's bit for bit, the
gradients to bfloat16 rounding (tested), and a map sees at most 2^(b-1) row counts per doubling of
M for at most 1/2^(b-1) more rows. Float32 on the CPU and other devices never pad.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.model.positional import ScaledEmbedding


ROW_BITS = 6  # the default of train.cpu_row_bits and DecodeConfig.cpu_row_bits
MAX_ROW_BITS = 62  # their largest value: padded_rows compares M with 2^bits, and no row count reaches 2^62


def padded_rows(M: int, bits: int) -> int:
    """M rounded up to a multiple of 2^(bit_length(M) - bits); M itself when bits <= 0 or M < 2^bits."""
    if bits <= 0 or M < 1 << bits:
        return M
    step = 1 << (M.bit_length() - bits)
    return -(-M // step) * step


def pads_rows(x: Tensor, bits: int) -> bool:
    """Whether ``row_padded_linear`` may pad ``x``: on the CPU, in reduced precision (bfloat16 or
    float16 autocast, or a bfloat16/float16 input), with bits > 0."""
    if bits <= 0 or x.device.type != "cpu" or x.dim() < 2:
        return False
    return torch.is_autocast_enabled("cpu") or x.dtype in (torch.bfloat16, torch.float16)


def row_padded_linear(x: Tensor, weight: Tensor, bias: Tensor | None, bits: int) -> Tensor:
    """``F.linear(x, weight, bias)`` for x (..., D_in) -> (..., D_out), its M = x.numel() / D_in rows
    padded to ``padded_rows(M, bits)`` with zero rows where ``pads_rows`` says so."""
    if not pads_rows(x, bits):
        return F.linear(x, weight, bias)
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.size(-1))  # (M, D_in)
    M = rows.size(0)
    extra = padded_rows(M, bits) - M
    if extra == 0:
        return F.linear(x, weight, bias)
    y = F.linear(F.pad(rows, (0, 0, 0, extra)), weight, bias)[:M]  # (M + extra, D_out) -> (M, D_out)
    return y.reshape(*lead, y.size(-1))


class RowPaddedLinear(nn.Linear):
    """``nn.Linear`` (the same parameters and state-dict keys) through ``row_padded_linear``; with
    ``casts`` (``casts.WeightCasts``), its weight and bias as cast once for the forward under autocast."""

    row_bits: int = 0
    casts = None

    @classmethod
    def of(cls, linear: nn.Linear, bits: int) -> "RowPaddedLinear":
        """The map of ``linear``, its very parameters (made on the meta device: no draw from the generator)."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        new.weight, new.bias = linear.weight, linear.bias
        new.row_bits = bits
        return new

    def forward(self, x: Tensor) -> Tensor:
        if self.casts is None:
            return row_padded_linear(x, self.weight, self.bias, self.row_bits)
        return row_padded_linear(x, self.casts.get(self.weight), self.casts.get(self.bias), self.row_bits)


class RowPaddedEmbedding(ScaledEmbedding):
    """A ``ScaledEmbedding`` whose pre-softmax use (``transposed``, §3.4 tied) pads its rows as
    ``RowPaddedLinear`` does; the lookup is the embedding's."""

    row_bits: int = 0

    @classmethod
    def of(cls, embed: ScaledEmbedding, bits: int) -> "RowPaddedEmbedding":
        """The embedding ``embed``, its very weight (made on the meta device: no draw from the generator)."""
        vocab, d_model = embed.weight.shape
        with torch.device("meta"):
            new = cls(vocab, d_model, embed.pad_id, False)
        new.weight, new.scale = embed.weight, embed.scale
        new.row_bits = bits
        return new

    def transposed(self, h: Tensor, bias: Tensor | None = None) -> Tensor:
        return row_padded_linear(h, self.weight, bias, self.row_bits)
