"""cross_entropy.c: the label-smoothed loss of training and its gradient, against the PyTorch path of
label_smoothed_loss, by hand, and in the portable build."""
import math

import pytest
import torch

from tests.arith import EXP_REL_ERR, U32, gamma, rounded_to, within
from tests.kernels.reference import log_softmax_tolerance, signed_sum_tolerance


def _loss_with(kernels, base, target, eps_ls=0.1, pad_id=0, g_loss=0.7, g_nll=-0.3):
    """label_smoothed_loss's sums and the gradient of g_loss * loss + g_nll * nll (both backward terms)."""
    from aiayn.train.objective import label_smoothed_loss

    z = base.clone().requires_grad_(True)
    sums = label_smoothed_loss(z, target, eps_ls, pad_id, kernels)
    (g_loss * sums.loss + g_nll * sums.nll).backward()
    return sums.loss.item(), sums.nll.item(), int(sums.n_tokens), z.grad


def _loss_case(V, dtype, B=5, T=7):
    torch.manual_seed(V)
    target = torch.randint(0, V, (B, T))
    target[0, 3:] = 0  # padding
    target[-1, 2] = 0
    return (3 * torch.randn(B, T, V)).to(dtype), target


def _kernel_path_bounds(base, target, eps_ls=0.1, pad_id=0, g_loss=0.7, g_nll=-0.3):
    """Bounds on the kernel path's loss and NLL sums and its gradient (N,V) (before a rounding to bfloat16)
    against the same formulas in float64, from the logits (exact in float64), for any order of the
    kernel's sums (16 or 8 lanes, a plain loop, a double sum). First order in u (2^-24); the factors 1.01
    cover the products of two relative errors and the float64 reference's own error. Per kept row:
      log Z = m + logf(sum_v exp_nonpositive(fl(z_v - m))): vexp.h's EXP_REL_ERR + 3 u (|z_v - m| + 1) per
        term (as in eq1_bounds) weighted by p_v, gamma_{V-1} for the sum, 2 u log V for logf's 1 ulp, u |log Z|;
      sum_z: gamma_{V-1} sum_v |z_v|;
      smoothed_row_losses in float32 (rows.py): 1 - eps and eps' = eps / (V - 2) rounded to float32, then
        each product, difference and sum once: u times each intermediate's size;
      the loss and NLL sums over N rows: gamma_{N-1} sum_r |loss_r|;
    backward, from float32 g_loss and g_nll (0.7 and -0.3 rounded), a = fl(g_loss + g_nll), c = fl(g_loss eps')
    and e = fl(g_loss fl(1 - eps - eps') + g_nll) (their roundings: da, dc, de), then per value
    g_v = fl(fl(p^_v a) - c) with p^_v = exp_nonpositive(fl(z_v - log Z^)) (relative error: log Z's
    error above and the exponential's), + c at the pad column, - e at the gold one (one rounding each)."""
    u = U32
    z = base.reshape(-1, base.size(-1)).double()
    N, V = z.shape
    tgt = target.reshape(-1)
    keep = (tgt != pad_id).double()
    L = torch.logsumexp(z, dim=-1)
    p = torch.exp(z - L[:, None])
    m = z.max(-1, keepdim=True).values
    assert float((z - m).min()) > -80  # exp_nonpositive's clamp at -87 not reached (nor by z - log Z^)
    e_lz = (1.01 * (p * (EXP_REL_ERR + 3 * u * ((z - m).abs() + 1))).sum(-1) + gamma(V - 1) + 2 * u * math.log(V)
            + u * (L.abs() + 1))
    S = z.sum(-1)
    e_sz = gamma(V - 1) * z.abs().sum(-1)
    zg, zp = z.gather(1, tgt[:, None]).squeeze(1), z[:, pad_id]
    eps_o = eps_ls / (V - 2)
    nll, A, Bv = L - zg, L - (1 - eps_ls) * zg, S - zg - zp
    loss = A - eps_o * Bv
    e_nll = e_lz + u * nll.abs()
    e_loss = e_lz + eps_o * e_sz + u * (2 * ((1 - eps_ls) * zg).abs() + A.abs() + eps_o * ((S - zg).abs() + 3 * Bv.abs())
                                        + loss.abs())
    bound_loss = 1.01 * (keep * e_loss).sum() + gamma(N - 1) * (keep * loss.abs()).sum()
    bound_nll = 1.01 * (keep * e_nll).sum() + gamma(N - 1) * (keep * nll.abs()).sum()
    a, c, e = g_loss + g_nll, g_loss * eps_o, g_loss * (1 - eps_ls - eps_o) + g_nll
    da = u * (abs(g_loss) + abs(g_nll) + abs(a))
    dc = 3 * u * abs(c)
    de = 3 * u * abs(g_loss * (1 - eps_ls - eps_o)) + u * (abs(g_nll) + abs(e))
    rho = 1.01 * (e_lz[:, None] + EXP_REL_ERR + 3 * u * ((z - L[:, None]).abs() + 1))
    grad = a * p - c
    grad[:, pad_id] += c
    grad.scatter_add_(1, tgt[:, None], torch.full((N, 1), -e, dtype=torch.float64))
    dg = abs(a) * p * rho + p * (1 + rho) * da + dc + u * p * (1 + rho) * (abs(a) + da) + u * (a * p - c).abs()
    dg[:, pad_id] += u * grad[:, pad_id].abs()
    dg.scatter_add_(1, tgt[:, None], de + u * grad.gather(1, tgt[:, None]).abs())
    return bound_loss, bound_nll, 1.01 * dg * keep[:, None]


