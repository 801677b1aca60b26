"""Float32 linear maps with their weights packed once: decoding on the CPU.

Why: at a beam-search step every linear map multiplies a few hundred rows (sentences x beams) by a
fixed weight. PyTorch's float32 ``linear`` on the CPU calls MKL's sgemm, which lays the weight out for
its kernels at every call. Two libraries in PyTorch can lay it out once and multiply from that:
- oneDNN (``torch.ops.mkldnn``: ``_reorder_linear_weight``, ``_linear_pointwise``), in its blocked
  format, multiplying from the layout made once where ``linear`` makes it at every call
  (BENCHMARKS.md §3, "What each decoding choice is worth": packed weights).
- MKL's packed sgemm (``torch.ops.mkl``: ``_mkl_reorder_linear_weight``, ``_mkl_linear``, what
  PyTorch's own compiler uses for frozen float32 linear maps), the same kernels as ``linear`` without
  the per-call layout; on an Intel CPU it costs less a call than oneDNN's (BENCHMARKS.md §3: MKL's
  packing on an Intel CPU).
``packed_library`` "auto" takes MKL's on Intel CPUs (MKL's home) and oneDNN's elsewhere. The products
are those of ``linear`` up to the order of the float32 additions (about 1e-5 apart; tested). MKL packs
the weight for a row count (``_mkl_linear`` multiplies from the packed copy only when told that count,
else it calls ``linear``): the packed layout does not depend on it (the same size for any count;
products for 1 to 513 rows tested against ``linear``), so each call passes its own row count.

``packed_copy(model)`` is the decoding copy that ``model_for_precision`` makes for precision fp32 when
``DecodeConfig.packed_weights`` asks for it: every ``nn.Linear`` becomes a ``PackedLinear``, and a
tied pre-softmax projection (§3.4) gets one over the embedding matrix (the same tensor). A
``PackedLinear`` keeps its float32 weight as a parameter and packs it on first use in each process: a
packed tensor cannot be copied or pickled, so a copy (``deepcopy``, a decoding worker) packs its own.
Inputs it does not take (not float32, not on the CPU, under autocast) go through ``F.linear``.
The copy's feed-forward layers (Eq. 2) become ``PackedFeedForward``: the max(0, .) runs inside the first
product with oneDNN (its relu post-op) instead of as a separate pass over the (N, d_ff) activations;
with MKL, in place on the product.

oneDNN builds and keeps a kernel for every row count M it multiplies (MKL's packed product keeps none),
and a translator sees nearly every M up to its batch's rows: a long-running one grew by the kernels of
each new count. Its ``PackedLinear`` pads M with zero rows to keep ``row_bits`` leading bits
(``DecodeConfig.cpu_row_bits``; ``aiayn.execution.linear.padded_rows``), as bfloat16's maps do, so the
kernels are those of a bounded set of counts; each output row is its input row's product as before.
"""
from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.decode.config import PACKED_LIBRARIES as LIBRARIES
from aiayn.execution.linear import padded_rows
from aiayn.model.layers import FeedForward

_MKL_PACK_ROWS = 128  # the row count MKL is told at packing: beam 4 x 32 sentences (module docstring)


def available(library: str = "onednn") -> bool:
    """Whether this PyTorch build has the packed linear operations of ``library`` (mkl or onednn)."""
    try:
        if library == "mkl":
            return (torch.backends.mkl.is_available() and callable(torch.ops.mkl._mkl_reorder_linear_weight)
                    and callable(torch.ops.mkl._mkl_linear))
        if library == "onednn":
            return (torch.backends.mkldnn.is_available() and callable(torch.ops.mkldnn._reorder_linear_weight)
                    and callable(torch.ops.mkldnn._linear_pointwise))
    except (AttributeError, RuntimeError):
        return False
    raise ValueError(f"packed library must be one of {LIBRARIES}, got {library!r}")


