"""The peak device memory of one training step, from the model's shapes (``aiayn estimate``).

``bench/gpu_check.sh``'s ``memory`` stage records it beside ``torch.cuda.max_memory_allocated``
of the same step on a GPU (the comparison: docs/gpu.md). What it counts is the CUDA path of ``aiayn train`` (the fused attention
kernels, ``train.fused_loss``, autocast), for one process's batch of M_s = B x S source and
M_t = B x T target tokens, padding included. Symbols: D d_model, F d_ff, H heads, K d_k, Dv d_v,
V the target vocabulary, N_e and N_d the layers, P the parameters; b the bytes of a matmul's
inputs and outputs (2 under bf16 or fp16 autocast, 4 in fp32); m = 1 byte per element where
dropout is on (its boolean mask), else 0.

Persistent, in bytes: weights 4P (plus the buffers: the sinusoid table), gradients 4P, Adam's two
moments 8P, the moving average 4P where ``train.ema_decay`` is on, and in 16-bit autocast's copy of
every matmul weight, b x (P - the embedding - the LayerNorms), held from its first use in forward
until backward has used it.

Activations, the tensors autograd saves for backward, per token (the residual stream is float32:
LayerNorm runs in float32 under autocast):
  sub-layer connection        c = 4D + 8 + mD   LayerNorm's input, its mean and 1/std; the dropout mask
  self-attention (per query)  b (D + H (2K + Dv) + H Dv) + 4H
      the projection's input cast to b bytes, Q K V (one tensor, kept by the fused kernel), the
      kernel's output (W^O's input too: the heads' concatenation is a view of it), its log-sum-exp;
      no H x S x S attention map: the flash and memory-efficient kernels recompute it in backward
  cross-attention             per target token b (D + H K + H Dv) + 4H; per source token, in each
      decoder layer, b H (K + Dv) for its keys and values and b D for the encoder output cast to b
      bytes (in fp32 the encoder output itself, one tensor: 4D per source token once)
  feed-forward (Eq. 2)        b D + b F x (1 for ReLU, which keeps its output; 2 for GELU and swish,
      which keep their input too) + (m F + b F with ``p_drop_ffn``)
  embedding                   8 (the int64 ids) + mD;  pre-norm's final LayerNorm per stack 4D + 8
  encoder layer per source token: self-attention + feed-forward + 2c
  decoder layer per target token: self-attention + cross-attention + feed-forward + 3c

The loss: with ``train.fused_loss`` (on CUDA by default) the gradients of h and W made in forward,
float32, 4 (M_t D + V D), and at its last chunk the cast h (b M_t D), one chunk of logits
(b min(M_t, 2^26 / V) V) and in 16-bit the cast W and its chunk's gradient (2 b V D). Without it
(``fused_loss=off``, R-Drop): the logits and, in backward, their gradient, 2 b M_t V, the
projection's input b M_t D, and 8 M_t for the rows' statistics. R-Drop runs the model twice on
the batch: twice the activations and the logits.

The peak counts all of these at once. One process without accumulation frees activations in
backward while it fills the gradients, so there it is an upper bound; with data parallelism
(gradients in DDP's buckets) or accumulation the gradients live through forward too. Not counted:
the CUDA context and the caching allocator's slack, which ``nvidia-smi`` shows on top.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from aiayn.model.config import ModelConfig
from aiayn.train.config import TrainConfig

GiB = 2 ** 30
FUSED_CHUNK_ELEMENTS = 2 ** 26  # aiayn.train.fused_loss._CHUNK_ELEMENTS: logits per chunk


@dataclass(frozen=True)
class PeakMemory:
    """One process's peak device memory in a training step, in bytes, by what holds it."""

    weights: int
    gradients: int
    adam: int
    ema: int
    weight_copies: int   # autocast's 16-bit copies of the matmul weights
    activations: int     # what autograd saves for backward
    loss: int            # the loss's gradients and workspace (fused), or the logits and their gradient

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))


