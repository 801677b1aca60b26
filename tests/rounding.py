"""How far a path's arithmetic may move a log-probability, a logit or a hypothesis's score from the
exact one (``rounding_bound``): float32's own roundings (``fp32``, and ``fp32-cuda`` with CUDA's fast
exponentials: what two float32 paths, cached or recomputed, batched or alone, the C kernels or
PyTorch's, may differ by), float64's (``fp64``), and reduced precision's (``DecodeConfig.precision``:
bf16, fp16, int8, int8-bf16). Derived from the formats' arithmetic, never measured: tests/decode,
tests/kernels, tests/model, tests/serve and tests/gpu hold those paths to these bounds, and
tests/test_rounding.py holds float32 to them against float64."""
from __future__ import annotations

import copy
import math
import types
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.decode.config import DecodeConfig
from aiayn.decode.search import Hypothesis, SpecialIds, length_penalty
from aiayn.model.attention import MultiHeadAttention
from aiayn.model.layers import FeedForward, SublayerConnection
from aiayn.model.positional import LearnedPositions, ScaledEmbedding
from tests.arith import EXP_REL_ERR, LAMBDA, U32, U_BF16, log_softmax_exp_sum_bound, loss_sums

UNIT_ROUNDOFF = {"bf16": U_BF16, "fp16": 2.0 ** -11}  # 2^-p for p significand bits (8 and 11)
UNDERFLOW = {"bf16": 2.0 ** -134, "fp16": 2.0 ** -25}  # half the smallest subnormal: the error below the normal range
# LAMBDA (tests/arith.py), in Hoeffding's bound: it fails with probability at most 2 exp(-LAMBDA^2 / 2) = 4.6e-11
# precision: (the float format between the linear maps, None for float32; whether the linear maps are int8)
PATHS = {"bf16": ("bf16", False), "fp16": ("fp16", False), "int8": (None, True), "int8-bf16": ("bf16", True),
         "fp32": (None, False), "fp64": (None, False), "fp32-cuda": (None, False)}


@dataclass(frozen=True)
class Arith:
    """A float format's arithmetic, for ``_float_log_probs``: unit roundoff, half the smallest
    subnormal, the smallest normal number (what an exponential below the normal range, or the C
    kernels' clamped one at -87, may be off by), the relative error of the exponentials that run in
    it, and the absolute error of its erf (GELU)."""
    u: float
    eta: float
    tiny: float
    exp_rel: float
    erf_abs: float
    dtype: torch.dtype
    exp_per_x: float = 0.0  # an exponential's relative error per unit of |x| besides (CUDA's fast exp)
    log_abs: float = 0.0  # a logarithm's absolute error besides (CUDA's fast log near 1)


# float32: the C kernels' exponential (EXP_REL_ERR) is the least accurate, PyTorch's (1 ulp, 2 u) below it;
# ATen's vectorized float32 erf is Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7) evaluated in float32:
# 1 - t (a1 + ... a5 t^4) exp(-x²), t = 1 / (1 + p |x|), about 17 roundings of values below 1 (t, the
# polynomial's 10, x², exp's 1 ulp, the product, the difference): 1.5e-7 + 17 u.
# float64: PyTorch's and libm's exp and erf (SLEEF), 1 ulp; its smallest subnormal stands for half of it
# float32 on CUDA: Triton's and the fused attention kernels' exp and log may be the fast ex2.approx and
# lg2.approx (as __expf and __logf, CUDA C Programming Guide, Intrinsic Functions): exp(x) within
# 2 + floor(1.173 |x|) ulp, log within 3 ulp or 2^-21.41 absolute on [0.5, 2]; an ulp is at most 2 u
FORMATS = {"fp32": Arith(U32, 2.0 ** -150, 2.0 ** -126, EXP_REL_ERR, 1.5e-7 + 17 * U32, torch.float32),
           "fp64": Arith(2.0 ** -53, 2.0 ** -1074, 2.0 ** -1022, 2 * 2.0 ** -53, 2 * 2.0 ** -53, torch.float64),
           "fp32-cuda": Arith(U32, 2.0 ** -150, 2.0 ** -126, 4 * U32, 1.5e-7 + 17 * U32, torch.float32,
                              exp_per_x=2 * 1.173 * U32, log_abs=2.0 ** -21.41)}


class Marks(list):
    """The places where an arithmetic moves a value, as (a zero to differentiate by, c: the bound of
    its δ, systematic), for ``_hoeffding``."""

    def mark(self, c: Tensor, systematic: bool = False) -> Tensor:
        """A zero of c's shape to differentiate by, whose δ is at most c."""
        z = torch.zeros_like(c, requires_grad=True)
        self.append((z, c, systematic))
        return z

    def moved(self, v: Tensor, c, systematic: bool = False) -> Tensor:
        """v plus a zero to differentiate by, where the arithmetic moves v by at most c: a rounding
        (independent, of mean zero) or, ``systematic``, an error that is neither (a constant's rounding,
        shared by every use; an approximation's error, smooth in its argument)."""
        return v + self.mark(torch.as_tensor(c, dtype=v.dtype).expand_as(v), systematic)


def _constant(c: float, a: Arith) -> float:
    """How far a constant moves when the arithmetic ``a`` holds it: |fl(c) - c| / |c|, relative."""
    return abs(torch.tensor(c, dtype=a.dtype).item() - c) / abs(c)