def _cross_entropy_matches_pytorch(kernels, dtype, threads=1):
    """The kernel path's sums and gradient against the PyTorch path's in float64 (float64 logits: the
    same formulas, exact to 2^-53), within ``_kernel_path_bounds`` and a rounding to bfloat16 of a
    bfloat16 gradient."""
    torch.set_num_threads(threads)
    try:
        for V in (4, 37, 300):  # below one vector of 16, a tail after whole vectors, several vectors
            base, target = _loss_case(V, dtype)
            l1, n1, k1, g1 = _loss_with(kernels, base, target)
            l2, n2, k2, g2 = _loss_with(None, base.double(), target)
            assert k1 == k2
            bound_loss, bound_nll, bound_grad = _kernel_path_bounds(base, target)
            within(torch.tensor(l1, dtype=torch.float64), torch.tensor(l2, dtype=torch.float64), bound_loss)
            within(torch.tensor(n1, dtype=torch.float64), torch.tensor(n2, dtype=torch.float64), bound_nll)
            assert g1.dtype == dtype
            within(g1.view(-1, V), g2.view(-1, V), rounded_to(dtype, bound_grad, g2.view(-1, V)))
            assert torch.all(g1[target == 0] == 0)  # padding positions get no gradient
    finally:
        torch.set_num_threads(2)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_kernel_is_the_pytorch_path(kernels, dtype, threads):
    _cross_entropy_matches_pytorch(kernels, dtype, threads)


def test_cross_entropy_kernel_portable_build(portable):
    for dtype in (torch.float32, torch.bfloat16):
        _cross_entropy_matches_pytorch(portable, dtype)


@pytest.mark.parametrize("threads", [1, 2])
def test_cross_entropy_kernel_x86_64_v3_build(x86_64_v3, threads):
    # the AVX2 + FMA paths (8 wide), whatever this CPU's own build takes
    for dtype in (torch.float32, torch.bfloat16):
        _cross_entropy_matches_pytorch(x86_64_v3, dtype, threads)


@pytest.mark.parametrize("build", ["kernels", "portable", "x86_64_v3"])
def test_cross_entropy_forward_within_the_derived_bound(build, request):
    """log Z and sum_z over a vocabulary of thousands, where the order of the float32 additions (16 or
    32 partial sums, or a double sum) matters, against float64 sums of the same logits: log Z within
    ``log_softmax_tolerance`` (log Z = m + log s, the log s of the log-softmax, and one rounding of the
    sum, the rtol), sum_z within ``signed_sum_tolerance``."""
    lib = request.getfixturevalue(build)
    torch.manual_seed(5)
    for V in (8000, 8011):  # 8011: a tail after the vectors
        for dtype in (torch.float32, torch.bfloat16):
            z = (torch.randn(40, V) * 4).to(dtype)
            z[3, 7] = 40.0  # one token far ahead
            z[5] += 30.0  # logits far from 0: sum_z large beside its terms' spread
            log_z, sum_z = lib.cross_entropy_forward(z)
            zd = z.double()
            torch.testing.assert_close(log_z.double(), torch.logsumexp(zd, dim=-1), atol=log_softmax_tolerance(V),
                                       rtol=2 * U32)
            bound = torch.tensor([signed_sum_tolerance(a, V) for a in zd.abs().sum(-1).tolist()], dtype=torch.float64)
            assert torch.all((sum_z.double() - zd.sum(-1)).abs() <= bound)


def test_the_gradient_is_the_same_bits_in_every_build(kernels, portable, x86_64_v3):
    # the backward takes log Z as given and computes each value alone, by the same operations (vexp.h's
    # vector exp gives its scalar form's bits): nothing depends on the vector width
    torch.manual_seed(6)
    for V in (37, 8011):
        for dtype in (torch.float32, torch.bfloat16):
            z = (3 * torch.randn(9, V)).to(dtype)
            log_z = torch.logsumexp(z.float(), dim=-1)
            a, c, e = torch.rand(9), torch.rand(9) * 1e-3, torch.rand(9)
            gold = torch.randint(0, V, (9,))
            grads = [lib.cross_entropy_backward(z, log_z, a, c, e, gold, 0) for lib in (kernels, portable, x86_64_v3)]
            assert torch.equal(grads[0], grads[1]) and torch.equal(grads[2], grads[1])


