"""train.fused_loss on CUDA: the compiled Triton kernel against the plain loss (skipped, with the
reason, without a CUDA device or triton). The CPU halves: tests/train/test_fused_loss.py."""
from __future__ import annotations

import math

import pytest
import torch

import aiayn
from aiayn.model import PreSoftmax
from aiayn.data.stream import to_device
from tests.train.steps import passes
from aiayn.train.config import TrainConfig
from aiayn.train.fused_loss import fused_label_smoothed_loss, fused_loss_on, torch_rows
from tests.arith import U32, Rounded, within
from tests.grad_rounding import gradient_bound, same_gradients
from tests.rounding import summed_loss_bound
from tests.train.test_fused_loss import (PAD, _assert_same, _batch, _fused, _paths, _plain, _rows, _rows_dz,
                                       _sums_and_grads)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def kernel():
    pytest.importorskip("triton", reason="triton is not installed (pip install 'aiayn[gpu]')")
    from aiayn.kernels import triton_loss
    return triton_loss


def _problem(V, N=300, D=64):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, D, generator=g).to(CUDA).requires_grad_()
    W = (torch.randn(V, D, generator=g) * 0.3).to(CUDA).requires_grad_()
    target = torch.randint(0, V, (N,), generator=g)
    target[torch.rand(N, generator=g) < 0.2] = PAD
    return h, W, target.to(CUDA)


def _cuda_rel(h, W):
    """``_cuda_rel_of`` the logits h W^T."""
    return _cuda_rel_of(h.detach().double().cpu() @ W.detach().double().cpu().T)


def _cuda_rel_of(z):
    """The errors of CUDA's exponentials and logarithms over the logits z (N,V), for ``_paths``: the Triton
    kernel's tl.exp and tl.log are the fast ex2.approx and lg2.approx (as __expf and __logf, CUDA C
    Programming Guide, Intrinsic Functions): exp(x) within 2 + floor(1.173 |x|) ulp; log d within 3
    ulp, or 2^-21.41 absolute for d in [0.5, 2]; PyTorch's expf and logf within 2 and 1 ulp. An ulp
    is at most 2 u of the result; every argument x here (z - m, a block's rescaling, z - log Z) lies
    within a row's range of logits plus log V. Returns (the kernel's relative error, its log's
    absolute one, PyTorch's relative error)."""
    z = z.double().cpu()
    reach = float((z.amax(-1) - z.amin(-1)).max()) + math.log(z.size(-1))
    return 2 * U32 * max(2 + 1.173 * reach, 3), 2.0 ** -21.41, 2 * 2 * U32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V, chunk_rows", [(5003, 64), (37000, None)])
def test_fused_equals_plain_on_cuda(kernel, float32_sums, dtype, V, chunk_rows):
    """The compiled kernel in the chunk loop (several chunks; V = 37,000 takes two blocks of a row):
    the plain path's loss, NLL and gradients w.r.t. h and W, with padding targets, within the two
    paths' bounds (``_paths``, with CUDA's exponentials: ``_cuda_rel``)."""
    h, W, target = _problem(V)
    plain = _sums_and_grads(_plain(target, 0.1), h, W, target, dtype)
    fused = _sums_and_grads(_fused(target, 0.1, kernel.smoothed_ce_rows, chunk_rows), h, W, target, dtype)
    on_cpu = lambda r: (r[0], r[1].cpu(), r[2].cpu())  # noqa: E731
    rows_rel, rows_log_abs, plain_rel = _cuda_rel(h, W)
    paths = _paths(h.detach().cpu(), W.detach().cpu(), target.cpu(), 0.1, dtype, chunk_rows, plain_rel, rows_rel,
                   rows_log_abs)
    _assert_same(on_cpu(fused), on_cpu(plain), target.cpu(), paths)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_rows_equal_torch_rows_on_cuda(kernel, dtype):
    z = (torch.randn(64, 37000, device=CUDA) * 4).to(dtype)
    tgt = torch.randint(0, 37000, (64,), device=CUDA)
    tgt[::5] = PAD
    out = [(z.clone(), torch.empty(64, device=CUDA), torch.empty(64, device=CUDA)) for _ in range(2)]
    torch_rows(out[0][0], tgt, 0.1, PAD, out[0][1], out[0][2], True)
    kernel.smoothed_ce_rows(out[1][0], tgt, 0.1, PAD, out[1][1], out[1][2], True)
    # each path's loss, NLL and d loss / d z (rounded to dtype) from the same logits, within the sum of
    # the two bounds: the kernel's exp and log CUDA's fast ones, torch_rows' PyTorch's (_cuda_rel_of)
    rows_rel, rows_log_abs, plain_rel = _cuda_rel_of(z.float())
    zc, tc = Rounded(z.cpu()), tgt.cpu()
    bounds = []
    for rel, log_abs in ((plain_rel, 0.0), (rows_rel, rows_log_abs)):
        loss, nll, lz, keep = _rows(zc, tc, 0.1, rel, log_abs)
        dz = _rows_dz(zc, tc, 0.1, rel, lz, keep, dtype)
        bounds.append((dz, loss, nll))  # out's order: z (overwritten by d loss / d z), loss, nll
    for i, (a, b) in enumerate(zip(*out)):
        r_torch, r_kernel = bounds[0][i], bounds[1][i]
        want = a.cpu().double().reshape(r_torch.v.shape)
        within(b.cpu().double().reshape(r_torch.v.shape), want, 1.01 * (r_torch.e + r_kernel.e))