def int8_half_step(v: Tensor) -> Tensor:
    """How far int8 quantization (decode/int8.py: s = max|row| / 127) moves each entry of v's rows: s / 2,
    and float32's rounding of v / s (|v / s| <= 127: 127 u32 s). (rows, 1)."""
    return v.detach().abs().amax(-1, keepdim=True) / 127 * (0.5 + 127 * U32)


class _RoundedAttention(nn.Module):
    """Eq. 1 written out in float64, each result where a reduced-precision path may round marked
    (``round_``): Q Kᵀ, its scaling by 1/sqrt(d_k), the softmax weights and their product with V."""

    def __init__(self, round_: Callable[[Tensor], Tensor]):
        super().__init__()
        self.round_ = round_

    def forward(self, q, k, v, mask, is_causal=False, need_weights=False):
        T, S = q.size(-2), k.size(-2)
        if is_causal:  # query t of the last T sees keys 0..S-T+t (as ScaledDotProductAttention)
            causal = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
            mask = causal if mask is None else mask & causal
        scores = self.round_(self.round_(q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1)))
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        out = self.round_(self.round_(torch.softmax(scores, dim=-1)) @ v)  # (B,H,T,Dv)
        B, H, T, Dv = out.shape
        return out.transpose(1, 2).reshape(B, T, H * Dv), None


def rounding_bound(model: nn.Module, precision: str, src: Tensor, tgt_in: Tensor,
                   quantity: Callable[[Tensor], Tensor], logits: bool = False) -> Tensor:
    """A bound on how far ``precision``'s decoding copy of the float32 ``model`` moves each of the
    values ``quantity`` takes from the teacher-forced log-probabilities (``logits``: the logits) of
    one sentence, src (1, S) without padding, tgt_in (1, T) (BOS and the tokens before each step; the
    same functions a cached decoding step computes): (n,) float64, one bound per value.

    Where the copy's arithmetic moves a value v, and by how much at most:
    - bf16, fp16: every parameter is rounded once, and the result of every operation (each linear
      map's product and its bias's sum, Q Kᵀ, its scaling, the softmax weights, their product with V,
      the residual sums, LayerNorm, the embedding and positional encoding and their sum, the logits):
      |δv| <= u |v| + η, u the format's unit roundoff (``UNIT_ROUNDOFF``), η half its smallest
      subnormal. A path that rounds at fewer of these places (oneDNN's fused bias, the C kernels'
      float32 attention) is covered.
    - int8 (decode/int8.py): each linear map's input rows, x ≈ s_x x_q with s_x = max|x| / 127, by at
      most s_x / 2 plus float32's rounding of x / s_x (|x / s_x| <= 127: 127 u32 s_x), and its
      weights' rows alike with s_W; the tied pre-softmax projection's own copy of the embedding too.
      The products are exact in int32; everything else is float32.
    - int8-bf16: int8's and bf16's at every result between the linear maps and the parameters that
      stay bfloat16 (embeddings, LayerNorm); the biases and the logits stay float32.
    - fp32: float32's own roundings, in every path alike (``_float_log_probs``): two float32 paths
      (cached or recomputed, batched or alone, the C kernels or PyTorch's) differ by at most twice it;
      fp32-cuda the same with CUDA's fast exponentials and logarithms; fp64 for float64 models.
    Float32's roundings (unit roundoff 2^-24, in both searches; the float32 sums inside the products,
    of at most d_ff = 256 terms here, 256 · 2^-24 = 2^-16 of their terms' magnitudes) are 2^-8 of
    bf16's 2^-8 and of an int8 step (max / 254), 2^-5 of fp16's 2^-11: left out.

    To first order a value q moves by Σ_i (∂q/∂v_i) δv_i over those places i (the second order,
    products of two δ, is about u of that), the derivatives from autograd in float64 at the exact
    values. With the δv_i independent and of mean zero (rounding errors as Higham & Mary model them,
    SIAM J. Sci. Comput. 41(5), 2019; tests/kernels/reference.py), Hoeffding's inequality gives
    |Σ_i (∂q/∂v_i) δv_i| <= LAMBDA sqrt(Σ_i (∂q/∂v_i c_i)²), |δv_i| <= c_i, but with probability
    2 exp(-LAMBDA² / 2). Nothing in it is measured: it holds for any CPU's order of operations."""
    fmt, int8 = PATHS[precision]
    u, eta = UNIT_ROUNDOFF.get(fmt, 0.0), UNDERFLOW.get(fmt, 0.0)
    m = copy.deepcopy(model).double().eval()
    followed = (nn.Linear, nn.LayerNorm, ScaledEmbedding, LearnedPositions, type(m))
    odd = {type(mod).__name__ for mod in m.modules() if any(True for _ in mod.parameters(recurse=False))
           and not isinstance(mod, followed)}
    assert not odd, f"the model as trained, not a decoding copy: {odd} are not followed here"
    if int8 and m.out_proj is None:  # the tied projection's int8 copy rounds apart from the lookups'
        m.out_proj = nn.Linear(m.cfg.d_model, m.tgt_embed.weight.size(0), bias=False).double()
        m.out_proj.weight = nn.Parameter(m.tgt_embed.weight.detach().clone())
    places = Marks()
    moved = places.moved

    def round_(v: Tensor) -> Tensor:
        return moved(v, u * v.detach().abs() + eta) if u else v

    if precision in FORMATS:
        return _hoeffding(quantity(_float_log_probs(m, src, tgt_in, moved, FORMATS[precision], logits)).reshape(-1),
                          places)
    linears = [mod for mod in m.modules() if isinstance(mod, nn.Linear)]
    int8_params = {id(p) for lin in linears for p in lin.parameters()} if int8 else set()
    for p in m.parameters():
        p.requires_grad_(True)
        if u and id(p) not in int8_params:  # int8's biases stay float32; its weights: below
            places.append((p, u * p.detach().abs() + eta, False))

    def linear(self, x, _logits=False):
        if int8:
            x = moved(x, int8_half_step(x))
        product = F.linear(x, self.weight)
        y = product if self.bias is None else product + self.bias
        if int8:  # the bias added in float32 to the rescaled product, rounded once (not the logits)
            return y if _logits else round_(y)
        if self.bias is not None and u:  # the product rounded, and its sum with the bias
            return moved(y, u * torch.sqrt(product.detach() ** 2 + y.detach() ** 2) + eta)
        return round_(y)

    for lin in linears:
        lin.forward = types.MethodType(lambda self, x, _l=lin is m.out_proj: linear(self, x, _l), lin)
        if int8:
            places.append((lin.weight, int8_half_step(lin.weight), False))

    def post(self, x, sublayer_out):
        y = round_(x + sublayer_out)
        return y if self.pre_norm else self.norm(y)

    for mod in m.modules():
        if isinstance(mod, nn.LayerNorm):
            mod.register_forward_hook(lambda mod, inputs, out: round_(out))
        elif isinstance(mod, SublayerConnection):
            mod.post = types.MethodType(post, mod)
        elif isinstance(mod, MultiHeadAttention):
            mod.core = _RoundedAttention(round_)

    def embed(self, tokens, embedding, positions, start, what=None):
        e = round_(embedding(tokens))
        return round_(e + round_(positions(start, tokens.size(1)).to(e.dtype)))

    m._embed = types.MethodType(embed, m)
    if m.out_proj is None:  # the tied projection (§3.4) of bf16 and fp16: the logits rounded
        m.output_logits = types.MethodType(lambda self, h: round_(self.tgt_embed.transposed(h, self.out_bias)), m)
    z = m(src, tgt_in)
    return _hoeffding(quantity(z if logits else torch.log_softmax(z, dim=-1)).reshape(-1), places)


