"""cross_entropy.c: the label-smoothed loss of training and its gradient, against the PyTorch path of
label_smoothed_loss, by hand, and in the portable build."""
import math

import pytest
import torch

from tests.kernels.reference import U32, log_softmax_tolerance, signed_sum_tolerance


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


def _cross_entropy_matches_pytorch(kernels, dtype, threads=1):
    torch.set_num_threads(threads)
    try:
        for V in (4, 37, 300):  # below one vector of 16, a tail after whole vectors, several vectors
            base, target = _loss_case(V, dtype)
            l1, n1, k1, g1 = _loss_with(kernels, base, target)
            l2, n2, k2, g2 = _loss_with(None, base, target)
            assert k1 == k2
            assert l1 == pytest.approx(l2, rel=1e-5) and n1 == pytest.approx(n2, rel=1e-5)
            assert g1.dtype == dtype
            tol = 1e-6 if dtype == torch.float32 else 4e-3  # bf16: one rounding step of values below 0.5
            torch.testing.assert_close(g1.float(), g2.float(), atol=tol, rtol=1e-5 if dtype == torch.float32 else 8e-3)
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
    loss, nll, n, grad = _loss_with(kernels, z, torch.tensor([[3]]), g_loss=1.0, g_nll=0.0)
    eps_o = 0.1 / (V - 2)
    p = torch.tensor([0.0320586, 0.0871443, 0.2368828, 0.6439143])
    want = torch.full((V,), -eps_o)
    want[:4] = p - torch.tensor([0.0, eps_o, eps_o, 0.9])
    torch.testing.assert_close(grad.view(-1), want, atol=1e-6, rtol=0)
    log_z = math.log(sum(math.exp(x) for x in (0, 1, 2, 3)) + (V - 4) * math.exp(-30))
    assert nll == pytest.approx(log_z - 3.0, abs=1e-5)
    # loss = log Z - (1 - eps) z_gold - eps' (sum_z - z_gold - z_pad), pad id 0 (whose logit is 0)
    assert loss == pytest.approx(log_z - 0.9 * 3.0 - eps_o * (6.0 - 30.0 * (V - 4) - 3.0 - 0.0), abs=1e-5)
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
    grads = []
    for k in (kernels, None):
        wide = torch.cat([base, torch.randn(1, base.size(1), 5)], dim=-1).requires_grad_(True)
        sums = label_smoothed_loss(wide[..., :37], target, 0.1, 0, k)
        sums.loss.backward()
        grads.append((sums.loss.item(), wide.grad))
    assert wide[..., :37].reshape(-1, 37).stride(0) == 42  # the kernel's case: a row stride that is not V
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-6)
    torch.testing.assert_close(grads[0][1], grads[1][1], atol=1e-6, rtol=1e-5)
    assert torch.all(grads[0][1][..., 37:] == 0)
