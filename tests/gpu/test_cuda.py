"""The CUDA paths against the plain paths, on a GPU (skipped, with the reason, where there is none).

Their CPU halves run everywhere in tests/train, tests/model and tests/decode (the loss's block sizes,
the attention upcast rule, the beam pool's merge, cuDNN left out of decoding); these check the same
on the device: the training step, the loss, bf16 attention and beam search.
"""
from __future__ import annotations

import pytest
import torch

import aiayn
from aiayn.data.batching import collate
from aiayn.train import loop
from aiayn.train.config import TrainConfig
from aiayn.train.objective import label_smoothed_loss, label_smoothed_loss_reference
from aiayn.train.runtime import Dist

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


def _tiny(**kw):
    base = dict(vocab_size=301, p_drop=0.0, n_layers=2, d_model=64, d_ff=128, n_heads=4, d_k=16, d_v=16)
    base.update(kw)
    return aiayn.get_preset("tiny", **base)


def _batch(cfg, n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    pairs = [(torch.randint(4, cfg.vocab_size, (int(L),), generator=g).numpy(),
              torch.randint(4, cfg.vocab_size, (int(M),), generator=g).numpy())
             for L, M in zip(torch.randint(3, 15, (n,), generator=g), torch.randint(3, 15, (n,), generator=g))]
    return collate(pairs, cfg.pad_id, cfg.bos_id, cfg.eos_id)


def _step_grads(cfg, batch, device, precision):
    torch.manual_seed(0)
    model = aiayn.Transformer(cfg).to(device).train()
    b = loop._to_device(batch, device)
    sums, _ = loop._forward_backward(model, [b], TrainConfig(), cfg, 1, 1 / batch.n_tgt_tokens, device, precision,
                                     None, None, synced=False)
    norm = loop._grad_norm(model, None)
    values = loop._read_step(sums, norm, None, float(batch.n_tgt_tokens), 0.0, Dist(), device, reduce=True)
    return values, {n: p.grad.float().cpu() for n, p in model.named_parameters()}


def test_training_step_on_cuda_equals_the_cpu_step():
    """fp32: the loop's step on CUDA (pinned, non_blocking batch; device sums; one read) gives the
    CPU's loss, NLL, gradient norm and gradients up to float32 rounding."""
    cfg = _tiny()
    batch = _batch(cfg)
    (cpu_vals, cpu_g), (gpu_vals, gpu_g) = _step_grads(cfg, batch, torch.device("cpu"), "fp32"), \
        _step_grads(cfg, batch, CUDA, "fp32")
    for a, b in zip(cpu_vals, gpu_vals):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5)
    for name in cpu_g:
        assert torch.allclose(cpu_g[name], gpu_g[name], rtol=1e-3, atol=1e-5), name


def test_bf16_training_step_on_cuda_is_close_to_fp32():
    """bf16 autocast with the heads in bf16 through the fused kernels: the loss within bf16's rounding."""
    cfg = _tiny()
    batch = _batch(cfg, seed=1)
    fp32, _ = _step_grads(cfg, batch, CUDA, "fp32")
    bf16, _ = _step_grads(cfg, batch, CUDA, "bf16")
    assert bf16[0] == pytest.approx(fp32[0], rel=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_on_cuda_equals_the_reference(dtype):
    """The large-block loss on CUDA against its autograd reference and against the CPU."""
    torch.manual_seed(0)
    V = 37000
    base = (torch.randn(24, 40, V) * 2).to(dtype)
    target = torch.randint(1, V, (24, 40))
    target[3, 20:] = 0
    out = {}
    for name, fn, dev in (("fast", label_smoothed_loss, CUDA), ("ref", label_smoothed_loss_reference, CUDA),
                          ("cpu", label_smoothed_loss, torch.device("cpu"))):
        logits = base.to(dev).requires_grad_(True)
        sums = fn(logits, target.to(dev), 0.1, 0)
        (sums.loss + 0.5 * sums.nll).backward()
        out[name] = (sums.loss.item(), sums.nll.item(), logits.grad.float().cpu())
    for other in ("ref", "cpu"):
        assert out["fast"][0] == pytest.approx(out[other][0], rel=1e-5)
        assert out["fast"][1] == pytest.approx(out[other][1], rel=1e-5)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert torch.allclose(out["fast"][2], out[other][2], atol=tol)


def test_beam_search_on_cuda_matches_the_cpu():
    """fp32 beam search on CUDA (cuDNN attention left out, merges without host checks) finds the
    CPU's hypotheses, scores equal to float32 rounding; bf16 decodes the same lines."""
    from aiayn.decode.adapter import CachedDecoder
    from aiayn.decode.config import DecodeConfig
    from aiayn.decode.search import SpecialIds, search
    from aiayn.decode.translator import model_for_precision
    cfg = _tiny()
    torch.manual_seed(0)
    model = aiayn.Transformer(cfg).eval()
    src = _batch(cfg, n=8, seed=2).src
    dcfg = DecodeConfig(beam_size=4, max_len_a=0, max_len_b=12)
    ids = SpecialIds(cfg.pad_id, cfg.bos_id, cfg.eos_id)
    cpu = search(CachedDecoder(model), src, dcfg, ids)
    gpu = search(CachedDecoder(model.to(CUDA)), src.to(CUDA), dcfg, ids)
    for a, b in zip(cpu, gpu):
        assert a[0].score == pytest.approx(b[0].score, abs=1e-3)
    bf16 = search(CachedDecoder(model_for_precision(model, "bf16")), src.to(CUDA),
                  DecodeConfig(beam_size=4, max_len_a=0, max_len_b=12, precision="bf16"), ids)
    assert len(bf16) == len(gpu) and all(h for h in bf16)
