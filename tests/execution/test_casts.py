"""``train.cast_weights_once``: the linear maps' weights cast once per forward in one batched copy
(``aiayn.execution.casts``) give autocast's own numbers, bit for bit: the loss, every gradient, over
accumulated batches, under R-Drop's doubled pass, with tied embeddings, in bf16 and fp16."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from aiayn.checkpoint.run import Learner
from aiayn.data.batching import Batch
from aiayn.execution import apply, training
from aiayn.execution.casts import WeightCasts
from aiayn.execution.linear import RowPaddedLinear
from aiayn.model import ModelConfig, Transformer
from aiayn.train.config import RunConfig, TrainConfig
from aiayn.train.loop import schedule_of
from aiayn.train.step import TrainStep
from aiayn.train.runtime import Dist, Place

CPU = torch.device("cpu")


def _cfg(tied: bool) -> ModelConfig:
    return ModelConfig(vocab_size=50, n_layers=2, d_model=32, d_ff=48, n_heads=2, d_k=16, d_v=16, p_drop=0.1,
                       tie_embeddings=tied, tie_src_tgt_embeddings=tied)


def _batches(n: int) -> list[Batch]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        src = torch.randint(4, 50, (3, 7), generator=g)
        y = torch.randint(4, 50, (3, 6), generator=g)
        y[1, 4:] = 0  # padding
        tin = torch.cat([torch.full((3, 1), 1), y[:, :-1]], 1)
        out.append(Batch(src, tin, y, int(src.numel()), int((y != 0).sum()), src_padded=False))
    return out


def _step(cast_once: bool, precision: str, tied: bool = True, micro: int = 1, rdrop: float = 0.0):
    """The summed loss terms and every parameter's gradient of one step's passes."""
    torch.manual_seed(0)
    cfg = _cfg(tied)
    model = Transformer(cfg).train()
    t = TrainConfig(cast_weights_once=cast_once, c_kernels=False, rdrop_alpha=rdrop, precision=precision)
    no_optimizer = SimpleNamespace(defaults={})
    stepper = TrainStep.for_run(t, Learner(model, no_optimizer), Place(Dist(), CPU, precision), schedule_of(RunConfig(cfg, t)))
    torch.manual_seed(1)
    sums, _ = stepper.passes(_batches(micro), 0.01)
    return sums, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("tied, micro, rdrop", [(True, 1, 0.0), (False, 1, 0.0), (True, 2, 0.0), (True, 1, 1.0)])
def test_cast_once_is_autocasts_numbers(precision, tied, micro, rdrop):
    sums_a, grads_a = _step(False, precision, tied, micro, rdrop)
    sums_b, grads_b = _step(True, precision, tied, micro, rdrop)
    assert torch.equal(sums_a, sums_b)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 10
    for name in grads_a:
        assert grads_a[name].dtype == torch.float32 and torch.equal(grads_a[name], grads_b[name]), name


def test_the_maps_use_one_batched_cast_a_forward():
    """Hooked on the model's forward: every map's weight and bias cast once there, in bf16, then
    dropped; outside a forward, or without autocast, the maps take their own float32 tensors."""
    model = apply(Transformer(_cfg(True)), training(TrainConfig(c_kernels=False, cast_weights_once=True), CPU, None))
    maps = [m for m in model.modules() if isinstance(m, RowPaddedLinear)]
    casts = maps[0].casts
    assert isinstance(casts, WeightCasts) and all(m.casts is casts for m in maps)
    assert len(casts.tensors) == sum(1 + (m.bias is not None) for m in maps)
    seen = []
    maps[0].register_forward_hook(lambda m, a, o: seen.append((casts.get(m.weight).dtype, len(casts.cast or {}))))
    b = _batches(1)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(b.src, b.tgt_in)
    assert seen == [(torch.bfloat16, len(casts.tensors))] and casts.cast is None
    model(b.src, b.tgt_in)  # float32: nothing cast
    assert seen[-1] == (torch.float32, 0)
    apply(model, training(TrainConfig(c_kernels=False, cast_weights_once=False), CPU, None))  # off again
    assert all(m.casts is None for m in maps) and not model._forward_pre_hooks