@functools.lru_cache(maxsize=None)
def _cpu_vendor() -> str:
    """The CPU's vendor id from /proc/cpuinfo (GenuineIntel, AuthenticAMD, ...), or "" elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def resolve_library(library: str) -> str | None:
    """The library that ``packed_library`` names, "auto" resolved (module docstring), if this PyTorch
    has it; else None (no packing)."""
    if library == "auto":
        order = ("mkl", "onednn") if _cpu_vendor() == "GenuineIntel" else ("onednn", "mkl")
        return next((lib for lib in order if available(lib)), None)
    return library if available(library) else None


class PackedLinear(nn.Module):
    """y = x W^T + b, W (O, I) float32 on the CPU, multiplied from ``library``'s packed copy of W (mkl or
    onednn); with ``relu``, max(0, y) (the first half of Eq. 2), applied by oneDNN as it writes y, or
    in place after MKL's product. ``row_bits``: oneDNN's row counts padded to keep that many leading
    bits (module docstring); 0 = none."""

    def __init__(self, weight: nn.Parameter | Tensor, bias: nn.Parameter | Tensor | None = None, relu: bool = False,
                 library: str = "onednn", row_bits: int = 0):
        super().__init__()
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError("PackedLinear: a float32 CPU weight")
        if library not in LIBRARIES:
            raise ValueError(f"PackedLinear: library must be one of {LIBRARIES}, got {library!r}")
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias
        self.relu = relu
        self.library = library
        self.row_bits = row_bits
        self._packed: Tensor | None = None  # the library's layout of weight, made on first use

    @classmethod
    def from_linear(cls, lin: nn.Linear, library: str = "onednn", row_bits: int = 0) -> "PackedLinear":
        return cls(lin.weight, lin.bias, library=library, row_bits=row_bits)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_packed"] = None  # the library's opaque storage: the receiver packs its own
        return state

    def forward(self, x: Tensor) -> Tensor:  # (..., I) -> (..., O)
        if x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_autocast_enabled("cpu"):
            y = F.linear(x, self.weight, self.bias)
            return F.relu(y) if self.relu else y
        if self.library == "mkl":
            return self._mkl(x)
        return self._onednn(x)

    def _onednn(self, x: Tensor) -> Tensor:  # (..., I) -> (..., O)
        if self._packed is None:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
        rows = x.reshape(-1, x.size(-1))  # (M, I)
        M = rows.size(0)
        extra = padded_rows(M, self.row_bits) - M
        if extra:
            rows = F.pad(rows, (0, 0, 0, extra))  # (M + extra, I): zero rows (module docstring)
        y = torch.ops.mkldnn._linear_pointwise(rows, self._packed, self.bias, "relu" if self.relu else "none",
                                               [], "")  # (M + extra, O)
        return y[:M].view(*x.shape[:-1], y.size(-1))

    def _mkl(self, x: Tensor) -> Tensor:  # (..., I) -> (..., O)
        if self._packed is None:
            with torch.no_grad():  # the row count packed for does not matter (module docstring)
                self._packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight.detach(), _MKL_PACK_ROWS)
        rows = x.reshape(-1, x.size(-1))  # (M, I)
        y = torch.ops.mkl._mkl_linear(rows, self._packed, self.weight, self.bias, rows.size(0))  # (M, O)
        if self.relu:
            y.relu_()
        return y.view(*x.shape[:-1], y.size(-1))

    def extra_repr(self) -> str:
        return (f"in_features={self.weight.size(1)}, out_features={self.weight.size(0)}, bias={self.bias is not None}, "
                f"library={self.library}" + (", relu=True" if self.relu else "")
                + (f", row_bits={self.row_bits}" if self.row_bits and self.library == "onednn" else ""))


class PackedFeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (Eq. 2) of a decoding copy: ``FeedForward``'s parameters (same
    names), the max fused into the first product; another activation (``ModelConfig.activation``)
    is applied after it. No dropout: a decoding copy does not train."""

    def __init__(self, ffn: FeedForward, library: str = "onednn", row_bits: int = 0):
        super().__init__()
        relu = ffn.activation == "relu"
        self.w1 = PackedLinear(ffn.w1.weight, ffn.w1.bias, relu=relu, library=library, row_bits=row_bits)
        self.w2 = PackedLinear.from_linear(ffn.w2, library, row_bits)
        self.act = None if relu else ffn.act

    def forward(self, x: Tensor) -> Tensor:  # (..., d_model) -> (..., d_model)
        if self.training:
            raise RuntimeError("PackedFeedForward is for decoding copies, which do not train")
        h = self.w1(x)
        return self.w2(h if self.act is None else self.act(h))


def packed_copy(model: nn.Module, library: str = "onednn", row_bits: int = 0) -> nn.Module:
    """A decoding copy of a float32 CPU Transformer whose linear maps are ``PackedLinear`` of ``library``
    (mkl or onednn; module docstring), oneDNN's rows padded to keep ``row_bits`` leading bits; the
    caller's model is left as it was."""
    out = copy.deepcopy(model).eval()
    for parent in list(out.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, FeedForward):
                setattr(parent, name, PackedFeedForward(child, library, row_bits))
            elif isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear.from_linear(child, library, row_bits))
    if getattr(out, "out_proj", False) is None:  # tied pre-softmax projection (§3.4): the embedding matrix
        out.out_proj = PackedLinear(out.tgt_embed.weight, library=library, row_bits=row_bits)
    for p in out.parameters():
        p.requires_grad_(False)
    return out.eval()  # the new modules too