def _hoeffding(q: Tensor, places: list[tuple[Tensor, Tensor, bool]], retain_graph: bool = False) -> Tensor:
    """LAMBDA sqrt(Σ_i (∂q/∂v_i c_i)²) over the roundings, plus Σ_j |∂q/∂v_j c_j| over the systematic
    places (their worst case: no cancellation assumed), for each of the values q (n,)."""
    inputs, bounds, systematic = zip(*places)
    grads = torch.autograd.grad(q, inputs, grad_outputs=torch.eye(q.numel(), dtype=q.dtype), is_grads_batched=True,
                                allow_unused=True, retain_graph=retain_graph)  # each (n, *place)
    zero = q.new_zeros(q.numel())
    squares = sum((((g * c) ** 2).reshape(q.numel(), -1).sum(1) for g, c, sys in zip(grads, bounds, systematic)
                   if g is not None and not sys), zero)
    worst = sum(((g * c).abs().reshape(q.numel(), -1).sum(1) for g, c, sys in zip(grads, bounds, systematic)
                 if g is not None and sys), zero)
    return LAMBDA * squares.sqrt() + worst


def _roundings(n, u: float = U32) -> Tensor:
    """sqrt(n) u: what n roundings, each moving a value by at most u times a magnitude M and independent
    of the others (the model of ``rounding_bound``), weigh in Hoeffding's sum, as one place with
    |δ| <= sqrt(n) u M (Σ_i (g u M)² over the n is (g sqrt(n) u M)²). A sum of n terms in float32 rounds
    at most 2n times (n products without FMA, n - 1 additions, one more for a bias or a scaling), each
    by at most u times a partial value, below M = Σ|terms|, whatever the order of the additions
    (Higham & Mary 2019, Theorem 4.6: lambda sqrt(n) u, against the worst case gamma_n = n u)."""
    return torch.as_tensor(n, dtype=torch.float64).clamp(min=1).sqrt() * u


