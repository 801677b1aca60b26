"""int8 decoding (``DecodeConfig.precision = "int8"``): the model's linear maps in 8-bit integers.

Every linear map of a decoding copy of the model (W^Q/W^K/W^V and W^O of §3.2.2, W_1 and W_2 of
Eq. 2, and the pre-softmax projection of §3.4, the shared embedding matrix when it is tied)
becomes an ``Int8Linear``:

    W ≈ s_W · W_q    W_q int8 (O, I), s_W (O,) = max_i |W[o, i]| / 127     (per output channel, once)
    x ≈ s_x · x_q    x_q int8 (N, I), s_x (N,) = max_i |x[n, i]| / 127     (per row, at every call)
    y = s_x s_W ⊙ (x_q W_qᵀ) + b                                           (int32 accumulation, exact)

Both scales are symmetric (no zero point), so the integer product x_q W_qᵀ is one int8 GEMM, which
runs where it is fast and exact (``Int8Linear``):

- on CPUs with VNNI (avx512_vnni, avx_vnni, amx_int8: Intel Cascade Lake and later, AMD Zen 4 and
  later) ``torch._int_mm``, oneDNN's int8 GEMM on those instructions;
- on CPUs without, but with AVX2 (Intel Haswell..Skylake client, AMD Zen 1-3; also where
  ``ONEDNN_MAX_CPU_ISA`` holds oneDNN below VNNI) the C kernel kernels/int8_gemm.c's AVX2 loop,
  from weights packed once as int16 pairs, with the rescaling in the same pass. There oneDNN's product is a slow
  reference loop or, held to AVX2, saturates its int16 pair sums (wrong by up to 10^5); the
  kernel's pair sums cannot (``onednn_vnni``), and with it int8 decoding is faster than fp32
  there (measured in docs/kernels.md, "The int8 product without VNNI");
- on CPUs without VNNI and without the C kernels' AVX2 loop (no C compiler, ``c_kernels`` off, or a
  CPU without AVX2: an x86-64 before 2013, an Arm CPU), float32 products of the integers (a block of
  1024 columns at a time) or the kernel's plain loops, exact but slower than precision fp32: decoding
  refuses precision int8 there (``require_int8_product``), naming what is missing.

All three give the same int32 sums, so the same translations (tested). Each row of x is quantized on
its own, so a sentence's translation does not depend on which other sentences share its batch
(batched = single, tested); PyTorch's dynamic quantization scales the whole batch with one number
and would not give that. Embeddings, LayerNorm, the softmax of Eq. 1 and the log-probabilities stay
in float32. CPU only: on a GPU use ``precision bf16``. The BLEU this costs is measured in BENCHMARKS.md §4.

``precision = "int8-bf16"`` keeps the same int8 linear maps but runs everything between them in
bfloat16: the residual stream, LayerNorm and the attention core of Eq. 1 (QKᵀ, softmax, ·V), which
is the other half of decoding time once the linear maps are int8 (BENCHMARKS.md §3). Each
``Int8Linear`` then returns bfloat16, except the pre-softmax projection, whose logits stay float32
for the log-probabilities. Worth it on CPUs with bf16 instructions (AVX512-BF16, AMX).
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Mapping

import torch
from torch import Tensor, nn

from aiayn.errors import UserError
from aiayn.host.isa import VNNI_ISAS, onednn_uses

if TYPE_CHECKING:
    from aiayn.kernels.loader import Kernels

_TINY = 1e-12  # scale floor, so an all-zero row or output channel quantizes to zeros, not NaNs


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8: x (N, I) float -> (x_q (N, I) int8, s (N, 1) float32), x ≈ s · x_q.
    A bfloat16 x is not copied to float32 first: its row maxima are exact in bfloat16, and x / s
    promotes each element to float32 on the way, so the result is the same as for x.float()."""
    s = x.abs().amax(dim=1, keepdim=True).float().clamp_min(_TINY) / 127.0  # (N,1)
    return torch.div(x, s).round_().to(torch.int8), s


