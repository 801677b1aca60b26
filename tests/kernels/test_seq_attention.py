"""seq_attention.c: the attention of training, forward and backward, against Eq. 1 written out
(attention_explicit) and its autograd in float64, within bounds derived from the kernel's float32
arithmetic (``eq1_bounds``)."""
import math

import pytest
import torch

from aiayn.model.attention import attention_explicit
from tests.arith import rounded_to, within
from tests.kernels.reference import eq1_bounds


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
