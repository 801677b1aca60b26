"""The Transformer (Figure 1, §3): encoder and decoder stacks, shared embeddings, softmax.

Shape glossary: B batch, S source length, T target length, D d_model, H heads,
K d_k, Dv d_v, V vocabulary, N decoding rows (sentences x beams).
Token tensors are batch-first ids; ``cfg.pad_id`` marks padding.
"""
from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
from torch import Tensor, nn

from aiayn.errors import UserError
from aiayn.model.attention import key_mask
from aiayn.model.config import ModelConfig
from aiayn.model.layers import DecoderLayer, EncoderLayer, KeysValues, TeacherForced
from aiayn.model.positional import LearnedPositions, ScaledEmbedding, SinusoidalPositions


class IncrementalState(Protocol):
    """What ``Transformer.decode`` reads of a decoding cache (``aiayn.decode.cache.DecoderCache``): each
    layer's keys and values at this step, and the position of the step's first token."""
    length: int

    def attention(self) -> list[KeysValues]: ...


class EncoderOutput(NamedTuple):
    memory: Tensor  # (B,S,D)
    src_pad: Tensor  # (B,S) bool, True at padding
    weights: list[Tensor] | None = None  # per layer (B,H,S,S) when asked for
    padded: bool = True  # False: the caller knew src held no padding (``Transformer.encode``)


class DecoderOutput(NamedTuple):
    logits: Tensor  # (B,T,V)
    cache: IncrementalState | None
    self_weights: list[Tensor] | None = None  # per layer (B,H,T,T')
    cross_weights: list[Tensor] | None = None  # per layer (B,H,T,S)


class PreSoftmax(NamedTuple):
    """The inputs of the pre-softmax linear transformation (§3.4): logits = h W^T, not yet taken."""
    h: Tensor  # (B,T,D)
    weight: Tensor  # (V,D)