def onednn_vnni(flags: frozenset[str] | None = None, env: Mapping[str, str] | None = None) -> bool:
    """Whether oneDNN's int8 GEMM (``torch._int_mm`` on the CPU) runs on VNNI dot products, and so is
    fast and exact: the CPU has avx512_vnni, avx_vnni or amx_int8 (``flags``, else /proc/cpuinfo's) and
    ``ONEDNN_MAX_CPU_ISA`` (or its older name ``DNNL_MAX_CPU_ISA``; ``env``, else the environment) does
    not hold oneDNN below them (AVX2 or AVX512_CORE: no VNNI). Without VNNI oneDNN's product is a slow
    reference loop, or with AVX2 u8·s8 products (vpmaddubsw) whose int16 pair sums saturate."""
    return onednn_uses(VNNI_ISAS, flags, env)


def require_int8_product(precision: str, kernels: "Kernels | None") -> None:
    """Refuse ``precision`` (int8, int8-bf16) where its int8 products would run slower than precision
    fp32's float ones: no VNNI for oneDNN (``onednn_vnni``), and no C kernels with their AVX2 product
    to multiply instead (none at all, or a build with only the plain loops: a CPU without AVX2, an Arm
    CPU)."""
    if onednn_vnni() or (kernels is not None and kernels.int8_vector):
        return
    why = ("aiayn's C kernels are off or could not be built (c_kernels, a C compiler)" if kernels is None
           else "this CPU has neither: its int8 products would be plain loops, slower than fp32's")
    raise UserError(f"precision {precision} needs a CPU with VNNI (avx512_vnni, avx_vnni or amx_int8) or with AVX2 "
                    f"and aiayn's C kernels; {why}: use precision fp32")


_FLOAT_EXACT_COLUMNS = 1024  # 1024 * 127² < 2²⁴: every partial sum of a block is an integer float32 holds


def int_mm_float(x_q: Tensor, w_q: Tensor) -> Tensor:
    """x_q (N, I) int8 · w_q (O, I) int8ᵀ -> (N, O) int32, exactly, from float32 products of blocks of
    1024 columns (whose sums stay below 2²⁴, so no rounding happens in any order of summation)."""
    acc = None
    for i in range(0, x_q.size(1), _FLOAT_EXACT_COLUMNS):
        cols = slice(i, i + _FLOAT_EXACT_COLUMNS)
        part = torch.mm(x_q[:, cols].float(), w_q[:, cols].float().t()).to(torch.int32)
        acc = part if acc is None else acc.add_(part)
    return acc if acc is not None else torch.zeros(x_q.size(0), w_q.size(0), dtype=torch.int32)


class Int8Linear(nn.Module):
    """A linear map y = x Wᵀ + b with int8 weights and int8 row-quantized inputs (module docstring).
    With ``kernels`` (kernels/loader.py) the quantization and the rescaling are one C loop each, with
    the same results, and on a CPU without VNNI (``onednn_vnni``) the product and the rescaling are one
    C pass (int8_gemm.c) from weights packed here; without VNNI and without kernels, ``int_mm_float``."""

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
        self.vnni = onednn_vnni()  # torch._int_mm is fast and exact here
        packed = kernels.pack_int8(w_q) if kernels is not None and not self.vnni else None
        self.register_buffer("w_packed", packed, persistent=False)  # (ceil(O/16), ceil(I/2), 16, 2) int16

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
        if self.w_packed is not None:  # no VNNI: int8_gemm.c, the rescaling in the same pass
            y = self.kernels.int8_linear(x_q, s_x, self.w_packed, self.s_w, self.bias, self.out_dtype)
            return y.view(*lead, self.out_features)
        acc = torch._int_mm(x_q, self.w_q.t()) if self.vnni else int_mm_float(x_q, self.w_q)  # (N,O) int32
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
