"""seq_attention.c: the attention of training, forward and backward, against Eq. 1 written out
(attention_explicit) and its autograd in float64, within bounds derived from the kernel's float32
arithmetic (``eq1_bounds``)."""
import math

import pytest
import torch

from aiayn.model.attention import attention_explicit
from tests.kernels.reference import EXP_REL_ERR, U32, U_BF16


def gamma(n, u=U32):
    """Higham's gamma_n = n u / (1 - n u): the relative error of n roundings in a row, and of a sum of
    n + 1 terms (or an n-term dot product with or without FMA) in any order, relative to the sum of
    the terms' absolute values (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., §3.1)."""
    n = torch.as_tensor(n, dtype=torch.float64).clamp(min=0)
    return n * u / (1 - n * u)




def rounded_to(dtype, bound, exact):
    """``bound`` on a float32 result's error, plus its rounding to ``dtype`` at the end: round to
    nearest even moves x by at most u |x| (bfloat16's u = 2^-8; nothing for float32)."""
    return bound if dtype == torch.float32 else bound + U_BF16 * (exact.abs() + bound)


def within(got, want, bound):
    """|got - want| <= bound elementwise (want and bound float64), with the worst entry in the message."""
    err = (got.detach().double() - want).abs()
    ok = err <= bound
    assert bool(ok.all()), (f"{int((~ok).sum())} of {ok.numel()} entries past the bound; the worst is "
                            f"{float(err[~ok].max())} against {float(bound.expand_as(err)[~ok][(err[~ok]).argmax()])}")


