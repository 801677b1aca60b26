"""int8 decoding (``DecodeConfig.precision = "int8"``): the model's linear maps in 8-bit integers.

Every linear map of a decoding copy of the model (W^Q/W^K/W^V and W^O of §3.2.2, W_1 and W_2 of
Eq. 2, and the pre-softmax projection of §3.4, the shared embedding matrix when it is tied)
becomes an ``Int8Linear``:

    W ≈ s_W · W_q    W_q int8 (O, I), s_W (O,) = max_i |W[o, i]| / 127     (per output channel, once)
    x ≈ s_x · x_q    x_q int8 (N, I), s_x (N,) = max_i |x[n, i]| / 127     (per row, at every call)
    y = s_x s_W ⊙ (x_q W_qᵀ) + b                                           (int32 accumulation, exact)

Both scales are symmetric (no zero point), so the integer product is one ``torch._int_mm`` (oneDNN's
int8 GEMM; VNNI on CPUs that have it). Each row of x is quantized on its own, so a sentence's
translation does not depend on which other sentences share its batch (batched = single, tested);
PyTorch's dynamic quantization scales the whole batch with one number and would not give that.
Embeddings, LayerNorm, the softmax of Eq. 1 and the log-probabilities stay in float32. CPU only:
on a GPU use ``precision bf16``. The BLEU this costs is measured in BENCHMARKS.md §4.

``precision = "int8-bf16"`` keeps the same int8 linear maps but runs everything between them in
bfloat16: the residual stream, LayerNorm and the attention core of Eq. 1 (QKᵀ, softmax, ·V), which
is the other half of decoding time once the linear maps are int8 (BENCHMARKS.md §3). Each
``Int8Linear`` then returns bfloat16, except the pre-softmax projection, whose logits stay float32
for the log-probabilities. Worth it on CPUs with bf16 instructions (AVX512-BF16, AMX).
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from aiayn.errors import UserError

if TYPE_CHECKING:
    from aiayn.kernels.loader import Kernels

_TINY = 1e-12  # scale floor, so an all-zero row or output channel quantizes to zeros, not NaNs


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8: x (N, I) float -> (x_q (N, I) int8, s (N, 1) float32), x ≈ s · x_q.
    A bfloat16 x is not copied to float32 first: its row maxima are exact in bfloat16, and x / s
    promotes each element to float32 on the way, so the result is the same as for x.float()."""
    s = x.abs().amax(dim=1, keepdim=True).float().clamp_min(_TINY) / 127.0  # (N,1)
    return torch.div(x, s).round_().to(torch.int8), s


class Int8Linear(nn.Module):
    """A linear map y = x Wᵀ + b with int8 weights and int8 row-quantized inputs (module docstring).
    With ``kernels`` (kernels/loader.py) the quantization and the rescaling are one C loop each, with
    the same results."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None, out_dtype: torch.dtype = torch.float32,
                 kernels: "Kernels | None" = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.out_dtype = out_dtype
        self.kernels = kernels
        w_q, s_w = quantize_rows(weight.detach())  # per output channel: the rows of W (O, I)
        self.register_buffer("w_q", w_q, persistent=False)  # (O,I) int8
        self.register_buffer("s_w", s_w.squeeze(1), persistent=False)  # (O,)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone(), persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, out_dtype: torch.dtype = torch.float32,
                    kernels: "Kernels | None" = None) -> "Int8Linear":
        return cls(linear.weight, linear.bias, out_dtype, kernels)

    def forward(self, x: Tensor) -> Tensor:
        """x (..., I) -> (..., O) in out_dtype (the products and the rescaling in float32)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # (N,I)
        fast = self.kernels is not None and self.kernels.supports_rows(x2)
        x_q, s_x = self.kernels.quantize_rows(x2) if fast else quantize_rows(x2)  # (N,I), (N,1)
        acc = torch._int_mm(x_q, self.w_q.t())  # (N,O) int32, exact
        if fast:
            return self.kernels.rescale(acc, s_x, self.s_w, self.bias, self.out_dtype).view(*lead, self.out_features)
        y = (acc * self.s_w).mul_(s_x)  # float32
        if self.bias is not None:
            y.add_(self.bias)
        return y.to(self.out_dtype).view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"out_dtype={self.out_dtype}")


def int8_copy(model: nn.Module, dtype: torch.dtype = torch.float32, kernels: "Kernels | None" = None) -> nn.Module:
    """A decoding copy of a Transformer whose linear maps are ``Int8Linear`` (the caller's model is
    left as it was), everything else in ``dtype`` (float32 for precision int8, bfloat16 for
    int8-bf16). A tied pre-softmax projection (``out_proj`` None, §3.4) gets its own int8 copy of the
    embedding matrix; the embedding lookups keep the float one. The logits are float32 either way.
    ``kernels`` (or None): the C loops for the passes around each int8 product (``Int8Linear``)."""
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise UserError("precision int8 runs on CPU; on a GPU use precision bf16")
    ref = copy.deepcopy(model).float().eval()  # float32 weights to quantize from
    out = copy.deepcopy(model).to(dtype).eval()  # embeddings, LayerNorm, positions in dtype
    linears = {name: m for name, m in ref.named_modules() if isinstance(m, nn.Linear)}
    for parent_name, parent in list(out.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                full = f"{parent_name}.{name}" if parent_name else name
                logits = full == "out_proj"  # the untied pre-softmax projection: float32 logits
                setattr(parent, name, Int8Linear.from_linear(linears[full], torch.float32 if logits else dtype,
                                                             kernels))
    if out.out_proj is None:
        out.out_proj = Int8Linear(ref.tgt_embed.weight, kernels=kernels)
    return out
