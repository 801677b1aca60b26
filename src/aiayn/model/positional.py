"""Positional encodings (§3.5) and the scaled, shared embedding (§3.4).

Shapes: B batch, L length, D d_model, V vocabulary.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def sinusoidal_table(n_positions: int, d_model: int, dtype=torch.float32) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(same) (§3.5).

    Interleaved exactly as the paper writes it: even dimensions sin, odd dimensions cos.
    Returns (n_positions, d_model). Computed in float64, then cast.
    """
    pos = torch.arange(n_positions, dtype=torch.float64).unsqueeze(1)  # (L,1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # 2i
    angle = pos / torch.pow(10000.0, two_i / d_model)  # (L, ceil(D/2))
    pe = torch.zeros(n_positions, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle[:, : d_model // 2])
    return pe.to(dtype)


class SinusoidalPositions(nn.Module):
    """Fixed sinusoids (§3.5); extends itself for inputs longer than the initial table."""

    def __init__(self, d_model: int, max_positions: int):
        super().__init__()
        self.d_model = d_model
        self.register_buffer("table", sinusoidal_table(max_positions, d_model), persistent=False)

    def forward(self, start: int, length: int) -> Tensor:
        """Encodings of positions start..start+length-1: (length, D)."""
        end = start + length
        if end > self.table.size(0):
            self.table = sinusoidal_table(max(end, 2 * self.table.size(0)), self.d_model).to(self.table.device)
        return self.table[start:end]


class LearnedPositions(nn.Module):
    """Learned positional embeddings (Table 3 row E); a hard limit of max_positions."""

    def __init__(self, d_model: int, max_positions: int):
        super().__init__()
        self.max_positions = max_positions
        self.weight = nn.Parameter(torch.empty(max_positions, d_model))
        nn.init.normal_(self.weight, mean=0.0, std=d_model ** -0.5)

    def forward(self, start: int, length: int) -> Tensor:
        end = start + length
        if end > self.max_positions:
            raise ValueError(
                f"sequence of {end} positions exceeds max_positions={self.max_positions} of learned positional embeddings"
            )
        return self.weight[start:end]


class ScaledEmbedding(nn.Module):
    """Token embedding multiplied by sqrt(d_model) (§3.4).

    Initialized N(0, d_model^-0.5) so that after the scale entries have unit variance (as
    tensor2tensor does); the same weight serves as the pre-softmax projection when tied.
    """

    def __init__(self, vocab_size: int, d_model: int, pad_id: int, scale: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, d_model))
        nn.init.normal_(self.weight, mean=0.0, std=d_model ** -0.5)
        with torch.no_grad():
            self.weight[pad_id].zero_()
        self.pad_id = pad_id
        self.scale = math.sqrt(d_model) if scale else 1.0

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens (B,L) -> (B,L,D)."""
        return nn.functional.embedding(tokens, self.weight, padding_idx=self.pad_id) * self.scale

    def transposed(self, h: Tensor, bias: Tensor | None = None) -> Tensor:
        """The pre-softmax linear transformation with this matrix (§3.4, tied): h (B,T,D) -> h W^T + b (B,T,V)."""
        return nn.functional.linear(h, self.weight, bias)