def eq1_bounds(q, k, v, allowed, g=None):
    """A priori bounds on the error of Eq. 1 computed as seq_attention.c and beam_attention.c do in
    float32, whatever the order of their sums, with or without FMA (AVX-512, AVX2, plain loops), against
    the exact values; elementwise, from the inputs (exact in float64), all (B,H,...) float64:
    out (B,H,T,Dv), lse (B,H,T), and given dout g (B,H,T,Dv) the gradients dq, dk, dv. ``allowed``
    (B|1,H|1,T,S) bool: the keys each query sees. First order in u; the factors 1.01 cover the
    products of two relative errors (all below 1e-3, asserted) and the float64 reference's own error
    (the same expressions with 2^-53 for 2^-24). The steps, per query row i and key j (n_i keys seen):
      s_ij = fl(q_i fl32(1/sqrt K)) . k_j over K terms: |error| <= sigma_ij = gamma_{K+2} |q_i|.|k_j| / sqrt K;
      exp_nonpositive(x), x = fl(s_ij - m): relative EXP_REL_ERR, plus u |x| for the rounding of x, u |x|
        for that of x log2(e) and 0.23 u |x| for fl32(log2(e))'s own: under 3 u (|x| + 1) (x > -87 here,
        asserted, so its clamp plays no part); an error delta of s_ij is a factor exp(delta) of it;
      l = sum_j exp(.): gamma_{n-1}; p_ij = exp(.) fl(1/l): 2 u; so |p^ - p| <= rho p, rho the sum of those;
      out_i = sum_j p_ij v_j (FMA chain or 8/16 lanes): gamma_n sum_j p^_ij |v_j| beside the weights' error;
      lse_i = m + logf(l): l's relative error (as an absolute one of log l), glibc logf's 1 ulp
        (2 u log n_i) and one rounding of the sum;
    backward, p recomputed from the forward's lse (its error above), dp_ij = dout_i . v_j (gamma_Dv),
    D_i = sum_j p_ij dp_ij (gamma_n), ds = fl(p fl(dp - D)) (2 u), dq_i = fl(scale sum_j ds_ij k_j)
    (gamma_{n+2}), dk_j = sum_i ds_ij fl(q_i scale) (gamma_{T+2}), dv_j = sum_i p_ij dout_i (gamma_T)."""
    q, k, v = (t.detach().double() for t in (q, k, v))
    B, H, T, K = q.shape
    S = k.size(2)
    allowed = allowed.expand(B, H, T, S)
    scale = 1.0 / math.sqrt(K)
    n = allowed.sum(-1, keepdim=True).double()  # (B,H,T,1) keys seen
    zero = torch.zeros((), dtype=torch.float64)
    s = (q @ k.transpose(-2, -1) * scale).masked_fill(~allowed, -math.inf)
    L = torch.logsumexp(s, dim=-1, keepdim=True).nan_to_num(neginf=0.0)  # 0 for a row with no key
    p = torch.exp(s - L)  # exactly 0 where not allowed
    sigma = torch.where(allowed, gamma(K + 2) * (q.abs() @ k.abs().transpose(-2, -1)) * scale, zero)
    m = s.max(-1, keepdim=True).values
    assert bool(((s - m)[allowed] > -80).all())  # 87 less the error of s: exp_nonpositive's clamp not reached
    e_fwd = torch.where(allowed, EXP_REL_ERR + 3 * U32 * ((s - m).abs() + 1), zero)
    denom = (p * (sigma + e_fwd)).sum(-1, keepdim=True) + gamma(n - 1)  # relative error of l
    rho1 = sigma + e_fwd + denom + 2 * U32
    assert float(rho1.max()) < 1e-3
    rho = torch.where(allowed, torch.expm1(1.01 * rho1), zero)  # |p^ - p| <= rho p
    out = (p * (rho + gamma(n) * (1 + rho))) @ v.abs()
    lse = (1.01 * denom + 2 * U32 * torch.log(n.clamp(min=1)) + U32 * (L.abs() + 1)).squeeze(-1)
    bounds = {"out": 1.01 * out, "lse": 1.01 * lse}
    if g is None:
        return bounds
    g = g.detach().double()
    e_bwd = torch.where(allowed, EXP_REL_ERR + 3 * U32 * ((s - L).abs() + 1), zero)
    rb1 = torch.where(allowed, sigma + bounds["lse"][..., None] + e_bwd, zero)
    assert float(rb1.max()) < 1e-3
    rb = torch.expm1(1.01 * rb1)  # the backward's |p^ - p| <= rb p
    dp = g @ v.transpose(-2, -1)
    tau = gamma(v.size(-1)) * (g.abs() @ v.abs().transpose(-2, -1))  # |dp^ - dp|
    D = (p * dp).sum(-1, keepdim=True)
    pr = p * (1 + rb)  # |p^| <= pr
    dD = (rb * p * dp.abs() + pr * tau).sum(-1, keepdim=True) + gamma(n) * (pr * (dp.abs() + tau)).sum(-1, keepdim=True)
    ds = p * (dp - D)
    dds = rb * p * (dp - D).abs() + pr * (tau + dD) + 2 * U32 * pr * ((dp - D).abs() + tau + dD)  # |ds^ - ds|
    ads = ds.abs() + dds
    bounds["dq"] = 1.01 * scale * (dds @ k.abs() + gamma(n + 2) * (ads @ k.abs()))
    bounds["dk"] = 1.01 * scale * (dds.transpose(-2, -1) @ q.abs() + gamma(T + 2) * (ads.transpose(-2, -1) @ q.abs()))
    bounds["dv"] = 1.01 * ((rb * p).transpose(-2, -1) @ g.abs() + gamma(T) * (pr.transpose(-2, -1) @ g.abs()))
    return bounds