def _float_log_probs(m: nn.Module, src: Tensor, tgt_in: Tensor, moved: Callable[..., Tensor],
                     a: Arith, logits: bool = False, record: Callable[..., None] | None = None) -> Tensor:
    """The float64 copy ``m``'s log-probabilities (1, T, V), each result that the arithmetic ``a``
    (float32, or float64 for float64 models) rounds
    ``moved`` by its bound, whatever the order of the sums, with or without FMA, in PyTorch's ops or
    the C kernels (the parameters and the positional table are float32 numbers in every path: exact):
    - a linear map, x Wᵀ + b: 2 d_in + 1 roundings of values below |x| |W|ᵀ + |b| (``_roundings``);
    - Eq. 1 (``_FloatAttention``) and the final log-softmax: each step of the softmax (below);
    - LayerNorm (``_float_layer_norm``); the residual sums, u |x + y|; the embedding's scaling by
      fl32(sqrt(d_model)), 2 u, and its sum with the positions, u; ReLU is exact, swish and GELU
      round (``_float_activation``).
    The softmax over n values s (Eq. 1's row, the logits): x = s - max s, rounded (u |x|), times
    fl32(log2 e) and rounded again inside the C kernels' exponential (about 1.23 u |x|): 3 u (|x| + 1);
    exp(x) with relative EXP_REL_ERR (the C kernels'; PyTorch's SLEEF and libm's 1 ulp, 2 u, are below
    it); their sum l, n - 1 roundings below l; then p = exp(x) / l, 2 u p (a division, or a reciprocal and a
    product), or log p = x - log l: logf's 1 ulp (2 u |log l|) and the sums max s + log l and s minus
    that, u (|max s| + |log l|) and u |log p|.
    ``record(kind, **tensors)``, where given, receives each operation's inputs and results as the
    forward uses them (tests/grad_rounding.py follows the backward from them)."""
    u = a.u
    record = record or (lambda kind, **tensors: None)

    def linear(x, weight, bias):
        y = _float_linear(x, weight, bias, moved, a)
        record("linear", x=x, W=weight, b=bias, y=y)
        return y

    def post(self, x, sublayer_out):
        y = x + sublayer_out
        y = moved(y, u * y.detach().abs())
        record("add", x=x, s=sublayer_out, y=y)
        return y if self.pre_norm else self.norm(y)

    def embed(self, tokens, embedding, positions, start, what=None):
        e = embedding(tokens)  # the lookup times sqrt(d_model): fl(sqrt(d_model))'s error is one for every entry
        record("embed", E=embedding.weight, tokens=tokens, scale=embedding.scale, pad=embedding.pad_id, e=e)
        e = e * (1 + moved(e.new_zeros(()), _constant(embedding.scale, a), systematic=True))
        e = moved(e, u * e.detach().abs())
        y = e + positions(start, tokens.size(1)).to(e.dtype)
        return moved(y, u * y.detach().abs())

    for mod in m.modules():
        if isinstance(mod, nn.Linear):
            mod.forward = types.MethodType(lambda self, x: linear(x, self.weight, self.bias), mod)
        elif isinstance(mod, nn.LayerNorm):
            mod.forward = types.MethodType(lambda self, x: _float_layer_norm(self, x, moved, a, record), mod)
        elif isinstance(mod, SublayerConnection):
            mod.post = types.MethodType(post, mod)
        elif isinstance(mod, MultiHeadAttention):
            mod.core = _FloatAttention(moved, a, record)
    for mod in m.modules():
        if isinstance(mod, FeedForward) and mod.activation != "relu":  # ReLU is exact
            mod.act = lambda x, _name=mod.activation: _float_activation(_name, x, moved, a)
    m._embed = types.MethodType(embed, m)
    def output_logits(self, h):  # the pre-softmax projection (§3.4), tied or its own, and its bias, one linear map
        weight = self.tgt_embed.weight if self.out_proj is None else self.out_proj.weight
        biases = [b for b in (getattr(self.out_proj, "bias", None), self.out_bias) if b is not None]
        return linear(h, weight, sum(biases) if biases else None)

    m.output_logits = types.MethodType(output_logits, m)
    z = m(src, tgt_in)  # (1,T,V)
    if logits:
        return z
    s_max = z.detach().amax(-1, keepdim=True)
    x, _, l = _float_softmax_sum(z, moved, a)
    log_l = torch.log(l)
    lse = moved(s_max + log_l, u * (3 * log_l.detach().abs() + s_max.abs()) + a.log_abs)  # logf's 2u, the sum's u
    lp = x + s_max - lse
    return moved(lp, u * lp.detach().abs())


def _float_linear(x: Tensor, weight: Tensor, bias: Tensor | None, moved: Callable[..., Tensor], a: Arith) -> Tensor:
    """x Wᵀ + b with the arithmetic ``a``'s roundings marked (``_float_log_probs``): 2 d_in + 1 of
    values below |x| |W|ᵀ + |b| (``_roundings``), and subnormals' n η."""
    y = F.linear(x, weight, bias)
    terms = F.linear(x.detach().abs(), weight.detach().abs(), None if bias is None else bias.detach().abs())
    n = 2 * x.size(-1) + 1
    return moved(y, _roundings(n, a.u) * terms + n * a.eta)


def _float_activation(name: str, x: Tensor, moved: Callable[..., Tensor], a: Arith) -> Tensor:
    """Eq. 2's activation other than ReLU, its roundings marked (``_float_log_probs``):
    - swish, x σ(x), σ(x) = 1 / (1 + exp(-x)): exp's relative error (at most a.exp_rel of σ, as
      exp(-x) / (1 + exp(-x)) < 1), the sum and the reciprocal (2 u), the product (u); below the
      normal range (x < -87 in float32) the result may be 0: a.tiny besides;
    - GELU, x (1 + erf(x / sqrt 2)) / 2: erf's argument, x fl(1 / sqrt 2) rounded (1.3 u |x| / sqrt 2,
      times erf' <= 2 / sqrt(pi) exp(-x² / 2)), the sum (u |1 + erf|), two products (2 u |y|); and
      erf's own error, a.erf_abs, which is no rounding but the approximation's, smooth in x: systematic."""
    u = a.u
    if name == "swish":
        y = F.silu(x)
        return moved(y, (a.exp_rel + a.exp_per_x * x.detach().abs() + 3 * u) * y.detach().abs() + a.tiny)
    assert name == "gelu", name
    y = F.gelu(x)
    xd = x.detach()
    erf = torch.erf(xd / math.sqrt(2))
    arg = (2 / math.sqrt(math.pi)) * torch.exp(-xd ** 2 / 2) * 1.3 * u * xd.abs() / math.sqrt(2)
    y = moved(y, xd.abs() / 2 * (arg + u * (1 + erf).abs()) + 2 * u * y.detach().abs() + a.eta)
    return moved(y, xd.abs() / 2 * a.erf_abs, systematic=True)


