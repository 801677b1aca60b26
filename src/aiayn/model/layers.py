"""Encoder and decoder layers (§3.1, Figure 1), the feed-forward network (Eq. 2), the
residual sub-layer connection, and the decoder's keys/values when the whole target is given
(``TeacherForced``; a decoding step's come from its cache, ``aiayn.decode.cache.CachedLayer``).

Shapes: B batch, S source length, T target length, D d_model, H heads.
"""
from __future__ import annotations

from typing import Protocol

import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.model.attention import MultiHeadAttention
from aiayn.model.config import ModelConfig


# ModelConfig.activation: Eq. 2's max(0, .), or the nonlinearity of an imported model (Marian's gelu, swish)
ACTIVATION_FNS = {"relu": F.relu, "gelu": F.gelu, "swish": F.silu}


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (Eq. 2), inner size d_ff; ``activation`` other than relu
    puts GELU or swish (x * sigmoid(x)) in place of max(0, .) (``ModelConfig.activation``)."""

    def __init__(self, d_model: int, d_ff: int, p_drop_ffn: float, activation: str = "relu"):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff)
        self.w2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(p_drop_ffn)  # fairseq's activation_dropout (ModelConfig.p_drop_ffn)
        self.activation = activation
        self.act = ACTIVATION_FNS[activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.dropout(self.act(self.w1(x))))


class SublayerConnection(nn.Module):
    """The residual connection around each sub-layer (§3.1, §5.4).

    Post-norm (paper): LayerNorm(x + Dropout(Sublayer(x))).
    Pre-norm (option): x + Dropout(Sublayer(LayerNorm(x))).
    Used as ``y = conn.post(x, conn.pre(x) -> sublayer)``: ``pre`` gives the sub-layer input.
    """

    def __init__(self, d_model: int, p_drop: float, pre_norm: bool, eps: float):
        super().__init__()
        self.norm = nn.LayerNorm(d_model, eps=eps)
        self.dropout = nn.Dropout(p_drop)  # P_drop (§5.4)
        self.pre_norm = pre_norm

    def pre(self, x: Tensor) -> Tensor:
        return self.norm(x) if self.pre_norm else x

    def post(self, x: Tensor, sublayer_out: Tensor) -> Tensor:
        y = x + self.dropout(sublayer_out)
        return y if self.pre_norm else self.norm(y)


def _mha(cfg: ModelConfig, self_attention: bool) -> MultiHeadAttention:
    return MultiHeadAttention(d_model=cfg.d_model, n_heads=cfg.n_heads, d_k=cfg.d_k, d_v=cfg.d_v,
                              p_drop_attn=cfg.p_drop_attn, self_attention=self_attention, bias=cfg.attn_bias)


def _conn(cfg: ModelConfig) -> SublayerConnection:
    return SublayerConnection(cfg.d_model, cfg.p_drop, cfg.pre_norm, cfg.layer_norm_eps)


class EncoderLayer(nn.Module):
    """Self-attention then FFN, each in a residual sub-layer connection (§3.1)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = _mha(cfg, self_attention=True)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.p_drop_ffn, cfg.activation)
        self.conn_attn, self.conn_ffn = _conn(cfg), _conn(cfg)

    def forward(self, x: Tensor, key_mask: Tensor, need_weights: bool = False):
        """x (B,S,D), key_mask (B,1,1,S) True = real token -> (B,S,D), weights (B,H,S,S) | None."""
        q, k, v = self.self_attn.project_qkv(self.conn_attn.pre(x))
        a, w = self.self_attn.attend(q, k, v, key_mask, need_weights=need_weights)
        x = self.conn_attn.post(x, a)
        x = self.conn_ffn.post(x, self.ffn(self.conn_ffn.pre(x)))
        return x, w


class TeacherForced:
    """A decoder layer's keys and values when the whole target is given (training, the uncached forward;
    §3.2.3): masked self-attention over the target itself, each position seeing the positions up to
    and including its own (target padding is on the right, so the causal mask alone keeps real
    positions from seeing padding), and encoder-decoder attention over the encoder output's keys and
    values. A decoding step gets them from its cache instead (``aiayn.decode.cache.CachedLayer``)."""

    def __init__(self, memory_k: Tensor, memory_v: Tensor, memory_mask: Tensor | None):
        self.memory_k, self.memory_v = memory_k, memory_v  # (B,H,S,K), (B,H,S,Dv)
        self.memory_mask = memory_mask  # (B,1,1,S) or None

    def self_attention(self, attn: MultiHeadAttention, x: Tensor, need_weights: bool):
        """x (B,T,D) -> (B,T,D), weights (B,H,T,T) | None."""
        q, k, v = attn.project_qkv(x)
        return attn.attend(q, k, v, None, is_causal=True, need_weights=need_weights)

    def cross_attention(self, attn: MultiHeadAttention, x: Tensor, need_weights: bool):
        """x (B,T,D) -> (B,T,D), weights (B,H,T,S) | None."""
        return attn.attend(attn.project_q(x), self.memory_k, self.memory_v, self.memory_mask,
                           need_weights=need_weights)


class KeysValues(Protocol):
    """The keys and values a decoder layer's two attentions read (§3.2.3): ``TeacherForced``, or a
    decoding step's (``aiayn.decode.cache.CachedLayer``). Each returns ((B,T,D), weights or None)."""

    def self_attention(self, attn: MultiHeadAttention, x: Tensor, need_weights: bool): ...

    def cross_attention(self, attn: MultiHeadAttention, x: Tensor, need_weights: bool): ...


class DecoderLayer(nn.Module):
    """A decoder layer (§3.1, Figure 1): masked multi-head self-attention, multi-head attention over the
    encoder output, and the position-wise FFN (§3.3), each in a residual sub-layer connection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = _mha(cfg, self_attention=True)
        self.cross_attn = _mha(cfg, self_attention=False)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.p_drop_ffn, cfg.activation)
        self.conn_self, self.conn_cross, self.conn_ffn = _conn(cfg), _conn(cfg), _conn(cfg)

    def forward(self, x: Tensor, kv: KeysValues, need_weights: bool = False):
        """x (B,T,D) -> (B,T,D), self weights (B,H,T,T') | None, cross weights (B,H,T,S) | None. ``kv`` holds
        the keys/values both attentions read: ``TeacherForced``, or a decoding step's (``CachedLayer``)."""
        a, w_self = kv.self_attention(self.self_attn, self.conn_self.pre(x), need_weights)  # masked
        x = self.conn_self.post(x, a)
        a, w_cross = kv.cross_attention(self.cross_attn, self.conn_cross.pre(x), need_weights)  # encoder-decoder
        x = self.conn_cross.post(x, a)
        x = self.conn_ffn.post(x, self.ffn(self.conn_ffn.pre(x)))
        return x, w_self, w_cross