@pytest.mark.parametrize("V", [4, 20])
def test_hand_computed_cross_entropy_kernel(kernels, V):
    # d loss / d z = p - q on one kept row, target 3, eps 0.1, logits [0, 1, 2, 3] then (V = 20) -30s
    # whose probabilities are below 1e-14: q = [0, 0.05/(V-2) ...]; at V = 4 the existing golden case
    # p = softmax([0, 1, 2, 3]) = [0.0320586, 0.0871443, 0.2368828, 0.6439143], q = [0, .05, .05, .9].
    z = torch.full((1, 1, V), -30.0)
    z[0, 0, :4] = torch.tensor([0.0, 1.0, 2.0, 3.0])
    target = torch.tensor([[3]])
    loss, nll, n, grad = _loss_with(kernels, z, target, g_loss=1.0, g_nll=0.0)
    # the hand values in float64 (exact to 2^-53, which the bounds' factors 1.01 cover), the kernel within
    # the bounds of its float32 arithmetic (_kernel_path_bounds) of them
    bound_loss, bound_nll, bound_grad = _kernel_path_bounds(z, target, g_loss=1.0, g_nll=0.0)
    eps_o = 0.1 / (V - 2)
    log_z = math.log(sum(math.exp(x) for x in (0, 1, 2, 3)) + (V - 4) * math.exp(-30))
    p = torch.tensor([math.exp(x - log_z) for x in (0, 1, 2, 3)], dtype=torch.float64)
    want = torch.full((V,), -eps_o, dtype=torch.float64)
    want[:4] = p - torch.tensor([0.0, eps_o, eps_o, 0.9], dtype=torch.float64)
    want[4:] += math.exp(-30 - log_z)  # below 1e-14, but the bound there is about u eps' ~ 1e-10
    within(grad.view(-1), want, bound_grad.view(-1))
    within(torch.tensor(nll, dtype=torch.float64), torch.tensor(log_z - 3.0, dtype=torch.float64), bound_nll)
    # loss = log Z - (1 - eps) z_gold - eps' (sum_z - z_gold - z_pad), pad id 0 (whose logit is 0)
    want_loss = log_z - 0.9 * 3.0 - eps_o * (6.0 - 30.0 * (V - 4) - 3.0 - 0.0)
    within(torch.tensor(loss, dtype=torch.float64), torch.tensor(want_loss, dtype=torch.float64), bound_loss)
    assert n == 1


def test_cross_entropy_kernel_rejects_bad_input(kernels):
    z = torch.randn(3, 10)
    row = torch.zeros(3)
    with pytest.raises(ValueError):
        kernels.cross_entropy_backward(z, row, row, row, row, torch.tensor([1, 10, 2]), 0)  # gold id >= V
    with pytest.raises(ValueError):
        kernels.cross_entropy_backward(z, row, row, row, row, torch.tensor([1, 2, 3]), 10)  # pad id >= V
    with pytest.raises(ValueError):
        kernels.cross_entropy_forward(z.double())
    # rows with a stride of their own (a slice of wider logits): read in place
    from aiayn.train.objective import label_smoothed_loss

    base, target = _loss_case(37, torch.float32, B=1)
    wide = torch.cat([base, torch.randn(1, base.size(1), 5)], dim=-1)
    grads = []
    for k, dtype in ((kernels, torch.float32), (None, torch.float64)):  # the kernel; the same sums in float64
        w = wide.to(dtype, copy=True).requires_grad_(True)
        sums = label_smoothed_loss(w[..., :37], target, 0.1, 0, k)
        sums.loss.backward()
        grads.append((sums.loss.item(), w.grad))
        if k is not None:
            assert w[..., :37].reshape(-1, 37).stride(0) == 42  # the kernel's case: a row stride that is not V
    # within the bounds of the kernel's float32 arithmetic (the gradient of the loss alone: g_nll = 0)
    bound_loss, _, bound_grad = _kernel_path_bounds(base, target, g_loss=1.0, g_nll=0.0)
    within(torch.tensor(grads[0][0], dtype=torch.float64), torch.tensor(grads[1][0], dtype=torch.float64), bound_loss)
    within(grads[0][1][..., :37].reshape(-1, 37), grads[1][1][..., :37].reshape(-1, 37), bound_grad)
    assert torch.all(grads[0][1][..., 37:] == 0)