def _float_softmax_sum(s: Tensor, moved: Callable[..., Tensor], a: Arith) -> tuple[Tensor, Tensor, Tensor]:
    """x = s - max s over the last dimension, e = exp(x) and l = Σ e (rows with -inf where masked),
    each rounding ``moved`` as ``_float_log_probs`` says: x, 3 u (|x| + 1) (with fl(log2 e)'s own
    error, one for every exponential, apart: systematic); e, a.exp_rel e and a.tiny (an exponential
    below the normal range, or clamped at -87 in the C kernels); l, n - 1 roundings below l."""
    u = a.u
    x = s - s.detach().amax(-1, keepdim=True)
    finite = torch.isfinite(x.detach())
    x = moved(x, torch.where(finite, 3 * u * (x.detach().abs() + 1), 0.0))
    log2e = moved(x.new_zeros(()), _constant(math.log2(math.e), a), systematic=True)
    e = torch.exp(x + x.detach().nan_to_num(neginf=0.0) * log2e)  # x (1 + δ), masked entries left at -inf
    xd = x.detach().nan_to_num(neginf=0.0).abs()
    e = moved(e, torch.where(finite, (a.exp_rel + a.exp_per_x * xd) * e.detach() + a.tiny, 0.0))
    n = finite.sum(-1, keepdim=True)
    l = e.sum(-1, keepdim=True)
    l = moved(l, _roundings(n - 1, u) * l.detach() + n * a.eta)
    return x, e, l


class _FloatAttention(nn.Module):
    """Eq. 1 in float64, each rounding of the arithmetic ``a`` marked (``_float_log_probs``):
    - q and k scaled, as the C kernels (q fl(1 / sqrt(d_k))) and PyTorch's SDPA (q and k each by
      fl(sqrt(1 / sqrt(d_k)))) do: u |q|, u |k| for each entry (one rounding, shared by every score that
      uses it) and the constant's error (shared by all: systematic, the larger of the two forms');
    - Q Kᵀ, 2 d_k roundings below |Q| |K|ᵀ / sqrt(d_k);
    - the softmax's exponentials and their sum l (``_float_softmax_sum``), the reciprocal 1 / l (u,
      one for a row and head) and each weight e_j (1 / l) (u p_j);
    - their product with V over the n keys a query sees, 2 n + 1 below p |V| (normalized before or
      after the sum, as flash attention does)."""

    def __init__(self, moved: Callable[..., Tensor], a: Arith, record: Callable[..., None]):
        super().__init__()
        self.moved, self.a, self.record = moved, a, record

    def forward(self, q, k, v, mask, is_causal=False, need_weights=False):
        T, S, d_k = q.size(-2), k.size(-2), q.size(-1)
        a, moved = self.a, self.moved
        if is_causal:  # query t of the last T sees keys 0..S-T+t (as ScaledDotProductAttention)
            causal = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
            mask = causal if mask is None else mask & causal
        scale = 1 / math.sqrt(d_k)
        q_in = q
        q = moved(q * scale, a.u * q.detach().abs() * scale)  # (B,H,T,K)
        k = moved(k, a.u * k.detach().abs())
        const = max(_constant(scale, a), abs(torch.tensor(math.sqrt(scale), dtype=a.dtype).item() ** 2 - scale) / scale)
        q = q * (1 + moved(q.new_zeros(()), const, systematic=True))
        scores = q @ k.transpose(-2, -1)  # (B,H,T,S)
        terms = q.detach().abs() @ k.detach().abs().transpose(-2, -1)
        scores = moved(scores, _roundings(2 * d_k, a.u) * terms + 2 * d_k * a.eta)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        x, e, l = _float_softmax_sum(scores, moved, a)
        r = 1 / l
        r = moved(r, a.u * r.detach())  # (B,H,T,1)
        p = e * r
        p = moved(p, a.u * p.detach())
        n = torch.isfinite(x.detach()).sum(-1, keepdim=True)  # (B,H,T,1) keys seen
        out = p @ v  # (B,H,T,Dv)
        out = moved(out, _roundings(2 * n + 1, a.u) * (p.detach() @ v.detach().abs()) + 2 * n * a.eta)
        self.record("attention", q_in=q_in, q=q, k=k, scores=scores, p=p, v=v, out=out)
        B, H, T, Dv = out.shape
        return out.transpose(1, 2).reshape(B, T, H * Dv), None


