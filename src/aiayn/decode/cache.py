"""The decoder's incremental state (``init_cache``): an explicit object, passed in and returned (never hidden
in module attributes); ``Transformer.decode(tokens, cache=cache)`` takes a step with it.

Shapes: N rows (sentences x beams), H heads, S source length, K d_k, Dv d_v, Tmax capacity.

- Encoder-decoder keys/values are computed once per sentence (``cross_k``/``cross_v``).
- Self-attention keys/values live in buffers preallocated for ``Tmax`` steps; a step writes
  position ``length`` and advances it. Positions for the positional encoding come from
  ``length``.
- ``reorder(indices)`` selects rows (beam search reorders beams and drops finished
  sentences); only the filled part of the self-attention buffers is copied.
- Shared beam slots (``ancestors`` set; beam search, see ``DecoderCache``): reordering the
  beams of a sentence moves integers, not keys and values.
- ``DecoderCache.attention()`` gives each decoder layer a ``CachedLayer``: its two attentions at
  this step (§3.2.3), with the keys and values kept as the cache keeps them, through the C kernels
  where they apply.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from aiayn.errors import UserError
from aiayn.model.attention import MultiHeadAttention, key_mask

if TYPE_CHECKING:
    from aiayn.kernels.loader import Kernels
    from aiayn.model.transformer import EncoderOutput, Transformer


@dataclass
class LayerCache:
    self_k: Tensor  # (N,H,Tmax,K)
    self_v: Tensor  # (N,H,Tmax,Dv)
    cross_k: Tensor  # (N,H,S,K)
    cross_v: Tensor  # (N,H,S,Dv)


@dataclass
class DecoderCache:
    """Per-layer buffers. With ``group`` g > 1 the encoder-side tensors hold one row per g
    decoder rows (decoder row r attends to encoder row r // g): beam search keeps the g = K
    beams of a sentence together, so the sentence's cross keys/values are stored and read
    once, and its K queries go through one attention call instead of K."""

    layers: list[LayerCache]
    src_pad: Tensor  # (N/g,S) bool, True at padding
    length: int  # steps decoded so far = position of the next token
    group: int = 1  # decoder rows per encoder-side row
    # Shared beam slots (set by beam search, group g > 1): the self-attention buffers hold, per
    # sentence, g slots per position, (N/g, H, Tmax*g, K) with position j of slot b at index
    # j*g + b; ancestors[s, r, j] (N/g, g, Tmax) is the slot that holds position j of row
    # s*g + r's prefix. Reordering the beams of a sentence gathers ``ancestors`` only; each row
    # attends to all g*length keys of its sentence through ``self_mask``, which keeps exactly
    # its own prefix's keys (one per position). Same Eq. 1, no key/value copies.
    ancestors: Tensor | None = None
    # With shared slots, the C kernels that compute the step's attention (kernels/loader.py), or None
    # for PyTorch's; caches made from this one keep them.
    kernels: "Kernels | None" = None
    _mask: Tensor | None = field(default=None, repr=False)  # self_mask() of length _mask_length
    _mask_length: int = field(default=-1, repr=False)

    @property
    def capacity(self) -> int:
        if not self.layers:
            return 0
        return self.layers[0].self_k.size(2) // (self.group if self.ancestors is not None else 1)

    @property
    def shared_slots(self) -> bool:
        return self.ancestors is not None

    def attention(self) -> list["CachedLayer"]:
        """Each layer's attention at this step (``CachedLayer``), sharing one source key mask."""
        mask = key_mask(self.src_pad)  # (N/g,1,1,S)
        return [CachedLayer(self, i, mask) for i in range(len(self.layers))]

    def step_kernels(self, q: Tensor, need_weights: bool) -> "Kernels | None":
        """The C kernels when this step's attention can use them: shared beam slots, one new position,
        no weights asked for, no autocast (whose float32 attention they do not mimic), and tensors they
        handle (``Kernels.supports``); else None (PyTorch's attention). q (N,H,t,K)."""
        kernels = self.kernels if self.shared_slots else None
        if (kernels is None or need_weights or q.size(2) != 1 or torch.is_autocast_enabled(q.device.type)
                or not kernels.supports(q, self.layers[0].self_k, self.layers[0].cross_k)):
            return None
        return kernels

    def append(self, i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write new self-attention keys/values (N,H,t,K) of layer i at position ``length``;
        return the filled keys/values (N,H,length+t,K) to attend over."""
        if self.ancestors is not None:
            return self._append_shared(i, k, v)
        layer = self.layers[i]
        t = k.size(2)
        end = self.length + t
        if end > self.capacity:
            self._grow(max(end, 2 * self.capacity))
            layer = self.layers[i]
        layer.self_k[:, :, self.length:end] = k
        layer.self_v[:, :, self.length:end] = v
        return layer.self_k[:, :, :end], layer.self_v[:, :, :end]

    def _append_shared(self, i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Shared slots: write row s*g + r's new key/value (N,H,1,K) at position ``length``
        of slot r; return all filled slots (N/g,H,(length+1)*g,K)."""
        if k.size(2) != 1:
            raise ValueError("a cache with shared beam slots takes one position per step")
        keys, values = self.slots(i)
        L, g = self.length, self.group
        layer = self.layers[i]
        Bs, H, K, Dv = self.src_pad.size(0), k.size(1), k.size(3), v.size(3)
        layer.self_k.view(Bs, H, -1, g, K)[:, :, L] = k.view(Bs, g, H, K).transpose(1, 2)
        layer.self_v.view(Bs, H, -1, g, Dv)[:, :, L] = v.view(Bs, g, H, Dv).transpose(1, 2)
        return keys, values

    def slots(self, i: int) -> tuple[Tensor, Tensor]:
        """Shared slots: ``append``'s work but the copy. Room for position ``length`` in layer i (and, at
        layer 0, each row's slot there recorded as its own in ``ancestors``); returns the slots
        (N/g,H,(length+1)*g,K) with position ``length``'s still to be written by the caller: ``append``
        does, and the C kernel as it attends (``Kernels.self_attention`` with new_k, new_v)."""
        L, g = self.length, self.group
        if L + 1 > self.capacity:
            self._grow(max(L + 1, 2 * self.capacity))
        layer = self.layers[i]
        if i == 0:  # position L of row r is its own slot r (self_mask, own_weights and the C kernel read it)
            self.ancestors[:, :, L] = torch.arange(g, device=self.ancestors.device)
        end = (L + 1) * g
        return layer.self_k[:, :, :end], layer.self_v[:, :, :end]

    def self_mask(self) -> Tensor:
        """Shared slots: (N/g,1,g,(length+1)*g) bool, True where row s*g + r may attend: at each
        position j <= length, the one slot holding its prefix (itself at ``length``, which ``append``
        wrote into ``ancestors``)."""
        L, g = self.length, self.group
        if self._mask_length != L:
            anc = self.ancestors
            slots = torch.arange(g, device=anc.device)
            self._mask = (anc[:, :, : L + 1, None] == slots).view(anc.size(0), 1, g, (L + 1) * g)
            self._mask_length = L
        return self._mask

    def own_weights(self, weights: Tensor) -> Tensor:
        """Shared slots: attention weights (N/g,H,g,(length+1)*g) over all slots -> each row's
        weights over its own prefix (N,H,1,length+1), as the unshared cache gives them."""
        L, g = self.length, self.group
        Bs, H = weights.shape[:2]
        pos = torch.arange(L + 1, device=weights.device) * g + self.ancestors[:, :, : L + 1]  # (N/g,g,L+1)
        own = weights.gather(3, pos[:, None].expand(Bs, H, g, L + 1))  # (N/g,H,g,L+1)
        return own.transpose(1, 2).reshape(Bs * g, H, 1, L + 1)

    def unshared(self) -> "DecoderCache":
        """Shared slots -> the plain layout: one (N,H,Tmax,K) row per decoder row, holding its
        own prefix's keys/values (the same numbers, copied)."""
        if self.ancestors is None:
            return self
        L, g, cap = self.length, self.group, self.capacity
        Bs = self.src_pad.size(0)
        anc = self.ancestors[:, :, :L]
        layers = []
        for lc in self.layers:
            plain = []
            for buf in (lc.self_k, lc.self_v):
                H, D = buf.size(1), buf.size(3)
                out = buf.new_zeros(Bs * g, H, cap, D)
                if L:
                    filled = buf[:, :, : L * g].view(Bs, H, L, g, D)
                    idx = anc.transpose(1, 2)[:, None, :, :, None].expand(Bs, H, L, g, D)  # (Bs,H,L,g,D)
                    own = filled.gather(3, idx)  # [s,h,j,r] = slot anc[s,r,j] at position j
                    out[:, :, :L] = own.permute(0, 3, 1, 2, 4).reshape(Bs * g, H, L, D)
                plain.append(out)
            layers.append(LayerCache(plain[0], plain[1], lc.cross_k, lc.cross_v))
        return DecoderCache(layers, self.src_pad, L, g, kernels=self.kernels)

    def _grow(self, capacity: int) -> None:
        """Room for ``capacity`` positions; the filled part is kept (with shared slots, g
        entries per position, and the ancestor table too)."""
        f = self.group if self.ancestors is not None else 1  # buffer entries per position
        filled = self.length * f
        for layer in self.layers:
            for name in ("self_k", "self_v"):
                old = getattr(layer, name)
                new = old.new_zeros(old.size(0), old.size(1), capacity * f, old.size(3))
                new[:, :, :filled] = old[:, :, :filled]
                setattr(layer, name, new)
        if self.ancestors is not None:
            anc = self.ancestors.new_zeros(self.ancestors.size(0), f, capacity)
            anc[:, :, : self.length] = self.ancestors[:, :, : self.length]
            self.ancestors = anc

    def reorder(self, indices: Tensor) -> "DecoderCache":
        """Rows ``indices`` (N',) of every tensor, in that order (beams may repeat a row).

        The plain path: the result has one encoder-side row per decoder row (group 1)."""
        if self.ancestors is not None:
            return self.unshared().reorder(indices)
        L = self.length
        enc_rows = indices // self.group  # (N',) encoder-side row of each new row
        layers = []
        for layer in self.layers:
            self_k = layer.self_k.new_empty((indices.numel(),) + tuple(layer.self_k.shape[1:]))
            self_v = layer.self_v.new_empty((indices.numel(),) + tuple(layer.self_v.shape[1:]))
            if L:
                self_k[:, :, :L].copy_(layer.self_k[:, :, :L].index_select(0, indices))
                self_v[:, :, :L].copy_(layer.self_v[:, :, :L].index_select(0, indices))
            layers.append(LayerCache(self_k, self_v,
                                     layer.cross_k.index_select(0, enc_rows),
                                     layer.cross_v.index_select(0, enc_rows)))
        return DecoderCache(layers, self.src_pad.index_select(0, enc_rows), L, kernels=self.kernels)


def group_rows(q: Tensor, g: int) -> Tensor:
    """Queries (N,H,t,K) of g consecutive rows that share an encoder row (and, with shared beam
    slots, self-attention slots) -> g*t queries of one row (N/g,H,g*t,K)."""
    if g == 1:
        return q
    N, H, t, K = q.shape
    return q.view(N // g, g, H, t, K).transpose(1, 2).reshape(N // g, H, g * t, K)


class CachedLayer:
    """Layer i's two attentions at a decoding step (§3.2.3), for ``DecoderLayer.forward``: the new
    position(s)' self-attention keys/values are appended to the cache and attended over with those
    before them; the encoder-decoder keys/values are the cache's, computed once per sentence. The
    g rows of a sentence (``DecoderCache.group``) attend to its encoder row in one call, and, with
    shared beam slots, to its slots: through the C kernels (kernels/loader.py) where
    ``DecoderCache.step_kernels`` allows, else through ``MultiHeadAttention.attend``."""

    def __init__(self, cache: DecoderCache, i: int, memory_mask: Tensor):
        self.cache, self.i = cache, i
        self.memory_mask = memory_mask  # (N/g,1,1,S)

    def self_attention(self, attn: MultiHeadAttention, x: Tensor, need_weights: bool):
        """x (N,t,D) -> (N,t,D), weights (N,H,t,length+t) | None."""
        c, g = self.cache, self.cache.group
        if x.size(0) != c.src_pad.size(0) * g:  # (else a shape error from inside the buffers' writes)
            raise UserError(f"tokens: {x.size(0)} rows for a cache of {c.src_pad.size(0) * g} (the encoder output's "
                            "rows, or the indices of its last reorder)")
        q, k, v = attn.project_qkv(x)
        kernels = c.step_kernels(q, need_weights)
        if kernels is not None:  # shared slots, through the C kernel, which appends k, v as it attends
            slot_k, slot_v = c.slots(self.i)  # (N/g,H,(L+1)g,K)
            return attn.out_proj(kernels.self_attention(q, slot_k, slot_v, c.ancestors, g, k, v))[:, None], None
        k, v = c.append(self.i, k, v)  # (N,H,length+t,K), or shared slots (N/g,H,(length+1)g,K)
        if not c.shared_slots:  # a chunk of t > 1 new positions stays causal
            return attn.attend(q, k, v, None, is_causal=q.size(2) > 1, need_weights=need_weights)
        a, w = attn.attend(group_rows(q, g), k, v, c.self_mask(), need_weights=need_weights)  # (N/g,g,D)
        return a.reshape(q.size(0), 1, a.size(-1)), None if w is None else c.own_weights(w)

    def cross_attention(self, attn: MultiHeadAttention, x: Tensor, need_weights: bool):
        """x (N,t,D) -> (N,t,D), weights (N,H,t,S) | None."""
        c, g, layer = self.cache, self.cache.group, self.cache.layers[self.i]
        q = attn.project_q(x)  # (N,H,t,K)
        kernels = c.step_kernels(q, need_weights)
        if kernels is not None:
            return attn.out_proj(kernels.cross_attention(q, layer.cross_k, layer.cross_v, c.src_pad, g))[:, None], None
        a, w = attn.attend(group_rows(q, g), layer.cross_k, layer.cross_v, self.memory_mask, need_weights=need_weights)
        if g == 1:
            return a, w
        N, H, t, _ = q.shape  # (N/g, g*t, D) -> (N,t,D)
        w = None if w is None else w.view(N // g, H, g, t, w.size(-1)).transpose(1, 2).reshape(N, H, t, w.size(-1))
        return a.reshape(N, t, a.size(-1)), w


def share_slots(layers: list[LayerCache], src_pad: Tensor, group: int, capacity: int,
                kernels: "Kernels | None" = None) -> DecoderCache:
    """An empty cache with shared beam slots: ``group`` rows per sentence of ``src_pad`` (N/g,S),
    room for ``capacity`` positions; ``layers`` give the encoder-side keys/values (N/g rows);
    ``kernels`` (or None) compute its attention."""
    Bs = src_pad.size(0)
    out = []
    for lc in layers:
        H = lc.cross_k.size(1)
        self_k = lc.cross_k.new_empty(Bs, H, capacity * group, lc.self_k.size(3))
        self_v = lc.cross_v.new_empty(Bs, H, capacity * group, lc.self_v.size(3))
        out.append(LayerCache(self_k, self_v, lc.cross_k, lc.cross_v))
    ancestors = torch.zeros(Bs, group, capacity, dtype=torch.long, device=src_pad.device)
    return DecoderCache(out, src_pad, 0, group, ancestors, kernels)


def first_capacity(max_len: int, src_len: int) -> int:
    """Positions a new cache holds before it first grows: what a translation of ``src_len`` source
    positions is likely to need, not ``max_len``, which may be a model's every position (1,024):
    buffers of that size would be allocated, copied and reordered at every step of every sentence."""
    return max(1, min(max_len, 2 * src_len + 16))


def init_cache(model: "Transformer", enc: "EncoderOutput", max_len: int) -> DecoderCache:
    """An empty cache for ``model``'s decoder over ``enc``: encoder-decoder keys/values computed once,
    self-attention buffers for up to ``max_len`` positions, allocated for ``first_capacity`` of them
    and doubled when needed (``DecoderCache.append``, ``slots``)."""
    layers = []
    N = enc.memory.size(0)
    max_len = first_capacity(max_len, enc.memory.size(1))
    for layer in model.decoder_layers:
        k, v = layer.cross_attn.project_kv(enc.memory)
        H = layer.self_attn.n_heads
        # Unwritten positions are never read (attention takes the filled part), so nothing is zeroed;
        # beam search replaces these buffers with shared slots before its first step anyway.
        self_k = k.new_empty(N, H, max_len, layer.self_attn.d_k)
        self_v = v.new_empty(N, H, max_len, layer.self_attn.d_v)
        layers.append(LayerCache(self_k, self_v, k, v))
    return DecoderCache(layers, enc.src_pad, 0)