class Transformer(nn.Module):
    """Encoder-decoder Transformer of "Attention Is All You Need" (Figure 1)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        D = cfg.d_model
        self.src_embed = ScaledEmbedding(cfg.vocab_size, D, cfg.pad_id, cfg.scale_embeddings)
        if cfg.tie_src_tgt_embeddings:
            self.tgt_embed = self.src_embed  # §3.4: one matrix for both embeddings
        else:
            self.tgt_embed = ScaledEmbedding(cfg.target_vocab_size, D, cfg.pad_id, cfg.scale_embeddings)
        if cfg.learned_positions:  # Table 3 row E
            self.src_pos = LearnedPositions(D, cfg.max_positions)
            self.tgt_pos = LearnedPositions(D, cfg.max_positions)
        else:
            self.src_pos = self.tgt_pos = SinusoidalPositions(D, cfg.max_positions)
        self.encoder_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        # Pre-norm needs a final LayerNorm per stack; post-norm already ends in one.
        self.encoder_norm = nn.LayerNorm(D, eps=cfg.layer_norm_eps) if cfg.pre_norm else nn.Identity()
        self.decoder_norm = nn.LayerNorm(D, eps=cfg.layer_norm_eps) if cfg.pre_norm else nn.Identity()
        # pre-softmax projection: None = the target embedding matrix (§3.4)
        self.out_proj = None if cfg.tie_embeddings else nn.Linear(D, cfg.target_vocab_size, bias=False)
        # Marian's final_logits_bias (ModelConfig.output_bias); the paper's projection has none
        self.out_bias = nn.Parameter(torch.zeros(cfg.target_vocab_size)) if cfg.output_bias else None
        self.dropout = nn.Dropout(cfg.p_drop)  # on the sums of embeddings and positional encodings (§5.4)
        self._init_weights()

    def _init_weights(self) -> None:
        """Xavier-uniform linear weights, zero biases (as tensor2tensor and fairseq)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        if self.out_proj is not None:
            nn.init.normal_(self.out_proj.weight, mean=0.0, std=self.cfg.d_model ** -0.5)

    # -- embeddings ---------------------------------------------------------------------
    def _embed(self, tokens: Tensor, embed: ScaledEmbedding, pos: nn.Module, start: int, what: str = "tokens") -> Tensor:
        """Embedding * sqrt(d_model) + positional encoding, then dropout (§3.4, §3.5, §5.4). ``tokens`` that
        are not a (B, L) tensor of the vocabulary's ids: a one-line UserError naming ``what``."""
        if not isinstance(tokens, Tensor) or tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            got = f"{tokens.dtype} of shape {tuple(tokens.shape)}" if isinstance(tokens, Tensor) else type(tokens).__name__
            raise UserError(f"{what}: expected a (B, L) tensor of token ids (torch.long, batch first; one sentence: "
                            f"{what}[None]), got {got}")
        try:
            x = embed(tokens) + pos(start, tokens.size(1)).to(embed.weight.dtype)  # (B,L,D)
        except IndexError:  # (the CPU's lookup; CUDA asserts on the device)
            raise UserError(f"{what}: token ids must be in [0, {embed.weight.size(0)}) (the model's vocabulary), "
                            f"got ids from {int(tokens.min())} to {int(tokens.max())}") from None
        return self.dropout(x)

    def output_logits(self, h: Tensor) -> Tensor:
        """Pre-softmax linear transformation (§3.4), plus ``out_bias`` where the model has one: (B,T,D) -> (B,T,V).
        (A decoding copy may put its own ``out_proj`` over the tied matrix: the bias is still added here.)"""
        if self.out_proj is None:
            return self.tgt_embed.transposed(h, self.out_bias)
        logits = self.out_proj(h)
        return logits if self.out_bias is None else logits + self.out_bias

    def pre_softmax(self, h: Tensor) -> PreSoftmax:
        """``output_logits``'s inputs instead of its product, for a loss that takes the logits a
        chunk of rows at a time (``aiayn.train.fused_loss``): h (B,T,D) and W (V,D), as the model
        holds them (the loss casts them to autocast's dtype). A bias b (``output_bias``) rides as one
        more column: [h, 1] [W, b]^T = h W^T + b, so the product stays bias-free."""
        weight = self.tgt_embed.weight if self.out_proj is None else self.out_proj.weight
        if self.out_bias is not None:
            h = torch.cat([h, h.new_ones(*h.shape[:-1], 1)], dim=-1)  # (B,T,D+1)
            weight = torch.cat([weight, self.out_bias[:, None].to(weight.dtype)], dim=1)  # (V,D+1)
        return PreSoftmax(h, weight.to(h.dtype))

    # -- encoder ------------------------------------------------------------------------
    def encode(self, src: Tensor, need_weights: bool = False, padded: bool = True) -> EncoderOutput:
        """src (B,S) ids -> EncoderOutput(memory (B,S,D), src_pad (B,S)). ``padded=False``: the caller
        knows that src holds no padding (``Batch.src_padded``), so no attention takes a key mask (the
        fused attention may then take its flash kernel)."""
        x = self._embed(src, self.src_embed, self.src_pos, 0, "src")
        src_pad = src.eq(self.cfg.pad_id)
        mask = key_mask(src_pad) if padded else None  # (B,1,1,S), made once for every layer
        weights = [] if need_weights else None
        for layer in self.encoder_layers:
            x, w = layer(x, mask, need_weights)
            if need_weights:
                weights.append(w)
        return EncoderOutput(self.encoder_norm(x), src_pad, weights, padded)

    # -- decoder ------------------------------------------------------------------------
    def decode(self, tgt_in: Tensor, enc: EncoderOutput | None = None, cache: IncrementalState | None = None,
               need_weights: bool = False) -> DecoderOutput:
        """Decoder stack and output projection.

        Teacher-forced: ``decode(tgt_in (B,T), enc)`` -> logits (B,T,V).
        Incremental: ``decode(tokens (N,t), cache=cache)`` appends t positions (usually 1) at
        position ``cache.length`` and returns logits (N,t,V) and the advanced cache. The cache
        holds the encoder-side keys/values, so ``enc`` is not needed.
        """
        x, w_self, w_cross = self._decoder_stack(tgt_in, enc, cache, need_weights)
        return DecoderOutput(self.output_logits(x), cache, w_self, w_cross)

    def _decoder_stack(self, tgt_in: Tensor, enc: EncoderOutput | None, cache: IncrementalState | None,
                       need_weights: bool) -> tuple[Tensor, list | None, list | None]:
        """``decode`` up to the pre-softmax projection: the normalized states (B,T,D) and the
        attention weights when asked for; advances ``cache`` where given."""
        x = self._embed(tgt_in, self.tgt_embed, self.tgt_pos, 0 if cache is None else cache.length, "tgt_in")
        if cache is None:
            if enc is None:
                raise ValueError("decode needs the encoder output or a cache")
            if enc.memory.size(0) not in (1, len(tgt_in)):  # (one encoder row is broadcast over them all)
                raise UserError(f"tgt_in: {len(tgt_in)} rows for an encoder output of {enc.memory.size(0)} (as many, or one)")
            memory_mask = key_mask(enc.src_pad) if enc.padded else None  # (B,1,1,S)
            kv = [TeacherForced(*layer.cross_attn.project_kv(enc.memory), memory_mask) for layer in self.decoder_layers]
        else:
            kv = cache.attention()
        w_self = [] if need_weights else None
        w_cross = [] if need_weights else None
        for layer, layer_kv in zip(self.decoder_layers, kv):
            x, ws, wc = layer(x, layer_kv, need_weights)
            if need_weights:
                w_self.append(ws)
                w_cross.append(wc)
        if cache is not None:
            cache.length += tgt_in.size(1)
        return self.decoder_norm(x), w_self, w_cross

    def forward(self, src: Tensor, tgt_in: Tensor, project: bool = True, src_padded: bool = True) -> Tensor | PreSoftmax:
        """Teacher-forced logits: src (B,S), tgt_in (B,T) -> (B,T,V); with ``project=False`` the
        projection's inputs instead (``PreSoftmax``), for ``train.fused_loss``. ``src_padded=False``:
        src holds no padding (``Batch.src_padded``; ``encode``)."""
        enc = self.encode(src, padded=src_padded)
        if project:
            return self.decode(tgt_in, enc).logits
        return self.pre_softmax(self._decoder_stack(tgt_in, enc, None, False)[0])


def count_parameters(model: nn.Module) -> int:
    """Trainable parameters, each shared matrix counted once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def count_preset_parameters(cfg: ModelConfig) -> int:
    """Exact count for a config, built on the meta device (no memory, instant)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return count_parameters(model)