def _heads_case(B=3, H=2, T=7, S=9, K=32, Dv=32, dtype=torch.float32, masked=True, seed=0):
    """q (B,H,T,K) and k, v (B,H,S,K|Dv) as the model makes them: views of (B, L, H*d) projection outputs
    (k and v slices of one fused tensor), and a key-padding mask (B,1,1,S) with a real key in every row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H * K, generator=g).to(dtype)
    kv = torch.randn(B, S, H * (K + Dv), generator=g).to(dtype)
    q = x.view(B, T, H, K).transpose(1, 2)
    k = kv[..., :H * K].view(B, S, H, K).transpose(1, 2)
    v = kv[..., H * K:].view(B, S, H, Dv).transpose(1, 2)
    lens = torch.randint(1, S + 1, (B,), generator=g)
    lens[0] = S
    mask = (torch.arange(S)[None] < lens[:, None])[:, None, None, :] if masked else None
    return q, k, v, mask


def check_seq_attention(q, k, v, mask, causal, out, lse, g=None, grads=None):
    """A call of ``seq_attention_forward`` (out, lse) and, given its dout g (B,T,H*Dv), of
    ``seq_attention_backward`` (grads: dq, dk, dv) against Eq. 1 (attention_explicit) and its autograd in
    float64, within ``eq1_bounds`` and, for bfloat16 heads, one rounding of each output to bfloat16."""
    B, H, T, K = q.shape
    S, Dv = k.size(2), v.size(-1)
    qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    m = mask
    if causal:
        c = torch.ones(T, S, dtype=torch.bool).tril(S - T)
        m = c if m is None else m & c
    allowed = (torch.ones(T, S, dtype=torch.bool) if m is None else m).expand(B, 1, T, S)
    ref, _ = attention_explicit(qd, kd, vd, m)  # (B,H,T,Dv)
    g_heads = None if g is None else g.double().view(B, T, H, Dv).transpose(1, 2)  # (B,H,T,Dv)
    bound = eq1_bounds(q, k, v, allowed, g_heads)
    seen = allowed.any(-1).expand(B, H, T)  # rows with a key to see (others: the kernel's zeros)
    assert out.dtype == q.dtype and out.shape == (B, T, H * Dv)
    out_heads = out.view(B, T, H, Dv).transpose(1, 2)
    within(out_heads[seen], ref.detach()[seen], rounded_to(q.dtype, bound["out"], ref.detach())[seen])
    assert (out_heads[~seen] == 0).all()
    scores = (qd.detach() @ kd.detach().transpose(-2, -1) / math.sqrt(K)).masked_fill(~allowed, -math.inf)
    within(lse[seen], torch.logsumexp(scores, dim=-1)[seen], bound["lse"][seen])
    if g is None:
        return
    (ref * g_heads).sum().backward()
    for name, got, want in zip(("dq", "dk", "dv"), grads, (qd.grad, kd.grad, vd.grad)):
        assert got.shape == want.shape and got.dtype == q.dtype
        want = want.nan_to_num()
        within(got, want, rounded_to(q.dtype, bound[name].nan_to_num(), want))


def _seq_attention_matches_eq1(lib, q, k, v, mask, causal, threads=1):
    """Forward and backward of the kernel (``threads`` threads) within ``check_seq_attention``."""
    B, T, H, Dv = q.size(0), q.size(2), q.size(1), v.size(-1)
    # dout in the heads' dtype: the values the kernel multiplies by, so the reference takes the same
    g = torch.randn(B, T, H * Dv, generator=torch.Generator().manual_seed(1)).to(q.dtype)
    torch.set_num_threads(threads)
    try:
        out, lse = lib.seq_attention_forward(q, k, v, mask, causal)
        dq, dk, dv = lib.seq_attention_backward(q, k, v, mask, causal, lse, g)
    finally:
        torch.set_num_threads(2)
    check_seq_attention(q, k, v, mask, causal, out, lse, g, (dq, dk, dv))
    return out, dq, dk, dv


@pytest.mark.parametrize("K,Dv", [(32, 32), (64, 64), (16, 24)])  # the AVX-512 path's two and the plain loops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal,masked", [(False, False), (False, True), (True, False), (True, True)])
def test_seq_attention_is_eq1(kernels, K, Dv, dtype, causal, masked):
    T = 9 if causal else 7  # causal: the decoder's self-attention, T = S
    _seq_attention_matches_eq1(kernels, *_heads_case(T=T, K=K, Dv=Dv, dtype=dtype, masked=masked), causal)


def test_seq_attention_long_rows_and_bottom_right_causal(kernels):
    # more than four query blocks and several 16-key chunks with a tail; a causal T < S (a chunk of queries
    # after cached keys: query i sees keys j <= i + S - T) where PyTorch's masks are bottom-right aligned
    _seq_attention_matches_eq1(kernels, *_heads_case(B=2, T=37, S=45, K=32, Dv=32), False)
    _seq_attention_matches_eq1(kernels, *_heads_case(B=2, T=5, S=21, K=32, Dv=32, masked=False), True)
    _seq_attention_matches_eq1(kernels, *_heads_case(B=2, T=5, S=21, K=16, Dv=8, masked=False), True)


@pytest.mark.parametrize("K", [32, 16])
def test_seq_attention_two_threads_are_one(kernels, K):
    case = _heads_case(B=5, H=3, T=11, S=11, K=K, Dv=K, dtype=torch.bfloat16)
    one = _seq_attention_matches_eq1(kernels, *case, True, threads=1)
    two = _seq_attention_matches_eq1(kernels, *case, True, threads=2)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_seq_attention_portable_build(portable):
    assert not portable.seq_attention_fast(32, 32)  # no AVX-512 path there; the plain loops, the same numbers
    for dtype in (torch.float32, torch.bfloat16):
        for causal in (False, True):
            _seq_attention_matches_eq1(portable, *_heads_case(T=9, S=9, dtype=dtype), causal)


def test_hand_computed_seq_attention(kernels):
    # one head, d_k = 32, one query q = e_0 * sqrt(32), keys k_0 = 0 and k_1 = ln(3) e_0: scores 0 and
    # ln 3, weights 1/4 and 3/4; values 4 and 8 in every column: out = 1 + 6 = 7. With dout = 1 in
    # every column: dv_j = p_j dout = 1/4, 3/4; dp_j = dout . v_j = 128, 256, D = 32 + 192 = 224,
    # ds = p (dp - D) = -24, 24; dq = ds_1 k_1 / sqrt(32) = 24 ln 3 / sqrt(32) at column 0; dk_j = ds_j q / sqrt(32)
    # = -24, 24 at column 0. A third key, masked, changes nothing.
    K = 32
    q = torch.zeros(1, 1, 1, K)
    q[..., 0] = math.sqrt(K)
    k = torch.zeros(1, 1, 3, K)
    k[0, 0, 1, 0] = math.log(3.0)
    k[0, 0, 2, 0] = 100.0
    v = torch.tensor([4.0, 8.0, -50.0]).view(1, 1, 3, 1).expand(1, 1, 3, K).contiguous()
    mask = torch.tensor([True, True, False]).view(1, 1, 1, 3)
    out, lse = kernels.seq_attention_forward(q, k, v, mask, False)
    dq, dk, dv = kernels.seq_attention_backward(q, k, v, mask, False, lse, torch.ones(1, 1, K))
    # the hand values are exact (to float64's rounding, which eq1_bounds's factors 1.01 cover): the kernel
    # within the float32 arithmetic's bounds of them
    bound = eq1_bounds(q, k, v, mask, torch.ones(1, 1, 1, K))
    f64 = dict(dtype=torch.float64)
    within(out.view(1, 1, 1, K), torch.full((1, 1, 1, K), 7.0, **f64), bound["out"])
    within(lse.view(1, 1, 1), torch.full((1, 1, 1), math.log(4.0), **f64), bound["lse"])  # log(e^0 + e^ln3)
    want_dq = torch.zeros(1, 1, 1, K, **f64)
    want_dq[..., 0] = 24 * math.log(3.0) / math.sqrt(K)
    within(dq.view(1, 1, 1, K), want_dq, bound["dq"])
    want_dk = torch.zeros(1, 1, 3, K, **f64)
    want_dk[0, 0, 0, 0], want_dk[0, 0, 1, 0] = -24.0, 24.0
    within(dk.view(1, 1, 3, K), want_dk, bound["dk"])
    want_dv = torch.tensor([0.25, 0.75, 0.0], **f64).view(1, 1, 3, 1).expand(1, 1, 3, K)
    within(dv.view(1, 1, 3, K), want_dv, bound["dv"])


def test_seq_attention_rejects_bad_input(kernels):
    q, k, v, mask = _heads_case()
    with pytest.raises(ValueError):
        kernels.seq_attention_forward(q.contiguous(), k, v, mask, False)  # heads not adjacent in a row
    with pytest.raises(ValueError):
        kernels.seq_attention_forward(q.double(), k.double(), v.double(), mask, False)
    with pytest.raises(ValueError):
        kernels.seq_attention_forward(q, k, v, mask[..., :3], False)  # mask of another length
    out, lse = kernels.seq_attention_forward(q, k, v, mask, False)
    with pytest.raises(ValueError):
        kernels.seq_attention_backward(q, k, v, mask, False, lse[:, :1], torch.zeros_like(out))
