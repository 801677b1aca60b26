"""train.fused_loss: the projection and the loss in chunks of rows against the plain path, on the CPU.

The chunk loop with PyTorch's row passes (``torch_rows``), then the Triton kernel through Triton's
interpreter (``TRITON_INTERPRET=1``, CPU tensors), then the model's ``project=False`` and the
training step's switch. The compiled kernel on a GPU: tests/gpu/test_fused_loss.py.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import aiayn
from aiayn.config import ConfigError
from aiayn.data.batching import collate
from aiayn.model import PreSoftmax
from tests.train.steps import passes
from aiayn.train.config import TrainConfig
from aiayn.train.fused_loss import _CHUNK_ELEMENTS, fused_label_smoothed_loss, fused_loss_on, torch_rows
from aiayn.train.objective import label_smoothed_loss
from tests.conftest import REPO
from tests.arith import PT_EXP_REL_ERR, Rounded, U32, within
from tests.grad_rounding import gradient_bound, same_gradients
from tests.rounding import summed_loss_bound

PAD = 3  # not 0, so a pad column other than the first is excluded from q
G_LOSS = 0.37  # the upstream gradient of the loss
# the exponential and logarithm of a chunk's rows: PyTorch's (torch_rows; 1 ulp) or, for the Triton
# kernel in its interpreter, NumPy's float32 SIMD ones (2.52 and 3.83 ulp at most, NumPy's figures):
# 4 ulp, 8 u, covers both
ROWS_EXP_LOG_REL_ERR = 8 * U32


def _problem(V: int, N: int = 37, D: int = 16, seed: int = 0):
    """h (N,D) and W (V,D) as float32 leaves, and targets (N,) with a fifth of them padding."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g).requires_grad_()
    W = (torch.randn(V, D, generator=g) * 0.5).requires_grad_()
    target = torch.randint(0, V, (N,), generator=g)
    target[torch.rand(N, generator=g) < 0.2] = PAD
    return h, W, target


def _sums_and_grads(fn, h, W, target, dtype):
    """The sums of ``fn(h, W)`` (h and W cast to ``dtype``, as under autocast) and the float32
    leaves' gradients of G_LOSS * loss (an upstream gradient other than 1)."""
    h.grad = W.grad = None
    sums = fn(h.to(dtype), W.to(dtype))
    (G_LOSS * sums.loss).backward()
    return [sums.loss.item(), sums.nll.item(), sums.n_tokens.item()], h.grad.clone(), W.grad.clone()


def _plain(target, eps_ls):
    return lambda h, W: label_smoothed_loss((h @ W.t())[None], target[None], eps_ls, PAD)  # logits (1,N,V)


def _fused(target, eps_ls, rows, chunk_rows):
    return lambda h, W: fused_label_smoothed_loss(PreSoftmax(h[None], W), target[None], eps_ls, PAD, rows, chunk_rows)


def _rows(z, tgt, eps_ls, rel, log_abs=0.0):
    """Loss and NLL per row of the ``Rounded`` logits z (c,V) (smoothed_row_losses), 0 on padding
    rows, with log Z and the rows kept; ``rel``: the exponential's and logarithm's relative error,
    ``log_abs``: the logarithm's absolute error besides."""
    keep = (tgt != PAD)[:, None]
    lz = z.logsumexp(exp_rel=rel, log_rel=rel, log_abs=log_abs)
    zg, zp = z.gather(tgt[:, None]), z.gather(torch.full_like(tgt, PAD)[:, None])
    eps_o = eps_ls / (z.v.size(-1) - 2)
    loss = lz - Rounded.const(1.0 - eps_ls) * zg - Rounded.const(eps_o) * (z.sum() - zg - zp)
    return loss.at(keep), (lz - zg).at(keep), lz, keep


def _rows_dz(z, tgt, eps_ls, rel, lz, keep, dtype):
    """torch_rows' d loss / d z of the ``Rounded`` logits z (c,V), softmax - q (0 on padding rows),
    rounded to ``dtype``, from ``_rows``' log Z and rows kept; ``rel``: the exponential's relative error."""
    pad, gold = _masks(tgt, z.v.size(-1))
    eps_o = eps_ls / (z.v.size(-1) - 2)
    return ((z - lz).exp(rel) - Rounded.const(eps_o) + Rounded.const(eps_o).at(pad)
            + Rounded.const(eps_o - (1.0 - eps_ls)).at(gold)).at(keep).to(dtype)


