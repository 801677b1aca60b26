"""Encoder and decoder layers (§3.1, Figure 1), the feed-forward network (Eq. 2) and the
residual sub-layer connection.

Shapes: B batch, S source length, T target length, D d_model, H heads.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.model.attention import MultiHeadAttention
from aiayn.model.cache import DecoderCache
from aiayn.model.config import ModelConfig
from aiayn.model.dropout import dropout
from aiayn.model.linear import Linear


# ModelConfig.activation: Eq. 2's max(0, .), or the nonlinearity of an imported model (Marian's gelu, swish)
ACTIVATION_FNS = {"relu": F.relu, "gelu": F.gelu, "swish": F.silu}


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (Eq. 2), inner size d_ff; ``activation`` other than relu
    puts GELU or swish (x * sigmoid(x)) in place of max(0, .) (``ModelConfig.activation``)."""

    def __init__(self, d_model: int, d_ff: int, p_drop_ffn: float, fast_dropout: bool = True,
                 activation: str = "relu"):
        super().__init__()
        self.w1 = Linear(d_model, d_ff)
        self.w2 = Linear(d_ff, d_model)
        self.p_drop_ffn = p_drop_ffn
        self.fast_dropout = fast_dropout
        self.activation = activation
        self.act = ACTIVATION_FNS[activation]

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.w1(x))
        if self.p_drop_ffn > 0:
            h = dropout(h, self.p_drop_ffn, self.training, self.fast_dropout)
        return self.w2(h)


class SublayerConnection(nn.Module):
    """The residual connection around each sub-layer (§3.1, §5.4).

    Post-norm (paper): LayerNorm(x + Dropout(Sublayer(x))).
    Pre-norm (option): x + Dropout(Sublayer(LayerNorm(x))).
    Used as ``y = conn.post(x, conn.pre(x) -> sublayer)``: ``pre`` gives the sub-layer input.
    """

    def __init__(self, d_model: int, p_drop: float, pre_norm: bool, eps: float, fast_dropout: bool = True):
        super().__init__()
        self.norm = nn.LayerNorm(d_model, eps=eps)
        self.p_drop = p_drop
        self.fast_dropout = fast_dropout
        self.pre_norm = pre_norm

    def pre(self, x: Tensor) -> Tensor:
        return self.norm(x) if self.pre_norm else x

    def post(self, x: Tensor, sublayer_out: Tensor) -> Tensor:
        y = x + dropout(sublayer_out, self.p_drop, self.training, self.fast_dropout)
        return y if self.pre_norm else self.norm(y)


