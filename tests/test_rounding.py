"""The float32 bound of tests/rounding.py against what float32 does: a model's float32 log-probabilities
within ``rounding_bound(model, "fp32")`` of its float64 ones, for each activation, post- and pre-norm,
tied and untied projections with an output bias."""
from __future__ import annotations

import copy

import pytest
import torch

import aiayn
from aiayn.train.objective import label_smoothed_loss_reference
from tests.arith import within
from tests.rounding import rounding_bound


@pytest.mark.parametrize("activation, pre_norm, output_bias", [("relu", False, False), ("swish", True, True),
                                                              ("gelu", False, True), ("gelu", True, False)])
def test_float32_within_the_bound_of_its_roundings(activation, pre_norm, output_bias):
    torch.manual_seed(0)
    cfg = aiayn.get_preset("tiny", vocab_size=37, p_drop=0.0, activation=activation, pre_norm=pre_norm,
                           output_bias=output_bias)
    model = aiayn.Transformer(cfg).eval()
    if output_bias:
        with torch.no_grad():
            model.out_bias.normal_()
    src, tgt = torch.tensor([[5, 6, 7, 8, 9, 3]]), torch.tensor([[2, 11, 12, 13, 14]])
    bound = rounding_bound(model, "fp32", src, tgt, lambda lp: lp[0]).view(5, -1)
    assert float(bound.max()) < 1e-3  # a bound that still tells a right model from a wrong one
    with torch.no_grad():
        lp32 = model(src, tgt).log_softmax(-1)[0]
        lp64 = model.double()(src, tgt).log_softmax(-1)[0]
    within(lp32, lp64, bound)


def test_each_decoding_path_within_the_bound_of_its_roundings():
    """Cached decoding steps of a float32 model (PyTorch's attention; the C kernels'; packed weights with
    the kernels), each log-probability within ``rounding_bound(model, "fp32")`` of the float64 model's
    (the bound itself, not twice it), on a short and a long sentence."""
    from aiayn.decode.adapter import CachedDecoder
    from aiayn.decode.packed import PackedLinear, available, packed_copy
    from aiayn.kernels.loader import load

    torch.manual_seed(1)
    model = aiayn.Transformer(aiayn.get_preset("tiny", vocab_size=37, p_drop=0.0)).eval()
    kernels = load()
    paths = {"pytorch": (model, None)}
    if kernels is not None:  # without a C compiler decoding uses PyTorch's attention
        paths["kernels"] = (model, kernels)
        for library in ("onednn", "mkl"):
            if available(library):
                paths[library] = (packed_copy(model, library), kernels)
                assert any(isinstance(m, PackedLinear) for m in paths[library][0].modules())
    g = torch.Generator().manual_seed(2)
    for S, T in ((6, 5), (40, 30)):
        src = torch.cat([torch.randint(4, 37, (1, S - 1), generator=g), torch.tensor([[3]])], 1)
        tgt_in = torch.cat([torch.tensor([[2]]), torch.randint(4, 37, (1, T - 1), generator=g)], 1)
        with torch.no_grad():
            exact = torch.log_softmax(copy.deepcopy(model).double()(src, tgt_in), -1)[0]  # (T,V)
        bound = rounding_bound(model, "fp32", src, tgt_in, lambda lp: lp[0]).view(T, -1)
        for decoding, k in paths.values():
            dec = CachedDecoder(decoding, kernels=k)
            with torch.inference_mode():
                state, steps = dec.start(src, T), []
                for t in range(T):
                    lp, state = dec.step(tgt_in[:, t], state)
                    steps.append(lp[0])
            within(torch.stack(steps), exact, bound)


def _loss(model, batch, eps_ls: float, scale: float, src_padded: bool = True):
    """``scale`` times the batch's summed label-smoothed loss (§5.4), as ``gradient_bound`` takes it."""
    z = model(batch.src, batch.tgt_in, src_padded=src_padded)
    return scale * label_smoothed_loss_reference(z, batch.tgt_out, eps_ls, 0).loss


@pytest.mark.parametrize("case", ["post-norm", "untied-bias", "pre-norm", "unpadded"])
def test_float32_gradients_within_the_bound_of_their_roundings(case):
    """A training step's float32 gradients (PyTorch's attention, and the C kernels' forward and
    backward where there is a compiler) within ``gradient_bound(model, "fp32")`` of the float64
    model's, at each parameter's picked entries and in its projection: post-norm with the tied
    projection, untied with an output bias, pre-norm over two layers, and a batch without padding
    through attention without a key mask."""
    from aiayn.data.batching import collate
    from aiayn.execution import use_attention_kernels
    from aiayn.kernels.loader import load
    from tests.grad_rounding import gradient_bound, same_gradients, zero_bound

    sizes = dict(vocab_size=61, n_layers=1, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=8, p_drop=0.0)
    sizes.update({"untied-bias": dict(tie_embeddings=False, output_bias=True),
                  "pre-norm": dict(n_layers=2, pre_norm=True)}.get(case, {}))
    cfg = aiayn.get_preset("tiny", **sizes)
    torch.manual_seed(0)
    model = aiayn.Transformer(cfg).train()
    if cfg.output_bias:
        with torch.no_grad():
            model.out_bias.normal_()
    g = torch.Generator().manual_seed(1)
    lengths = [(7, 7)] * 4 if case == "unpadded" else [(int(a), int(b)) for a, b in torch.randint(2, 9, (5, 2), generator=g)]
    batch = collate([(torch.randint(4, 61, (a,), generator=g).numpy(), torch.randint(4, 61, (b,), generator=g).numpy())
                     for a, b in lengths], cfg.pad_id, cfg.bos_id, cfg.eos_id)
    bound = gradient_bound(model, "fp32", batch, 0.1, 0.5)
    exact = copy.deepcopy(model).double()
    _loss(exact, batch, 0.1, 0.5).backward()
    want = {n: p.grad for n, p in exact.named_parameters()}
    kernels = load()
    for k in (None, kernels) if kernels is not None else (None,):
        m = copy.deepcopy(model)
        use_attention_kernels(m, k)
        _loss(m, batch, 0.1, 0.5, src_padded=case != "unpadded").backward()
        got = {n: p.grad for n, p in m.named_parameters()}
        same_gradients(got, want, bound, zero_bound(bound))