def _float_layer_norm(ln: nn.LayerNorm, x: Tensor, moved: Callable[..., Tensor], a: Arith,
                      record: Callable[..., None]) -> Tensor:
    """LayerNorm over the last dimension (D), each rounding of the arithmetic ``a`` marked
    (``_float_log_probs``): the mean μ, D + 1 roundings below mean|x|; the variance σ², 3 D + 3 below
    mean(x²), which covers the two-pass mean((x - μ)²), Welford's updates and E[x²] - μ² alike;
    fl(ε)'s own error (systematic); 1 / sqrt(σ² + ε), 3 u (the sum, the root, the reciprocal); and
    y = (x - μ) r w + b, as written or fused as x (r w) + (b - μ r w): four roundings, each of a value
    below |x| |r w| + |μ r w| + |b| + |y|, so 4 u of that."""
    u = a.u
    D = x.size(-1)
    mu = x.mean(-1, keepdim=True)
    mu = moved(mu, _roundings(D + 1, u) * x.detach().abs().mean(-1, keepdim=True) + D * a.eta)
    d = x - mu
    var = (d * d).mean(-1, keepdim=True)
    var = moved(var, _roundings(3 * D + 3, u) * (x.detach() ** 2).mean(-1, keepdim=True) + D * a.eta)
    eps = ln.eps * (1 + moved(x.new_zeros(()), _constant(ln.eps, a), systematic=True))
    r = torch.rsqrt(var + eps)
    r = moved(r, 3 * u * r.detach())
    y = d * r * ln.weight + ln.bias
    rw = (r * ln.weight).detach().abs()
    c = 4 * u * (x.detach().abs() * rw + mu.detach().abs() * rw + ln.bias.detach().abs() + y.detach().abs())
    y = moved(y, c)
    record("layer_norm", x=x, r=r, xhat=(d * r).detach(), w=ln.weight, b=ln.bias, y=y)
    return y


def attend_bound(attn: MultiHeadAttention, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, precision: str) -> Tensor:
    """A bound on how far ``precision``'s arithmetic moves each entry of ``attn.attend(q, k, v, mask)``
    (Eq. 1 on given heads, then W^O: (B,T,D)) from the exact one: "fp32" (``_FloatAttention`` and the
    linear map's 2 n + 1 roundings below its terms) or "bf16" for a module held in bfloat16 (its
    weights and the heads bfloat16 numbers already; every result rounded: ``_RoundedAttention``)."""
    m = copy.deepcopy(attn).double()
    places = Marks()
    moved = places.moved
    if precision in FORMATS:
        a = FORMATS[precision]
        m.core = _FloatAttention(moved, a, lambda kind, **tensors: None)
        m.out_proj.forward = lambda x: _float_linear(x, m.out_proj.weight, m.out_proj.bias, moved, a)
    else:
        u, eta = UNIT_ROUNDOFF[PATHS[precision][0]], UNDERFLOW[PATHS[precision][0]]
        round_ = lambda x: moved(x, u * x.detach().abs() + eta)  # noqa: E731
        m.core = _RoundedAttention(round_)
        linear = m.out_proj.forward
        m.out_proj.forward = lambda x: round_(linear(x))
    out = m.attend(q.detach().double(), k.detach().double(), v.detach().double(), mask)[0]
    return _hoeffding(out.reshape(-1), places).view_as(out)


def step_bound(model: nn.Module, precision: str, src: Tensor, prefix: Tensor | None = None,
               rows: Tensor | None = None, bos: int = SpecialIds.bos) -> Tensor:
    """``rounding_bound`` of the log-probabilities of the step after each row's prefix, one row at a
    time (rows share no rounding): row r continues sentence ``rows[r]`` of src (B, S) (its padding 0
    dropped) with ``prefix[r]`` (BOS and the tokens before the step, as a cached decoder's rows hold
    them through reorders); by default BOS alone, a row per sentence. (N, V). Inference tensors
    (a decoding loop's) are copied: autograd takes them."""
    if prefix is None:
        prefix, rows = torch.full((src.size(0), 1), bos), torch.arange(src.size(0))
    with torch.inference_mode(False):
        out = [rounding_bound(model, precision, src[b][src[b] != 0][None], prefix[r:r + 1].clone(), lambda lp: lp[0, -1])
               for r, b in enumerate(rows.tolist())]
    return torch.stack(out)