def test_fused_loss_holds_no_whole_logits(kernel):
    """4,096 rows x 37,000 types in bf16: the fused step's peak memory is a fraction of the plain one's."""
    h, W, target = _problem(37000, N=4096, D=512)
    peaks = []
    for fn in (_plain(target, 0.1), lambda h, W: fused_label_smoothed_loss(PreSoftmax(h[None], W), target[None],
                                                                           0.1, PAD)):
        h.grad = W.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn(h.bfloat16(), W.bfloat16()).loss.backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
    assert peaks[1] < 0.6 * peaks[0], peaks


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_step_fused_equals_plain_on_cuda(kernel, float32_sums, precision):
    """The loop's step with train.fused_loss auto (on: CUDA and triton) against off: the same sums
    and every parameter's gradient, in float32 each path within CUDA's float32 roundings of the exact
    ones (``summed_loss_bound``, tests/rounding.py; ``gradient_bound``, tests/grad_rounding.py), under
    bf16 within a hand tolerance."""
    cfg = aiayn.get_preset("tiny", vocab_size=301, p_drop=0.0, n_layers=2, d_model=64, d_ff=128, n_heads=4,
                           d_k=16, d_v=16)
    batch = to_device(_batch(cfg, n=8), CUDA)
    assert fused_loss_on("auto", CUDA)
    results = []
    for setting in ("off", "auto"):
        torch.manual_seed(0)
        model = aiayn.Transformer(cfg).to(CUDA).train()
        sums, _ = passes(model, [batch], TrainConfig(fused_loss=setting), 1 / batch.n_tgt_tokens, CUDA, precision)
        results.append((sums.cpu(), {n: p.grad.float().cpu() for n, p in model.named_parameters()}))
    (plain_sums, plain_g), (fused_sums, fused_g) = results
    if precision == "fp32":
        batch = to_device(batch, torch.device("cpu"))
        torch.manual_seed(0)
        model = aiayn.Transformer(cfg).train()  # the step's model
        for i, eps_ls in ((0, 0.1), (1, 0.0)):  # the loss, the NLL
            bound = summed_loss_bound(model, "fp32-cuda", batch, eps_ls, cfg.pad_id)
            assert abs(float(fused_sums[i] - plain_sums[i])) <= 2 * bound, (i, fused_sums, plain_sums, bound)
        same_gradients(fused_g, plain_g, gradient_bound(model, "fp32-cuda", batch, 0.1, 1 / batch.n_tgt_tokens,
                                                        cfg.pad_id))
        return
    rtol = 2e-2  # bf16: autocast's backward is not followed by gradient_bound
    torch.testing.assert_close(fused_sums, plain_sums, rtol=rtol, atol=1e-5)
    for name, g in plain_g.items():
        torch.testing.assert_close(fused_g[name], g, rtol=rtol, atol=rtol * g.abs().max().item() + 1e-7, msg=name)

