"""Float32 linear maps with their weights packed once for oneDNN: decoding on the CPU.

Why: at a beam-search step every linear map multiplies a few hundred rows (sentences x beams) by a
fixed weight. PyTorch's float32 ``linear`` on the CPU calls MKL's sgemm, which lays the weight out for
its kernels at every call; oneDNN (in PyTorch as ``torch.ops.mkldnn``) can lay it out once, in its
blocked format (``_reorder_linear_weight``), and multiply from that (``_linear_pointwise``). For the
small model's 8,000-word output projection at 128 rows that measured 1.3-1.6x faster on the AVX-512
EPYC of BENCHMARKS.md (§2, session 20), and 1.1-1.2x for the 256- and 1,024-wide maps. The products
are the same up to the order of the float32 additions (about 1e-5 apart; tested).

``packed_copy(model)`` is the decoding copy that ``model_for_precision`` makes for precision fp32 when
``DecodeConfig.packed_weights`` asks for it: every ``nn.Linear`` becomes a ``PackedLinear``, and a
tied pre-softmax projection (§3.4) gets one over the embedding matrix (the same tensor). A
``PackedLinear`` keeps its float32 weight as a parameter and packs it on first use in each process: a
packed tensor cannot be copied or pickled, so a copy (``deepcopy``, a decoding worker) packs its own.
Inputs it does not take (not float32, not on the CPU, under autocast) go through ``F.linear``.
The copy's feed-forward layers (Eq. 2) become ``PackedFeedForward``: the max(0, .) runs inside the first
product (oneDNN's relu post-op) instead of as a separate pass over the (N, d_ff) activations, which a
profile of the small model's fp32 beam step measured at 1.3% of the step (BENCHMARKS.md §2, session 27).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.model.layers import FeedForward


def available() -> bool:
    """Whether this PyTorch build has oneDNN's packed linear operations."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return callable(torch.ops.mkldnn._reorder_linear_weight) and callable(torch.ops.mkldnn._linear_pointwise)
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(nn.Module):
    """y = x W^T + b, W (O, I) float32 on the CPU, multiplied from oneDNN's packed copy of W; with
    ``relu``, max(0, y) (the first half of Eq. 2), applied by oneDNN as it writes y."""

    def __init__(self, weight: nn.Parameter | Tensor, bias: nn.Parameter | Tensor | None = None, relu: bool = False):
        super().__init__()
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError("PackedLinear: a float32 CPU weight")
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias
        self.relu = relu
        self._packed: Tensor | None = None  # oneDNN's layout of weight, made on first use

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> "PackedLinear":
        return cls(lin.weight, lin.bias)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_packed"] = None  # opaque oneDNN storage: the receiver packs its own
        return state

    def forward(self, x: Tensor) -> Tensor:  # (..., I) -> (..., O)
        if x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_autocast_enabled("cpu"):
            y = F.linear(x, self.weight, self.bias)
            return F.relu(y) if self.relu else y
        if self._packed is None:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "relu" if self.relu else "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.weight.size(1)}, out_features={self.weight.size(0)}, bias={self.bias is not None}"
                + (", relu=True" if self.relu else ""))


class PackedFeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (Eq. 2) of a decoding copy: ``FeedForward``'s parameters (same
    names), the max fused into the first product. No dropout: a decoding copy does not train."""

    def __init__(self, ffn: FeedForward):
        super().__init__()
        self.w1 = PackedLinear(ffn.w1.weight, ffn.w1.bias, relu=True)
        self.w2 = PackedLinear.from_linear(ffn.w2)

    def forward(self, x: Tensor) -> Tensor:  # (..., d_model) -> (..., d_model)
        if self.training:
            raise RuntimeError("PackedFeedForward is for decoding copies, which do not train")
        return self.w2(self.w1(x))


def packed_copy(model: nn.Module) -> nn.Module:
    """A decoding copy of a float32 CPU Transformer whose linear maps are ``PackedLinear`` (module
    docstring); the caller's model is left as it was."""
    out = copy.deepcopy(model).eval()
    for parent in list(out.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, FeedForward):
                setattr(parent, name, PackedFeedForward(child))
            elif isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear.from_linear(child))
    if getattr(out, "out_proj", False) is None:  # tied pre-softmax projection (§3.4): the embedding matrix
        out.out_proj = PackedLinear(out.tgt_embed.weight)
    for p in out.parameters():
        p.requires_grad_(False)
    return out.eval()  # the new modules too
