"""What the kernels' tests compare against: random cases and Eq. 1 written out for the beam step's
attention, PyTorch's log-softmax and top-k, and the tiny model that beam search runs."""
import math

import torch

from tests.arith import EXP_REL_ERR, LAMBDA, U32, gamma
from tests.decode.test_adapter import V


def shared_slot_case(Bs=3, g=4, H=2, n=5, K=8, Dv=6, dtype=torch.float32, cap=7):
    """Random q (N,H,1,K), slot buffers (Bs,H,cap*g,K) with n filled positions, ancestors (Bs,g,cap)."""
    q = torch.randn(Bs * g, 1, H, K).transpose(1, 2).to(dtype)  # (N,H,1,K), strided as project_qkv gives it
    k_buf = torch.randn(Bs, H, cap * g, K).to(dtype)
    v_buf = torch.randn(Bs, H, cap * g, Dv).to(dtype)
    anc = torch.randint(0, g, (Bs, g, cap))
    return q, k_buf[:, :, : n * g], v_buf[:, :, : n * g], anc


def log_softmax_tolerance(V: int) -> float:
    """How far a float32 log-softmax of V logits may be from the exact one, from the arithmetic,
    whatever the instruction set (so a test holds on AVX2, AVX-512 and the portable loops alike):

        log p_v = (z_v - m) - log s,   s = sum_v exp(z_v - m) >= 1

    - each exponential: exp_nonpositive's relative error, EXP_REL_ERR, plus the rounding of z_v - m,
      which changes exp(z_v - m) by a factor exp(|z_v - m| u) ~ 1 + |z_v - m| u. Over s that is
      u sum_v p_v |z_v - m|, and |z_v - m| = -log p_v - log s <= -log p_v (s >= 1), so at most u
      times the entropy of p: u log V;
    - the sum of V positive terms in float32: any order of additions (PyTorch's 8- or 16-lane
      vectors, the kernel's blocks, a plain loop) has a chain of at most V - 1 of them. The
      worst case is (V - 1) u; with rounding errors that behave as independent, zero-mean
      (Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019, Theorem 4.6) it is lambda sqrt(V) u with
      probability at least 1 - 2 V exp(-lambda^2 / 2): lambda = 7 leaves about 1e-7 at V = 8000;
    - log s and the final subtraction: one rounding each of a value below log V + |log p_v|
      (the rtol of the comparison).
    A relative error r of s is an absolute error r of log s, so of every log p_v."""
    return EXP_REL_ERR + U32 * math.log(V) + LAMBDA * math.sqrt(V) * U32 + 2 * U32 * math.log(V)


def signed_sum_tolerance(abs_sum: float, n: int) -> float:
    """How far a float32 sum of n values of either sign may be from the exact one, whatever the order of
    its additions: the second item of ``log_softmax_tolerance`` with |x_i| in place of the positive
    terms (each rounding error is at most u times a partial sum, at most the sum of its terms' |x_i|),
    7 sqrt(n) u sum_i |x_i|. That also covers a double sum rounded once to float32, u |sum_i x_i|."""
    return LAMBDA * math.sqrt(n) * U32 * abs_sum


def log_softmax_topk_matches_pytorch(lib, dtype, threads):
    """The kernel's top-k log-probabilities against the exact ones (float64 from the same logits),
    within ``log_softmax_tolerance``; the ids are those of PyTorch's top-k."""
    from aiayn.decode.search import select_topk

    torch.manual_seed(3)
    banned = torch.tensor([0, 2, 3])
    for n_vocab, k in ((8000, 4), (1003, 6), (37, 5)):  # n_vocab % 16 != 0: the tail after the blocks
        z = (torch.randn(50, n_vocab) * 4).to(dtype)
        z[7, 5] = 40.0  # one token far ahead: the other exponentials underflow
        with torch.inference_mode():
            torch.set_num_threads(threads)
            try:
                values, ids = lib.log_softmax_topk(z, k, banned)
            finally:
                torch.set_num_threads(2)
            lp = torch.log_softmax(z.double(), dim=-1)  # exact up to float64's rounding
            ref_values, ref_ids = select_topk(lp.clone(), k, banned)
        tol = dict(atol=log_softmax_tolerance(n_vocab), rtol=2 * U32)
        torch.testing.assert_close(values.double(), ref_values, **tol)
        assert not torch.isin(ids, banned).any()
        # the ids are those values' tokens (bfloat16 logits tie often; which of equal tokens comes first may differ)
        torch.testing.assert_close(lp.gather(1, ids), ref_values, **tol)
        if dtype == torch.float32:
            assert torch.equal(ids, ref_ids)


def tiny_model(dtype=torch.float32):
    import aiayn.model as M

    torch.manual_seed(0)
    return M.Transformer(M.get_preset("tiny", vocab_size=V, p_drop=0.0)).to(dtype).eval()


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
