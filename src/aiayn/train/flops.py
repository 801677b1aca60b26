"""Floating-point operations of the Transformer, counted from its shapes.

A multiply-add is 2 FLOPs. Forward FLOPs of one batch with B sentences, source length S and
target length T (padding included, as the hardware computes it):
  encoder layer:  B*S*2*(D*H*(2K+Dv) + H*Dv*D + 2*D*F) + B*H*S*S*2*(K+Dv)
  decoder layer:  B*T*2*(D*H*(2K+Dv) + H*Dv*D + D*H*K + H*Dv*D + 2*D*F) + B*S*2*D*H*(K+Dv)
                  + B*H*T*T*2*(K+Dv)  (causal: counted in full, as the kernels compute it)
                  + B*H*T*S*2*(K+Dv)
  output layer:   B*T*2*D*V
Training (forward + backward) is counted as 3x forward. Table 1's per-layer terms, n^2*d for
self-attention against n*d^2 for the position-wise parts, are ``self_attention_flops`` below.
"""
from __future__ import annotations

from aiayn.model.config import ModelConfig


def self_attention_flops(n: int, d_model: int, n_heads: int, d_k: int, d_v: int) -> dict[str, int]:
    """One self-attention layer on n positions: projections (n*d^2) vs the attention core (n^2*d)."""
    proj = n * 2 * (d_model * n_heads * (2 * d_k + d_v) + n_heads * d_v * d_model)
    core = n_heads * n * n * 2 * (d_k + d_v)
    return {"projections": proj, "attention_core": core}


def forward_flops(cfg: ModelConfig, B: int, S: int, T: int) -> int:
    D, F, H, K, Dv, V = cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.d_k, cfg.d_v, cfg.target_vocab_size
    enc = B * S * 2 * (D * H * (2 * K + Dv) + H * Dv * D + 2 * D * F) + B * H * S * S * 2 * (K + Dv)
    dec = (B * T * 2 * (D * H * (2 * K + Dv) + H * Dv * D + D * H * K + H * Dv * D + 2 * D * F)
           + B * S * 2 * D * H * (K + Dv) + B * H * T * T * 2 * (K + Dv) + B * H * T * S * 2 * (K + Dv))
    return cfg.n_layers * enc + cfg.decoder_layers * dec + B * T * 2 * D * V


def train_flops(cfg: ModelConfig, B: int, S: int, T: int) -> int:
    return 3 * forward_flops(cfg, B, S, T)
