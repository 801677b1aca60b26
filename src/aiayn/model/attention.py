"""Scaled dot-product attention (Eq. 1) and multi-head attention (§3.2.2).

Shapes: B batch, H heads, T query length, S key length, K d_k, Dv d_v, D d_model.

Three paths compute Eq. 1:
- the fast path, ``torch.nn.functional.scaled_dot_product_attention`` (fused kernels);
- the explicit path, which also returns the attention weights (plots, tests);
- on the CPU, when a module is given the C kernels (``MultiHeadAttention.kernels``; training sets
  them with ``train.c_kernels``), ``_KernelAttention``: forward and backward in
  ``aiayn/kernels/seq_attention.c``, float32 arithmetic on float32 or bfloat16 heads, as the fast path
  does under autocast with ``attn_fp32``; not with attention dropout or weights asked for.
``tests/model/test_model.py`` checks they agree.

Masks are boolean with True = may attend, or additive (0, or -inf where not; ``key_mask``, on CUDA),
broadcastable to (B, H, T, S).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.model.linear import Linear


def attention_explicit(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                       p_drop: float = 0.0, training: bool = False) -> tuple[Tensor, Tensor]:
    """Eq. 1, written out: softmax(Q K^T / sqrt(d_k)) V; returns (output, weights).

    q (B,H,T,K), k (B,H,S,K), v (B,H,S,Dv), mask (B|1,1,T|1,S) bool -> (B,H,T,Dv), (B,H,T,S).
    Illegal connections are set to -inf before the softmax, so their weight is exactly 0.
    """
    d_k = q.size(-1)
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d_k)  # (B,H,T,S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    dropped = F.dropout(weights, p=p_drop, training=training) if p_drop > 0 else weights
    return torch.matmul(dropped, v), weights


def attention_fast(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
                   p_drop: float = 0.0, training: bool = False) -> Tensor:
    """Eq. 1 through PyTorch's fused ``scaled_dot_product_attention``."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=p_drop if training else 0.0, is_causal=is_causal and mask is None
    )


def key_mask(src_pad: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """The keys every query may attend to, (B,1,1,S), from the padding ``src_pad`` (B,S) (True at
    padding): boolean (True = may attend), or with ``dtype`` additive (0, or -inf at padding), what
    the fused attention makes of a boolean mask at every call, here made once. Its rows are laid out
    16 entries apart, as the memory-efficient kernel wants them (it pads a copy at every call otherwise)."""
    if dtype is None:
        return (~src_pad)[:, None, None, :]
    B, S = src_pad.shape
    rows = torch.zeros(B, -(-S // 16) * 16, dtype=dtype, device=src_pad.device)
    rows[:, :S].masked_fill_(src_pad, float("-inf"))
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


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1..head_h) W^O (§3.2.2).

    Projections are d_model -> h*d_k (queries, keys) and d_model -> h*d_v (values), so d_k and
    d_v are free of d_model/h (Table 3 rows A, B). For self-attention the three input
    projections are fused into one matmul (same parameters, one kernel); for encoder-decoder
    attention keys and values are fused, and computed once per sentence when decoding.
    """

    def __init__(self, *, d_model: int, n_heads: int, d_k: int, d_v: int, p_drop_attn: float,
                 self_attention: bool, attn_fp32: bool = True):
        super().__init__()
        self.n_heads, self.d_k, self.d_v = n_heads, d_k, d_v
        self.p_drop_attn = p_drop_attn
        self.self_attention = self_attention
        self.attn_fp32 = attn_fp32
        if self_attention:
            self.qkv_proj = Linear(d_model, n_heads * (2 * d_k + d_v))
        else:
            self.q_proj = Linear(d_model, n_heads * d_k)
            self.kv_proj = Linear(d_model, n_heads * (d_k + d_v))
        self.out_proj = Linear(n_heads * d_v, d_model)  # W^O
        self.kernels = None  # aiayn.kernels.loader.Kernels: attend through seq_attention.c where it can

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
        if self._use_kernels(q, k, v, mask, need_weights):
            return self.out_proj(_KernelAttention.apply(q, k, v, mask, is_causal, self.kernels)), None
        out_dtype = q.dtype
        if self._upcast(q):
            # Same math in float32: on CPU the bf16 attention backward is several times slower,
            # and the softmax is safer. The projections around it stay in reduced precision.
            with torch.autocast(q.device.type, enabled=False):
                out, weights = self._attend(q.float(), k.float(), v.float(), mask, is_causal, need_weights)
        else:
            out, weights = self._attend(q, k, v, mask, is_causal, need_weights)
        return self.out_proj(out.to(out_dtype)), weights

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
        if not self.kernels.seq_attention_fast(self.d_k, self.d_v):
            return False
        if not self.attn_fp32 and (q.dtype != torch.float32 or torch.is_autocast_enabled(q.device.type)):
            return False
        return self.kernels.supports_heads(q, k, v, mask)

    def _attend(self, q, k, v, mask, is_causal, need_weights):
        """Eq. 1 per head, heads concatenated: (B,T,H*Dv), weights."""
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
