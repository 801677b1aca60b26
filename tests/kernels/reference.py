"""What the kernels' tests compare against: random cases and Eq. 1 written out for the beam step's
attention, PyTorch's log-softmax and top-k, and the tiny model that beam search runs."""
import math

import torch

from tests.decode.test_adapter import V


def shared_slot_case(Bs=3, g=4, H=2, n=5, K=8, Dv=6, dtype=torch.float32, cap=7):
    """Random q (N,H,1,K), slot buffers (Bs,H,cap*g,K) with n filled positions, ancestors (Bs,g,cap)."""
    q = torch.randn(Bs * g, 1, H, K).transpose(1, 2).to(dtype)  # (N,H,1,K), strided as project_qkv gives it
    k_buf = torch.randn(Bs, H, cap * g, K).to(dtype)
    v_buf = torch.randn(Bs, H, cap * g, Dv).to(dtype)
    anc = torch.randint(0, g, (Bs, g, cap))
    return q, k_buf[:, :, : n * g], v_buf[:, :, : n * g], anc


U32 = 2.0 ** -24  # float32's unit roundoff
U_BF16 = 2.0 ** -8  # bfloat16's unit roundoff: round to nearest even keeps 8 significant bits
LAMBDA = 7.0  # how many standard deviations a probabilistic bound allows (see log_softmax_tolerance)
# exp_nonpositive's (kernels/vexp.h) relative error before the rounding of its argument: its polynomial's
# minimax error, 2.0e-9 (2.1e-9 with the float32 coefficients), plus gamma_6 = 6u / (1 - 6u) for its six
# FMAs (Horner over positive terms: each rounds a partial value below the result)
EXP_REL_ERR = 2.1e-9 + 6 * U32 / (1 - 6 * U32)


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
