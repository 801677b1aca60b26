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
from aiayn.train.fused_loss import fused_label_smoothed_loss, fused_loss_on, torch_rows
from aiayn.train.objective import label_smoothed_loss
from tests.conftest import REPO

PAD = 3  # not 0, so a pad column other than the first is excluded from q
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # gradients: atol = RTOL x their largest entry


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
    leaves' gradients of 0.37 * loss (an upstream gradient other than 1)."""
    h.grad = W.grad = None
    sums = fn(h.to(dtype), W.to(dtype))
    (0.37 * sums.loss).backward()
    return [sums.loss.item(), sums.nll.item(), sums.n_tokens.item()], h.grad.clone(), W.grad.clone()


def _plain(target, eps_ls):
    return lambda h, W: label_smoothed_loss((h @ W.t())[None], target[None], eps_ls, PAD)  # logits (1,N,V)


def _fused(target, eps_ls, rows, chunk_rows):
    return lambda h, W: fused_label_smoothed_loss(PreSoftmax(h[None], W), target[None], eps_ls, PAD, rows, chunk_rows)


def _assert_same(fused, plain, target, dtype):
    """The same token count, loss and NLL (to rounding) and gradients w.r.t. h and W."""
    assert fused[0][2] == plain[0][2] == int((target != PAD).sum())
    assert fused[0][:2] == pytest.approx(plain[0][:2], rel=RTOL[dtype])
    for a, b in zip(fused[1:], plain[1:]):  # bf16: partial sums over chunks round differently
        torch.testing.assert_close(a, b, rtol=RTOL[dtype], atol=RTOL[dtype] * b.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V, chunk_rows", [(50, 8), (301, 37), (301, None)])
@pytest.mark.parametrize("eps_ls", [0.1, 0.0])
def test_torch_chunks_equal_the_plain_loss(dtype, V, chunk_rows, eps_ls):
    """The chunk loop without Triton: loss, NLL, token count and the gradients w.r.t. h and W
    (5 chunks of 8 rows, the last one short; one chunk; the default size) with padding targets."""
    h, W, target = _problem(V)
    plain = _sums_and_grads(_plain(target, eps_ls), h, W, target, dtype)
    fused = _sums_and_grads(_fused(target, eps_ls, torch_rows, chunk_rows), h, W, target, dtype)
    _assert_same(fused, plain, target, dtype)


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
            _assert_same(fused, plain, target, dtype)
    # row by row with rows wider than one block of the kernel's loop (V = 70 in blocks of 32)
    triton_loss._MAX_BLOCK = 32
    z = torch.randn(9, 70) * 3
    tgt = torch.tensor([5, PAD, 0, 69, 7, PAD, 1, 2, 33])
    out = [(z.clone(), torch.empty(9), torch.empty(9)) for _ in range(2)]
    torch_rows(out[0][0], tgt, 0.1, PAD, out[0][1], out[0][2], True)
    triton_loss.smoothed_ce_rows(out[1][0], tgt, 0.1, PAD, out[1][1], out[1][2], True)
    for a, b in zip(*out):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
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
    assert sums.loss.item() == pytest.approx(plain.loss.item(), rel=1e-5)


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
    in float32 and under bf16 autocast."""
    cfg = _tiny(tie_embeddings=tie)
    batch = _batch(cfg)
    results = []
    for setting in ("off", "on"):
        torch.manual_seed(0)
        model = aiayn.Transformer(cfg).train()
        sums, _ = passes(model, [batch], TrainConfig(fused_loss=setting), 0.5, torch.device("cpu"), precision)
        results.append((sums, {n: p.grad for n, p in model.named_parameters()}))
    (plain_sums, plain_g), (fused_sums, fused_g) = results
    rtol = 1e-5 if precision == "fp32" else 2e-2
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
