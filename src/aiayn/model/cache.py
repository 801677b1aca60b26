"""The decoder's incremental state: an explicit object, passed in and returned (STYLE.md habit 3).

Shapes: N rows (sentences x beams), H heads, S source length, K d_k, Dv d_v, Tmax capacity.

- Encoder-decoder keys/values are computed once per sentence (``cross_k``/``cross_v``).
- Self-attention keys/values live in buffers preallocated for ``Tmax`` steps; a step writes
  position ``length`` and advances it. Positions for the positional encoding come from
  ``length``.
- ``reorder(indices)`` selects rows (beam search reorders beams and drops finished
  sentences); only the filled part of the self-attention buffers is copied.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


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

    @property
    def capacity(self) -> int:
        return self.layers[0].self_k.size(2) if self.layers else 0

    @property
    def batch_size(self) -> int:
        return self.src_pad.size(0) * self.group

    def append(self, i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write new self-attention keys/values (N,H,t,K) of layer i at position ``length``;
        return the filled keys/values (N,H,length+t,K) to attend over."""
        layer = self.layers[i]
        t = k.size(2)
        end = self.length + t
        if end > self.capacity:
            self._grow(max(end, 2 * self.capacity))
            layer = self.layers[i]
        layer.self_k[:, :, self.length:end] = k
        layer.self_v[:, :, self.length:end] = v
        return layer.self_k[:, :, :end], layer.self_v[:, :, :end]

    def _grow(self, capacity: int) -> None:
        for layer in self.layers:
            for name in ("self_k", "self_v"):
                old = getattr(layer, name)
                new = old.new_zeros(old.size(0), old.size(1), capacity, old.size(3))
                new[:, :, : old.size(2)] = old
                setattr(layer, name, new)

    def reorder(self, indices: Tensor) -> "DecoderCache":
        """Rows ``indices`` (N',) of every tensor, in that order (beams may repeat a row).

        The plain path: the result has one encoder-side row per decoder row (group 1)."""
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
        return DecoderCache(layers, self.src_pad.index_select(0, enc_rows), L)
