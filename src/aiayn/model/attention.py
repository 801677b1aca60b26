"""Scaled dot-product attention (Eq. 1, Figure 2 left) and multi-head attention (§3.2.2, Figure 2 right).

Shapes: B batch, H heads, T query length, S key length, K d_k, Dv d_v, D d_model.

Eq. 1 is computed by ``ScaledDotProductAttention``, one per multi-head attention, in two ways:
PyTorch's fused ``scaled_dot_product_attention`` (``attention_fast``), or written out
(``attention_explicit``), which also returns the weights (plots, tests); ``tests/model/test_model.py``
checks they agree. How a run computes it (in C, or in float32 under autocast) is applied from
outside by swapping this module (``aiayn.execution``).

Masks are boolean with True = may attend (or additive: 0, or -inf where not), broadcastable to (B, H, T, S).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def attention_explicit(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                       p_drop: float = 0.0, training: bool = False) -> tuple[Tensor, Tensor]:
    """Eq. 1, written out: softmax(Q K^T / sqrt(d_k)) V; returns (output, weights).

    q (B,H,T,K), k (B,H,S,K), v (B,H,S,Dv), mask (B|1,1,T|1,S) bool -> (B,H,T,Dv), (B,H,T,S).
    Illegal connections are set to -inf before the softmax, so their weight is exactly 0; a query with
    no legal key (a row of padding alone) gets zero weights and output, as on the fused path, not 0/0.
    """
    d_k = q.size(-1)
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d_k)  # (B,H,T,S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    if mask is not None:
        weights = weights.masked_fill(~mask, 0.0)  # NaN rows (no legal key) -> 0; the others unchanged
    dropped = F.dropout(weights, p=p_drop, training=training) if p_drop > 0 else weights
    return torch.matmul(dropped, v), weights


def attention_fast(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
                   p_drop: float = 0.0, training: bool = False) -> Tensor:
    """Eq. 1 through PyTorch's fused ``scaled_dot_product_attention``."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=p_drop if training else 0.0, is_causal=is_causal and mask is None
    )


def key_mask(src_pad: Tensor) -> Tensor:
    """The keys every query may attend to, (B,1,1,S) bool (True = may attend), from the padding
    ``src_pad`` (B,S) (True at padding)."""
    return (~src_pad)[:, None, None, :]


class ScaledDotProductAttention(nn.Module):
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V (Eq. 1, Figure 2 left), with optional dropout
    on the weights (``p_drop_attn``). A module without parameters, so that a run may put its own way
    of computing Eq. 1 in its place (``aiayn.execution``)."""

    def __init__(self, p_drop_attn: float):
        super().__init__()
        self.p_drop_attn = p_drop_attn

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool = False,
                need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        """q (B,H,T,K), k (B,H,S,K), v (B,H,S,Dv) -> heads concatenated (B,T,H*Dv), weights (B,H,T,S) or None."""
        p = self.p_drop_attn
        T, S = q.size(-2), k.size(-2)
        if is_causal and (need_weights or mask is not None or T != S):
            # Query t (of the last T positions) sees keys 0..S-T+t: bottom-right aligned.
            causal = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
            mask = causal if mask is None else mask & causal
            is_causal = False
        if need_weights:
            out, weights = attention_explicit(q, k, v, mask, p, self.training)
        else:
            out, weights = attention_fast(q, k, v, mask, is_causal, p, self.training), None
        B, H, T, Dv = out.shape
        return out.transpose(1, 2).reshape(B, T, H * Dv), weights  # Concat(head_1..head_h)


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1..head_h) W^O (§3.2.2).

    Projections are d_model -> h*d_k (queries, keys) and d_model -> h*d_v (values), so d_k and
    d_v are free of d_model/h (Table 3 rows A, B); matrices, as the paper's W^Q, W^K, W^V, W^O, unless
    ``bias`` (ModelConfig.attn_bias, not in the paper) adds a bias to each. For self-attention the three input
    projections are fused into one matmul (same parameters, one kernel); for encoder-decoder
    attention keys and values are fused, and computed once per sentence when decoding.
    """

    def __init__(self, *, d_model: int, n_heads: int, d_k: int, d_v: int, p_drop_attn: float, self_attention: bool,
                 bias: bool = False):
        super().__init__()
        self.n_heads, self.d_k, self.d_v = n_heads, d_k, d_v
        self.self_attention = self_attention
        if self_attention:
            self.qkv_proj = nn.Linear(d_model, n_heads * (2 * d_k + d_v), bias=bias)
        else:
            self.q_proj = nn.Linear(d_model, n_heads * d_k, bias=bias)
            self.kv_proj = nn.Linear(d_model, n_heads * (d_k + d_v), bias=bias)
        self.out_proj = nn.Linear(n_heads * d_v, d_model, bias=bias)  # W^O
        self.core = ScaledDotProductAttention(p_drop_attn)  # Eq. 1

    def _split(self, x: Tensor, d: int) -> Tensor:
        B, L, _ = x.shape
        return x.view(B, L, self.n_heads, d).transpose(1, 2)  # (B,H,L,d)

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Self-attention projections of x (B,T,D) -> q (B,H,T,K), k (B,H,T,K), v (B,H,T,Dv)."""
        hk = self.n_heads * self.d_k
        q, k, v = self.qkv_proj(x).split([hk, hk, self.n_heads * self.d_v], dim=-1)
        return self._split(q, self.d_k), self._split(k, self.d_k), self._split(v, self.d_v)

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Encoder-decoder keys and values from the encoder output (B,S,D): computed once per sentence."""
        k, v = self.kv_proj(memory).split([self.n_heads * self.d_k, self.n_heads * self.d_v], dim=-1)
        return self._split(k, self.d_k), self._split(v, self.d_v)

    def project_q(self, x: Tensor) -> Tensor:
        return self._split(self.q_proj(x), self.d_k)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, is_causal: bool = False,
               need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        """Eq. 1 on projected heads, then concat and W^O. Returns ((B,T,D), weights (B,H,T,S) or None)."""
        out, weights = self.core(q, k, v, mask, is_causal, need_weights)
        return self.out_proj(out), weights
