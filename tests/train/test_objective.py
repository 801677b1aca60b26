"""Golden values for Eq. 3 and the label-smoothed loss of §5.4."""
from __future__ import annotations

import math

import pytest
import torch

from aiayn.train.objective import label_smoothed_loss, noam_lr, smoothed_targets


@pytest.mark.parametrize("step,expected", [
    (1, 1.746928107421711e-07),      # 512^-0.5 * 1 * 4000^-1.5
    (4000, 6.987712429686843e-04),   # 512^-0.5 * 4000^-0.5 (the peak)
    (8000, 4.941058844013093e-04),   # 512^-0.5 * 8000^-0.5
    (100000, 1.397542485937369e-04),  # 512^-0.5 * 100000^-0.5
])
def test_noam_golden(step, expected):
    assert noam_lr(step, 512, 4000) == pytest.approx(expected, rel=1e-12)


def test_noam_scale_and_warmup_shape():
    assert noam_lr(10, 256, 1000, scale=2.0) == pytest.approx(2 * noam_lr(10, 256, 1000))
    assert noam_lr(999, 512, 1000) < noam_lr(1000, 512, 1000) > noam_lr(1001, 512, 1000)


def test_label_smoothed_loss_hand_computed():
    # V = 4 (pad = 0), eps = 0.1: gold gets 0.9, the two other non-pad classes 0.05 each.
    # logits [0,1,2,3]: log Z = log(1 + e + e^2 + e^3) = 3.440189698561196
    # log p = [-3.44019, -2.44019, -1.44019, -0.44019]; target 3:
    # loss = 0.9 * 0.44019 + 0.05 * (2.44019 + 1.44019) = 0.590189698561196
    logits = torch.tensor([[[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0]]])
    target = torch.tensor([[3, 0]])  # the second position is padding: no loss
    sums = label_smoothed_loss(logits, target, eps_ls=0.1, pad_id=0)
    assert sums.loss.item() == pytest.approx(0.590189698561196, rel=1e-6)
    assert sums.nll.item() == pytest.approx(0.440189698561196, rel=1e-6)
    assert sums.n_tokens.item() == 1


def test_loss_equals_cross_entropy_against_the_smoothed_distribution():
    V = 7
    logits = torch.randn(2, 5, V, dtype=torch.float64)
    target = torch.tensor([[1, 4, 6, 0, 0], [2, 2, 3, 5, 0]])
    q = smoothed_targets(target.view(-1), V, 0.2, 0)
    want = -(q * torch.log_softmax(logits.view(-1, V), -1)).sum()
    got = label_smoothed_loss(logits, target, 0.2, 0).loss
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    # the distribution: rows sum to 1 (0 for padding), pad column gets nothing
    assert torch.allclose(q.sum(-1), (target.view(-1) != 0).double())
    assert torch.all(q[:, 0] == 0)


def test_no_smoothing_is_plain_nll():
    logits = torch.randn(1, 3, 6)
    target = torch.tensor([[1, 2, 5]])
    sums = label_smoothed_loss(logits, target, 0.0, 0)
    want = torch.nn.functional.cross_entropy(logits.view(-1, 6), target.view(-1), reduction="sum")
    assert sums.loss.item() == pytest.approx(want.item(), rel=1e-5)