def _forced(src: Tensor, hyp: Hypothesis, ids: SpecialIds) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A hypothesis's teacher-forced path: src (1, S) without its padding, tgt_in (1, |Y|) (BOS and
    the tokens before each step), the steps (|Y|,) and the tokens y (|Y|,) (EOS included when it
    ended there)."""
    y = list(hyp.tokens) + ([ids.eos] if hyp.eos else [])
    assert len(y) == hyp.length, (hyp, ids)
    return src[src != ids.pad][None], torch.tensor([[ids.bos] + y[:-1]]), torch.arange(len(y)), torch.tensor(y)


def _search_sum(hyp: Hypothesis, u: float, penalty: float) -> float:
    """The search's own sum of the |Y| log-probabilities and its division by the penalty: |Y| + 1
    roundings below |score| lp(|Y|) (1.01: hyp.score's own error), before the division."""
    return LAMBDA * float(_roundings(hyp.length + 1, u)) * 1.01 * abs(hyp.score) * penalty


def score_bound(model: nn.Module, precision: str, src: Tensor, hyp: Hypothesis, cfg: DecodeConfig,
                ids: SpecialIds = SpecialIds()) -> float:
    """``rounding_bound`` of a hypothesis's score, Σ_t log p(y_t) / lp(|Y|) (decode/search.py), for the
    sentence src (S,) (its padding is dropped): the sum over its |Y| tokens (EOS included when it
    ended there), divided by the length penalty of the same |Y| in both searches (``cfg``'s). The
    search's own float32 sum of the |Y| log-probabilities and its division by the penalty, |Y| + 1
    roundings below |score| lp(|Y|), are added."""
    src, tgt_in, steps, gold = _forced(src, hyp, ids)
    bound = rounding_bound(model, precision, src, tgt_in, lambda lp: lp[0, steps, gold].sum())
    penalty = length_penalty(hyp.length, cfg.alpha, cfg.length_norm)
    u = FORMATS[precision].u if precision in FORMATS else U32  # the search's sums: float32 but for float64 models
    return (float(bound) + _search_sum(hyp, u, penalty)) / penalty


def log_prob_bound(model: nn.Module, precision: str, src: Tensor, hyp: Hypothesis, cfg: DecodeConfig,
                   ids: SpecialIds = SpecialIds()) -> float:
    """``score_bound`` of a hypothesis's log-probability, its score before the length penalty."""
    return score_bound(model, precision, src, hyp, cfg, ids) * length_penalty(hyp.length, cfg.alpha, cfg.length_norm)


def same_float_search(model: nn.Module | list[nn.Module], src: Tensor, got: list, want: list, cfg: DecodeConfig,
                      ids: SpecialIds = SpecialIds(), fmt: str = "fp32") -> None:
    """Two searches of the float32 (``fmt`` "fp32") or float64 ("fp64") ``model`` (a list: an
    ensemble's members) over src (B,S) (their n-best lists, sentence by sentence): the same
    hypotheses, and each score and log-probability within twice ``score_bound``'s (or
    ``ensemble_score_bound``'s) ``fmt`` of the other's, each path's roundings moving it at most that
    far from the exact one."""
    assert [[(h.tokens, h.eos) for h in hs] for hs in got] == [[(h.tokens, h.eos) for h in hs] for hs in want]
    for b, (hs_got, hs_want) in enumerate(zip(got, want)):
        for g, w in zip(hs_got, hs_want):
            bound = (ensemble_score_bound(model, fmt, src[b], w, cfg, ids) if isinstance(model, list)
                     else score_bound(model, fmt, src[b], w, cfg, ids))
            penalty = length_penalty(w.length, cfg.alpha, cfg.length_norm)
            assert abs(g.score - w.score) <= 2 * bound, (b, w.tokens, g.score, w.score, 2 * bound)
            assert abs(g.log_prob - w.log_prob) <= 2 * bound * penalty, (b, w.tokens, g.log_prob, w.log_prob)


def loss_bound(model: nn.Module, precision: str, batch, eps_ls: float, pad: int = 0) -> float:
    """``rounding_bound`` of a batch's summed loss (§5.4: label smoothing eps_ls over V - 2 classes;
    eps_ls 0, the NLL), sentence by sentence (``batch``: a ``Batch``'s src, tgt_in and tgt_out, padded
    with ``pad``), summed. The loss's own sum over the tokens is the caller's."""
    total = 0.0
    for src, tgt_in, tgt_out in zip(batch.src, batch.tgt_in, batch.tgt_out):
        n = int((tgt_out != pad).sum())
        gold = tgt_out[:n]

        def loss(lp):
            lp, V = lp[0], lp.size(-1)
            lp_gold = lp[torch.arange(n), gold]
            return (-(1 - eps_ls) * lp_gold - eps_ls / (V - 2) * (lp.sum(-1) - lp_gold - lp[:, pad])).sum()

        total += float(rounding_bound(model, precision, src[src != pad][None], tgt_in[None, :n], loss))
    return total


def loss_errors(a: Arith, z: Tensor) -> dict:
    """The relative errors of the loss's exponentials and logarithms under the arithmetic ``a`` over
    the logits z (N, V), for both of its paths (``loss_sums``, ``smoothed_loss_gradients``,
    tests/arith.py): ``a``'s exponential at the largest |z - log Z| (CUDA's fast one grows with it),
    and a logarithm's 1 ulp."""
    x_max = float((z - z.logsumexp(-1, keepdim=True)).abs().max())
    exp_rel = a.exp_rel + a.exp_per_x * x_max
    return dict(exp_rel=exp_rel, log_rel=2 * a.u, ref_exp_rel=exp_rel, ref_log_rel=2 * a.u)


def summed_loss_bound(model: nn.Module, precision: str, batch, eps_ls: float, pad: int = 0,
                      loss_fmt: str | None = None) -> float:
    """How far a step's summed loss (eps_ls 0: the NLL) moves from the exact one: ``loss_bound``'s of
    ``precision``, plus the loss's own float32 arithmetic on the logits and its sum over the batch's
    tokens (``loss_sums``, tests/arith.py: the fused path's or the plain one's, the larger), in
    ``loss_fmt`` ("fp32", "fp32-cuda"; by default ``precision``'s, or "fp32" under bf16): its
    exponentials, and a logarithm's absolute error once a token."""
    a = FORMATS[loss_fmt or (precision if precision in FORMATS else "fp32")]
    with torch.no_grad():
        z = copy.deepcopy(model).double().eval()(batch.src, batch.tgt_in)
    V, target = z.size(-1), batch.tgt_out.reshape(-1)
    zd = z.reshape(-1, V)
    fused, plain = loss_sums(zd.float(), target, eps_ls, pad, **loss_errors(a, zd))
    own = max(float(fused[0].e), float(plain[0].e)) + a.log_abs * int((target != pad).sum())
    return loss_bound(model, precision, batch, eps_ls, pad) + own


def logit_bounds(model: nn.Module, fmt: str, src: Tensor, tgt_in: Tensor, pad: int = 0) -> Tensor:
    """``rounding_bound`` of every teacher-forced logit of a batch, sentence by sentence (the padding
    of src dropped; a padded batch's masked keys weigh exactly 0): src (B,S), tgt_in (B,T) -> (B,T,V)."""
    rows = []
    for b in range(src.size(0)):
        z_bound = rounding_bound(model, fmt, src[b][src[b] != pad][None], tgt_in[b:b + 1], lambda z: z[0], logits=True)
        rows.append(z_bound.view(tgt_in.size(1), -1))
    return torch.stack(rows)


def two_implementations_bound(model: nn.Module, src: Tensor, tgt_in: Tensor, pad: int = 0) -> Tensor:
    """How far another float32 implementation of ``model``'s function (transformers' Marian) may put
    each teacher-forced logit from the model's own: src (B,S), tgt_in (B,T) -> (B,T,V). Each is within
    ``logit_bounds`` "fp32" of the exact logits, whatever its order of sums; the other may apply Eq. 1's
    1/sqrt(d_k) to q before the product instead of to the scores, a rounding of u |q_i| in each term,
    u sum |q_i k_i| in all: 1/d_k of the product's own gamma_{d_k} sum |q_i k_i|. So
    (1 + 1/d_k) + 1 times the model's bound."""
    return (2 + 1 / model.cfg.d_k) * logit_bounds(model, "fp32", src, tgt_in, pad)


def largest_logit(model: nn.Module, precision: str, src: Tensor, tgt_in: Tensor, pad: int = 0) -> float:
    """A bound on every |logit| that ``precision``'s copy of ``model`` computes for the teacher-forced
    batch src (B,S), tgt_in (B,T): the exact logits' largest magnitude plus ``logit_bounds``' largest."""
    with torch.no_grad():
        z = copy.deepcopy(model).double().eval()(src, tgt_in)
    return float(z.abs().max() + logit_bounds(model, precision, src, tgt_in, pad).max())


def assert_normalized(lp: Tensor, model: nn.Module, precision: str, src: Tensor, bos: int = SpecialIds.bos) -> None:
    """A first decoding step's float32 log-probabilities lp (B, V) from ``precision``'s copy of
    ``model`` (the rows of src (B,S) after BOS): each row's exponentials, summed in float32, within
    float32's log_softmax, exp and sum of 1 (``log_softmax_exp_sum_bound``, tests/arith.py), its
    largest logit bounded by ``largest_logit``."""
    m_abs = largest_logit(model, precision, src, torch.full((src.size(0), 1), bos))
    bound = float(log_softmax_exp_sum_bound(lp.size(-1), m_abs))
    total = lp.exp().sum(-1).double()
    assert ((total - 1).abs() <= bound).all(), (total, bound)


def ensemble_score_bound(models: list[nn.Module], fmt: str, src: Tensor, hyp: Hypothesis, cfg: DecodeConfig,
                         ids: SpecialIds = SpecialIds()) -> float:
    """``score_bound`` of an ensemble's hypothesis (decode/adapter.py ``EnsembleDecoder``: each step's
    log of the members' mean probability, logsumexp_i(lp_i) - log M), for float32 or float64 members
    (``fmt``). log-mean-exp moves by Σ_i w_i δ_i with weights w_i >= 0 summing to 1, so by at most the
    largest member's ``rounding_bound`` at that step; then its own roundings, of the M members' values
    x_i = lp_i - max (u |x_i|, an exponential's 3 u (|x_i| + 1) + exp_rel), their sum (M - 1 below it,
    which is at most M), its log (2 u |log s|, log s <= log M), the sum with the max and the
    difference with fl(log M) (u each, of values below |max| + log M, and the constant's u log M),
    summed over the |Y| steps; and the search's sum (``score_bound``)."""
    a = FORMATS[fmt]
    src, tgt_in, steps, gold = _forced(src, hyp, ids)
    members = torch.stack([rounding_bound(m, fmt, src, tgt_in, lambda lp: lp[0, steps, gold]) for m in models])
    with torch.no_grad():
        lp = torch.stack([torch.log_softmax(copy.deepcopy(m).double()(src, tgt_in), -1)[0, steps, gold]
                          for m in models])  # (M, |Y|), the exact members' values
    M = len(models)
    x = lp - lp.amax(0)
    own = (a.u * x.abs() + 3 * a.u * (x.abs() + 1) + a.exp_rel).amax(0) + M * a.u + 3 * a.u * math.log(M) \
        + 2 * a.u * (lp.amax(0).abs() + math.log(M))
    penalty = length_penalty(hyp.length, cfg.alpha, cfg.length_norm)
    return (float((members.amax(0) + own).sum()) + _search_sum(hyp, a.u, penalty)) / penalty