def parameter_counts(m: ModelConfig) -> tuple[int, int, int]:
    """(P, the embeddings' and LayerNorms' share of P, the buffers' elements), from the model built
    on the meta device (no memory)."""
    import torch
    from torch import nn

    from aiayn.model.positional import ScaledEmbedding
    from aiayn.model.transformer import Transformer, count_parameters
    with torch.device("meta"):
        model = Transformer(m)
    P = count_parameters(model)
    not_matmul = {id(p): p.numel() for mod in model.modules() if isinstance(mod, (ScaledEmbedding, nn.LayerNorm))
                  for p in mod.parameters()}
    return P, sum(not_matmul.values()), sum(b.numel() for b in model.buffers())


def activation_bytes(m: ModelConfig, src_tokens: int, tgt_tokens: int, b: int) -> int:
    """What autograd saves in one forward of ``src_tokens`` (B x S) and ``tgt_tokens`` (B x T) tokens
    at ``b`` bytes per matmul element (the module docstring's formula); the loss not included."""
    D, F, H, K, Dv = m.d_model, m.d_ff, m.n_heads, m.d_k, m.d_v
    mask = 1 if m.p_drop > 0 else 0
    conn = 4 * D + 8 + mask * D
    self_attn = b * (D + H * (2 * K + Dv) + H * Dv) + 4 * H
    cross_attn = b * (D + H * K + H * Dv) + 4 * H
    cross_src = b * H * (K + Dv) + (b * D if b < 4 else 0)  # per source token, in each decoder layer
    ffn = b * D + b * F * (1 if m.activation == "relu" else 2) + ((1 + b) * F if m.p_drop_ffn > 0 else 0)
    embed = 8 + mask * D
    final_norm = 4 * D + 8 if m.pre_norm else 0
    src = m.n_layers * (self_attn + ffn + 2 * conn) + m.decoder_layers * cross_src + embed + final_norm
    src += 4 * D if b == 4 else 0  # fp32: the encoder output, which every decoder layer's keys and values read
    tgt = m.decoder_layers * (self_attn + cross_attn + ffn + 3 * conn) + embed + final_norm
    return src_tokens * src + tgt_tokens * tgt


def loss_bytes(m: ModelConfig, tgt_tokens: int, b: int, fused: bool) -> int:
    """The loss's share of the peak (module docstring): fused, its gradients of h and W and its last
    chunk's workspace; plain, the logits and their gradient."""
    D, V = m.d_model, m.target_vocab_size
    if fused:
        chunk_rows = min(tgt_tokens, max(1, FUSED_CHUNK_ELEMENTS // V))
        return 4 * (tgt_tokens * D + V * D) + b * tgt_tokens * D + b * chunk_rows * V + (2 * b * V * D if b < 4 else 0)
    return 2 * b * tgt_tokens * V + b * tgt_tokens * D + 8 * tgt_tokens


def peak_memory(m: ModelConfig, t: TrainConfig, src_tokens: int, tgt_tokens: int, precision: str) -> PeakMemory:
    """One process's peak for a batch of ``src_tokens`` and ``tgt_tokens`` tokens in ``precision``
    ("fp32", or "bf16"/"fp16": 2 bytes), with ``t``'s loss, R-Drop and moving average."""
    b = 4 if precision == "fp32" else 2
    P, not_matmul, buffers = parameter_counts(m)
    passes = 2 if t.rdrop_alpha > 0 else 1
    fused = t.fused_loss != "off" and passes == 1
    copies = b * (P - not_matmul) if b < 4 else 0
    return PeakMemory(weights=4 * (P + buffers), gradients=4 * P, adam=8 * P, ema=4 * P if t.ema_decay > 0 else 0,
                      weight_copies=copies, activations=passes * activation_bytes(m, src_tokens, tgt_tokens, b),
                      loss=passes * loss_bytes(m, tgt_tokens, b, fused))


def format_peak(p: PeakMemory, src_tokens: int, tgt_tokens: int, precision: str) -> str:
    parts = [f"{f.name.replace('_', ' ')} {getattr(p, f.name) / GiB:.2f}" for f in fields(p) if getattr(p, f.name)]
    return (f"peak memory per device: {p.total / GiB:.1f} GiB at {src_tokens:,} + {tgt_tokens:,} tokens a batch, "
            f"{precision}: {' + '.join(parts)} GiB\n"
            f"  (from the model's shapes, aiayn/cost/memory.py; 1-15% above torch.cuda.max_memory_allocated "
            f"in four runs on an H200, docs/gpu.md; the allocator's reserve, up to 11% there, and the CUDA "
            f"context come on top)")
