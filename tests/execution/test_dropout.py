"""Dropout (§5.4): the fast CPU mask has F.dropout's law, scale and reproducibility."""
from __future__ import annotations

import math

import pytest
import torch

import aiayn
from aiayn.execution import Execution, apply
from aiayn.execution.dropout import FastDropout, dropout
from tests.arith import LAMBDA


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_fast_mask_keeps_one_minus_p_and_scales(p):
    torch.manual_seed(0)
    x = torch.ones(1000, 1000)
    y = dropout(x, p, training=True, fast=True)
    kept = y != 0
    # 10^6 Bernoulli(1-p) draws: the kept fraction within LAMBDA standard deviations, sqrt(p (1 - p) / n)
    sd = math.sqrt(p * (1 - p) / x.numel())
    assert abs(kept.float().mean().item() - (1 - p)) <= LAMBDA * sd
    assert torch.allclose(y[kept], torch.full_like(y[kept], 1 / (1 - p)))
    # rows and columns are not correlated: the 1000 rows' kept fractions spread as independent draws do,
    # sqrt(p (1 - p) / 1000), their sample deviation within LAMBDA of its own (relative 1 / sqrt(2 (n - 1)))
    row_sd = math.sqrt(p * (1 - p) / x.size(1))
    assert kept.float().mean(1).std().item() <= row_sd * (1 + LAMBDA / math.sqrt(2 * (x.size(0) - 1)))


def test_fast_mask_gradient_is_the_mask():
    torch.manual_seed(1)
    x = torch.randn(64, 32, requires_grad=True)
    y = dropout(x, 0.25, training=True, fast=True)
    y.sum().backward()
    assert torch.equal(x.grad, (y != 0).float() / 0.75)


def test_identity_when_not_training_or_p_zero():
    x = torch.randn(5, 7)
    assert dropout(x, 0.3, training=False) is x
    assert dropout(x, 0.0, training=True) is x


def test_mask_reproduces_from_the_seed_and_differs_between_calls():
    x = torch.ones(50, 50)
    torch.manual_seed(3)
    a, b = dropout(x, 0.2, True), dropout(x, 0.2, True)
    torch.manual_seed(3)
    assert torch.equal(dropout(x, 0.2, True), a)
    assert not torch.equal(a, b)


def test_bf16_input_keeps_dtype():
    y = dropout(torch.ones(10, 10, dtype=torch.bfloat16), 0.5, True)
    assert y.dtype == torch.bfloat16


def test_model_fast_and_torch_dropout_agree_in_eval_and_in_expectation():
    # Same weights: eval outputs are identical (dropout is off). In training, the mean over
    # many masks of a scalar statistic of the logits matches for both mask generators.
    cfg = aiayn.get_preset("tiny", vocab_size=50, p_drop=0.3)
    torch.manual_seed(0)
    fast = apply(aiayn.Transformer(cfg), Execution(fast_dropout=True))
    slow = aiayn.Transformer(cfg)
    assert any(isinstance(m, FastDropout) for m in fast.modules())
    assert not any(isinstance(m, FastDropout) for m in slow.modules())
    slow.load_state_dict(fast.state_dict())
    src = torch.randint(4, 50, (3, 6))
    tgt = torch.randint(4, 50, (3, 5))
    fast.eval(), slow.eval()
    assert torch.equal(fast(src, tgt), slow(src, tgt))
    fast.train(), slow.train()
    with torch.no_grad():
        stat = {name: torch.stack([m(src, tgt).pow(2).mean() for _ in range(400)])
                for name, m in (("fast", fast), ("slow", slow))}
        ev = fast.eval()(src, tgt).pow(2).mean()
    mf, ms = stat["fast"].mean(), stat["slow"].mean()
    se = (stat["fast"].var() / 400 + stat["slow"].var() / 400).sqrt()
    assert abs(mf - ms) < 4 * se  # same expectation
    assert abs(ms - ev) > 4 * se  # and the statistic does see dropout