def _group_rows(q: Tensor, g: int) -> Tensor:
    """Queries (N,H,t,K) of g consecutive rows that share an encoder row (and, with shared beam
    slots, self-attention slots) -> g*t queries of one row (N/g,H,g*t,K)."""
    if g == 1:
        return q
    N, H, t, K = q.shape
    return q.view(N // g, g, H, t, K).transpose(1, 2).reshape(N // g, H, g * t, K)


def _kernels_for(cache: DecoderCache | None, q: Tensor, need_weights: bool):
    """The cache's C kernels when this step's attention can use them: shared beam slots, one new
    position, no weights asked for, no autocast (whose float32 attention they do not mimic), and
    tensors they handle (``Kernels.supports``); else None (PyTorch's attention)."""
    kernels = cache.kernels if cache is not None and cache.shared_slots else None
    if (kernels is None or need_weights or q.size(2) != 1 or torch.is_autocast_enabled(q.device.type)
            or not kernels.supports(q, cache.layers[0].self_k, cache.layers[0].cross_k)):
        return None
    return kernels


def _mha(cfg: ModelConfig, self_attention: bool) -> MultiHeadAttention:
    return MultiHeadAttention(d_model=cfg.d_model, n_heads=cfg.n_heads, d_k=cfg.d_k, d_v=cfg.d_v,
                              p_drop_attn=cfg.p_drop_attn, self_attention=self_attention,
                              attn_fp32=cfg.attn_fp32)


def _conn(cfg: ModelConfig) -> SublayerConnection:
    return SublayerConnection(cfg.d_model, cfg.p_drop, cfg.pre_norm, cfg.layer_norm_eps, cfg.fast_dropout)


class EncoderLayer(nn.Module):
    """Self-attention then FFN, each in a residual sub-layer connection (§3.1)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = _mha(cfg, self_attention=True)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.p_drop_ffn, cfg.fast_dropout, cfg.activation)
        self.conn_attn, self.conn_ffn = _conn(cfg), _conn(cfg)

    def forward(self, x: Tensor, key_mask: Tensor, need_weights: bool = False):
        """x (B,S,D), key_mask (B,1,1,S) True = real token -> (B,S,D), weights (B,H,S,S) | None."""
        q, k, v = self.self_attn.project_qkv(self.conn_attn.pre(x))
        a, w = self.self_attn.attend(q, k, v, key_mask, need_weights=need_weights)
        x = self.conn_attn.post(x, a)
        x = self.conn_ffn.post(x, self.ffn(self.conn_ffn.pre(x)))
        return x, w


class DecoderLayer(nn.Module):
    """Masked self-attention, encoder-decoder attention, FFN (§3.1)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = _mha(cfg, self_attention=True)
        self.cross_attn = _mha(cfg, self_attention=False)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.p_drop_ffn, cfg.fast_dropout, cfg.activation)
        self.conn_self, self.conn_cross, self.conn_ffn = _conn(cfg), _conn(cfg), _conn(cfg)

    def forward(self, x: Tensor, memory_kv: tuple[Tensor, Tensor], memory_mask: Tensor,
                cache: DecoderCache | None, index: int, need_weights: bool = False):
        """x (B,T,D); memory_kv = cross keys/values (B,H,S,K); memory_mask (B,1,1,S).

        Without a cache: causal self-attention over x (target padding is on the right, so
        the causal mask alone keeps real positions from seeing padding).
        With a cache: x holds the new position(s); keys/values are appended to the cache.
        """
        q, k, v = self.self_attn.project_qkv(self.conn_self.pre(x))
        g = cache.group if cache is not None else 1
        kernels = _kernels_for(cache, q, need_weights)
        if kernels is not None:  # beam search's shared slots, through the C kernel (kernels/loader.py)
            slot_k, slot_v = cache.slots(index)  # (N/g,H,(L+1)g,K); the kernel appends k, v as it attends
            a = self.self_attn.out_proj(kernels.self_attention(q, slot_k, slot_v, cache.ancestors, g, k, v))[:, None]
            w_self = None
        elif cache is not None and cache.shared_slots:  # beam search: a sentence's g rows share slots
            k, v = cache.append(index, k, v)  # (N/g,H,(L+1)g,K)
            a, w_self = self.self_attn.attend(_group_rows(q, g), k, v, cache.self_mask(), need_weights=need_weights)
            a = a.reshape(q.size(0), 1, a.size(-1))  # (N/g, g, D) -> (N,1,D)
            if w_self is not None:
                w_self = cache.own_weights(w_self)
        else:
            if cache is not None:
                k, v = cache.append(index, k, v)
                causal = q.size(2) > 1  # a multi-token chunk appended to the cache stays causal
            else:
                causal = True
            a, w_self = self.self_attn.attend(q, k, v, None, is_causal=causal, need_weights=need_weights)
        x = self.conn_self.post(x, a)
        q = self.cross_attn.project_q(self.conn_cross.pre(x))  # (N,H,t,K)
        N, H, t, _ = q.shape
        if kernels is not None:
            a = self.cross_attn.out_proj(kernels.cross_attention(q, *memory_kv, cache.src_pad, g))[:, None]  # (N,1,D)
            w_cross = None
        else:
            a, w_cross = self.cross_attn.attend(_group_rows(q, g), *memory_kv, memory_mask, need_weights=need_weights)
        if g > 1 and kernels is None:
            a = a.reshape(N, t, a.size(-1))  # (N/g, g*t, D) -> (N,t,D)
            if w_cross is not None:
                S = w_cross.size(-1)
                w_cross = w_cross.view(N // g, H, g, t, S).transpose(1, 2).reshape(N, H, t, S)
        x = self.conn_cross.post(x, a)
        x = self.conn_ffn.post(x, self.ffn(self.conn_ffn.pre(x)))
        return x, w_self, w_cross
