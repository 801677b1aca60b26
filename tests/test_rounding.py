"""The float32 bound of tests/rounding.py against what float32 does: a model's float32 log-probabilities
within ``rounding_bound(model, "fp32")`` of its float64 ones, for each activation, post- and pre-norm,
tied and untied projections with an output bias."""
from __future__ import annotations

import pytest
import torch

import aiayn
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