def _masks(tgt, V):
    """The pad and gold columns of the rows kept: (c,V) each."""
    keep = (tgt != PAD)[:, None]
    return (torch.arange(V) == PAD)[None] & keep, torch.nn.functional.one_hot(tgt, V).bool() & keep


def _paths(h, W, target, eps_ls, dtype, chunk_rows, plain_rel=PT_EXP_REL_ERR, rows_rel=ROWS_EXP_LOG_REL_ERR,
           rows_log_abs=0.0):
    """Both paths' loss, NLL, grad_h and grad_W as ``Rounded`` values (exact value and error bound),
    following their operations from h and W cast to ``dtype`` (exact): the logits h W^T in ``dtype``
    (float32 sums of D products, rounded to ``dtype``), float32 statistics (``_SmoothedCrossEntropy``'s
    PyTorch path; a chunk's rows by torch_rows, whose steps round at least as often as the Triton
    kernel's, with ``rows_rel`` and ``rows_log_abs``; ``plain_rel``: the plain path's exp and log), d loss / d z rounded to ``dtype``, its products with W and h
    in ``dtype`` (grad_W over the chunks: bfloat16 products summed in float32, or float32 addmm_), and
    the upstream gradient (float32 G_LOSS) applied where each path applies it. Returns (plain, fused)."""
    N, V = h.size(0), W.size(0)
    H, Wd = Rounded(h.detach().to(dtype)), Rounded(W.detach().to(dtype))
    eps_o = eps_ls / (V - 2)
    g_loss = Rounded.const(G_LOSS)
    rows = lambda z, tgt, rel, log_abs=0.0: _rows(z, tgt, eps_ls, rel, log_abs)  # noqa: E731
    masks = lambda tgt: _masks(tgt, V)  # noqa: E731

    z = (H @ Wd.T).to(dtype)
    loss, nll, lz, keep = rows(z, target, plain_rel)  # PyTorch's exp and log (on the CPU: 1 ulp)
    pad, gold = masks(target)
    c, e = g_loss * Rounded.const(eps_o), g_loss * Rounded.const(1.0 - eps_ls - eps_o)
    dz = ((z - lz).exp() * g_loss - c + c.at(pad) - e.at(gold)).at(keep).to(dtype)
    plain = (loss.sum(0), nll.sum(0), (dz @ Wd).to(dtype), (dz.T @ H).to(dtype))

    chunk = chunk_rows or max(1, _CHUNK_ELEMENTS // V)
    loss, nll, grad_h = [], [], []
    grad_W = Rounded(torch.zeros(W.shape))
    for i in range(0, N, chunk):
        zc, tgt = (H[i:i + chunk] @ Wd.T).to(dtype), target[i:i + chunk]
        lc, nc, lz, keep = rows(zc, tgt, rows_rel, rows_log_abs)
        dz = _rows_dz(zc, tgt, eps_ls, rows_rel, lz, keep, dtype)
        loss.append(lc)
        nll.append(nc)
        grad_h.append((dz @ Wd).to(dtype))
        if dtype == torch.float32:
            grad_W = grad_W.addmm(dz.T, H[i:i + chunk])
        else:
            grad_W = grad_W + (dz.T @ H[i:i + chunk]).to(dtype)
    cat = lambda parts: Rounded(torch.cat([r.v for r in parts]), torch.cat([r.e for r in parts]))  # noqa: E731
    fused = (cat(loss).sum(0), cat(nll).sum(0), (cat(grad_h) * g_loss).to(dtype), (grad_W * g_loss).to(dtype))
    return plain, fused


def _assert_same(fused, plain, target, paths):
    """The same token count; loss, NLL and the gradients w.r.t. h and W (whose exact values agree)
    within the sum of the two paths' bounds (``_paths``; 1.01: float64's own rounding)."""
    assert fused[0][2] == plain[0][2] == int((target != PAD).sum())
    for got, want, rp, rf in zip((*fused[0][:2], *fused[1:]), (*plain[0][:2], *plain[1:]), *paths):
        assert torch.allclose(rf.v, rp.v, rtol=1e-9, atol=1e-12)  # the same value, float64 twice
        got, want = (torch.as_tensor(x, dtype=torch.float64).reshape(rp.v.shape) for x in (got, want))
        within(got, want, 1.01 * (rp.e + rf.e))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V, chunk_rows", [(50, 8), (301, 37), (301, None)])
@pytest.mark.parametrize("eps_ls", [0.1, 0.0])
def test_torch_chunks_equal_the_plain_loss(dtype, V, chunk_rows, eps_ls):
    """The chunk loop without Triton: loss, NLL, token count and the gradients w.r.t. h and W
    (5 chunks of 8 rows, the last one short; one chunk; the default size) with padding targets."""
    h, W, target = _problem(V)
    plain = _sums_and_grads(_plain(target, eps_ls), h, W, target, dtype)
    fused = _sums_and_grads(_fused(target, eps_ls, torch_rows, chunk_rows), h, W, target, dtype)
    _assert_same(fused, plain, target, _paths(h, W, target, eps_ls, dtype, chunk_rows))


def interpreted_checks() -> None:
    """The Triton kernel against the plain path, run in a child process that set
    ``TRITON_INTERPRET=1`` before importing triton (triton decides at import, for its own library
    too, whether its kernels compile or run interpreted on CPU tensors)."""
    from aiayn.kernels import triton_loss
    for dtype in (torch.float32, torch.bfloat16):
        for V, chunk_rows in ((50, 8), (300, None)):  # five chunks, the last one short; one chunk
            h, W, target = _problem(V)
            plain = _sums_and_grads(_plain(target, 0.1), h, W, target, dtype)
            fused = _sums_and_grads(_fused(target, 0.1, triton_loss.smoothed_ce_rows, chunk_rows), h, W, target, dtype)
            _assert_same(fused, plain, target, _paths(h, W, target, 0.1, dtype, chunk_rows))
    # row by row with rows wider than one block of the kernel's loop (V = 70 in blocks of 32)
    triton_loss._MAX_BLOCK = 32
    z = torch.randn(9, 70, generator=torch.Generator().manual_seed(0)) * 3
    tgt = torch.tensor([5, PAD, 0, 69, 7, PAD, 1, 2, 33])
    out = [(z.clone(), torch.empty(9), torch.empty(9)) for _ in range(2)]
    torch_rows(out[0][0], tgt, 0.1, PAD, out[0][1], out[0][2], True)
    triton_loss.smoothed_ce_rows(out[1][0], tgt, 0.1, PAD, out[1][1], out[1][2], True)
    # both within the bounds of a chunk's rows in _paths (torch_rows's steps, which round at least as
    # often as the kernel's, with ROWS_EXP_LOG_REL_ERR) of the exact values
    Z = Rounded(z)
    loss, nll, lz, keep = _rows(Z, tgt, 0.1, ROWS_EXP_LOG_REL_ERR)
    pad, gold = _masks(tgt, 70)
    eps_o = 0.1 / 68
    dz = ((Z - lz).exp(ROWS_EXP_LOG_REL_ERR) - Rounded.const(eps_o) + Rounded.const(eps_o).at(pad)
          + Rounded.const(eps_o - 0.9).at(gold)).at(keep)
    for got in out:
        within(got[0].double(), dz.v, 1.01 * dz.e)
        within(got[1].double(), loss.v.squeeze(1), 1.01 * loss.e.squeeze(1))
        within(got[2].double(), nll.v.squeeze(1), 1.01 * nll.e.squeeze(1))
    assert out[1][0][tgt == PAD].abs().max() == 0 and out[1][1][tgt == PAD].abs().max() == 0


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (pip install triton, or the [test] extra)")
def test_triton_kernel_in_the_interpreter():
    """The Triton kernel in the chunk loop, interpreted on the CPU: the plain path's sums and
    gradients (float32 and bf16, with padding targets, several chunks), and ``torch_rows``'s rows."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = "from tests.train.test_fused_loss import interpreted_checks; interpreted_checks()"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]


def test_no_gradient_work_without_grad():
    """Under no_grad (validation) the sums are the same and nothing asks for a backward."""
    h, W, target = _problem(50)
    with torch.no_grad():
        sums = _fused(target, 0.1, torch_rows, 8)(h, W)
        plain = _plain(target, 0.1)(h, W)
    assert not sums.loss.requires_grad
    # loss and NLL within the sum of the two paths' bounds (``_paths``: the same forward as with grad)
    bounds = _paths(h, W, target, 0.1, torch.float32, 8)
    for got, want, rp, rf in zip((sums.loss, sums.nll), (plain.loss, plain.nll), *(b[:2] for b in bounds)):
        within(got.double().reshape(rp.v.shape), want.double().reshape(rp.v.shape), 1.01 * (rp.e + rf.e))


def _tiny(**kw):
    return aiayn.get_preset("tiny", **{**dict(vocab_size=61, p_drop=0.0, n_layers=1, d_model=16, d_ff=32,
                                             n_heads=2, d_k=8, d_v=8), **kw})


def _batch(cfg, n=5):
    g = torch.Generator().manual_seed(1)
    pairs = [(torch.randint(4, cfg.vocab_size, (int(L),), generator=g).numpy(),
              torch.randint(4, cfg.vocab_size, (int(L) + 1,), generator=g).numpy())
             for L in torch.randint(2, 9, (n,), generator=g)]
    return collate(pairs, cfg.pad_id, cfg.bos_id, cfg.eos_id)


@pytest.mark.parametrize("tie, precision", [(True, "fp32"), (False, "fp32"), (True, "bf16")])
def test_model_pre_softmax_gives_the_plain_step(tie, precision):
    """``project=False`` and the fused loss through the training step (``train.fused_loss=on``):
    the same loss, NLL and every parameter's gradient as ``off``, tied or untied output embedding,
    in float32 and under bf16 autocast. In float32 each path's loss and NLL within float32's
    roundings of the exact sums (``summed_loss_bound``, tests/rounding.py) and its gradients within
    theirs (``gradient_bound``, tests/grad_rounding.py), so within twice those of the other's."""
    cfg = _tiny(tie_embeddings=tie)
    batch = _batch(cfg)
    results = []
    for setting in ("off", "on"):
        torch.manual_seed(0)
        model = aiayn.Transformer(cfg).train()
        sums, _ = passes(model, [batch], TrainConfig(fused_loss=setting), 0.5, torch.device("cpu"), precision)
        results.append((sums, {n: p.grad for n, p in model.named_parameters()}))
    (plain_sums, plain_g), (fused_sums, fused_g) = results
    if precision == "fp32":
        for i, eps_ls in ((0, 0.1), (1, 0.0)):  # the loss, the NLL
            bound = summed_loss_bound(model, "fp32", batch, eps_ls, cfg.pad_id)
            assert abs(float(fused_sums[i] - plain_sums[i])) <= 2 * bound, (i, fused_sums, plain_sums, bound)
        same_gradients(fused_g, plain_g, gradient_bound(model, "fp32", batch, 0.1, 0.5, cfg.pad_id))
        return
    rtol = 2e-2  # bf16: a hand tolerance (autocast's backward is not followed by gradient_bound)
    torch.testing.assert_close(fused_sums, plain_sums, rtol=rtol, atol=1e-6)
    for name, g in plain_g.items():
        torch.testing.assert_close(fused_g[name], g, rtol=rtol, atol=rtol * g.abs().max().item() + 1e-7, msg=name)


def test_autocast_inputs_take_the_autocast_dtype():
    """Under bf16 autocast the projection's inputs are cast to bf16 (``autocast_inputs``), so the
    chunks' logits are the plain projection's; the model gives them in its own dtype."""
    from aiayn.train.fused_loss import autocast_inputs
    model = aiayn.Transformer(_tiny())
    batch = _batch(model.cfg)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pre = autocast_inputs(model(batch.src, batch.tgt_in, project=False))
        logits = model(batch.src, batch.tgt_in)
    assert pre.h.dtype == pre.weight.dtype == logits.dtype == torch.bfloat16
    torch.testing.assert_close(pre.h @ pre.weight.t(), logits)
    assert model(batch.src, batch.tgt_in, project=False).h.dtype == torch.float32


def test_the_cpu_step_never_imports_triton():
    """A training step on the CPU with the default (auto) loads no triton, installed or not."""
    code = ("import sys, torch, aiayn; from tests.train.steps import passes; from aiayn.train.config import TrainConfig; "
            "from tests.train.test_fused_loss import _batch, _tiny; cfg = _tiny(); "
            "passes(aiayn.Transformer(cfg), [_batch(cfg)], TrainConfig(), 1.0, "
            "torch.device('cpu'), 'fp32'); assert 'triton' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]


def test_the_switch():
    """auto is on for CUDA only (where triton imports); on and off are what they say; else an error."""
    cpu = torch.device("cpu")
    assert not fused_loss_on("auto", cpu) and fused_loss_on("on", cpu) and not fused_loss_on("off", cpu)
    assert not fused_loss_on("off", torch.device("cuda"))
    with pytest.raises(ConfigError, match="fused_loss"):
        TrainConfig(fused_loss="yes")
