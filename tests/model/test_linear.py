"""Row-padded linear maps (aiayn/model/linear.py): which row counts reach the matmul, and that the
padded model computes what the unpadded one does."""
from __future__ import annotations

import pytest
import torch

import aiayn
from aiayn.model import linear as lin
from aiayn.model.linear import Linear, row_padded_linear


@pytest.fixture
def seen_rows(monkeypatch):
    """The row counts of every product ``row_padded_linear`` hands to F.linear."""
    rows = []
    real = lin.F.linear

    def spy(x, weight, bias=None):
        rows.append(x.reshape(-1, x.size(-1)).size(0))
        return real(x, weight, bias)

    monkeypatch.setattr(lin.F, "linear", spy)
    return rows


@pytest.mark.parametrize("M, multiple, autocast, expected", [
    (37, 64, True, 64),     # rounded up: 37 + 27 zero rows
    (64, 64, True, 64),     # already a multiple: untouched
    (65, 64, True, 128),
    (130, 8, True, 136),
    (37, 0, True, 37),      # 0 = off
    (37, 64, False, 37),    # float32 on the CPU: never padded
])
def test_row_count_golden(seen_rows, M, multiple, autocast, expected):
    x, w = torch.randn(M, 8), torch.randn(5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = row_padded_linear(x, w, None, multiple)
    assert seen_rows == [expected]
    assert y.shape == (M, 5)


def test_bf16_input_without_autocast_is_padded(seen_rows):
    y = row_padded_linear(torch.randn(3, 7, 8, dtype=torch.bfloat16), torch.randn(5, 8, dtype=torch.bfloat16), None, 16)
    assert seen_rows == [32] and y.shape == (3, 7, 5)


def test_linear_keeps_nn_linear_state_dict():
    a, b = torch.nn.Linear(4, 3), Linear(4, 3)
    b.load_state_dict(a.state_dict())
    assert list(b.state_dict()) == ["weight", "bias"] and isinstance(b, torch.nn.Linear)


def _model(tied: bool):
    torch.manual_seed(0)
    cfg = aiayn.get_preset("tiny", vocab_size=50, p_drop=0.0, n_layers=2, d_model=32, d_ff=64, n_heads=2,
                           d_k=16, d_v=16, tie_embeddings=tied)
    return aiayn.Transformer(cfg)


@pytest.mark.parametrize("tied", [True, False])
def test_padded_model_equals_unpadded_under_bf16(tied):
    """Forward and backward of a batch with odd row counts (B x S = 5 x 11, B x T = 5 x 9) under bf16
    autocast: the logits are the same numbers, and the gradients agree to bfloat16's rounding (the
    products' kernels block the rows differently)."""
    torch.manual_seed(1)
    src, tgt = torch.randint(4, 50, (5, 11)), torch.randint(4, 50, (5, 9))
    results = []
    for multiple in (0, 64):
        model = _model(tied)
        model.pad_linear_rows(multiple)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(src, tgt)
        logits.float().pow(2).mean().backward()
        results.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain, plain_g), (padded, padded_g) = results
    assert torch.equal(plain, padded)
    for name, g in plain_g.items():
        torch.testing.assert_close(padded_g[name], g, rtol=2e-2, atol=2e-2 * g.abs().max().item(), msg=name)


def test_pad_linear_rows_reaches_every_product(seen_rows):
    """Every linear map of the model, the tied output layer included, sees a multiple of 64 rows."""
    model = _model(tied=True)
    model.pad_linear_rows(64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (3, 5)))
    assert seen_rows and all(r == 64 for r in seen_rows)
    n_linear = sum(isinstance(m, Linear) for m in model.modules())
    assert len(seen_rows) == n_linear + 1  # each map once, and the output layer through the tied embedding


def test_row_counts_bounded_over_many_lengths(seen_rows):
    """Token-bounded batches (B = 512 // L for every length L of 1..120) give one row count per length
    unpadded (53 of them), and at most 512 / 64 + 1 row counts padded to 64."""
    x_of = lambda L: torch.randn(512 // L, L, 8)  # noqa: E731
    w = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for L in range(1, 121):
            row_padded_linear(x_of(L), w, None, 64)
    assert len(set(seen_rows)) <= 512 // 64 + 1
    unpadded = {(512 // L) * L for L in range(1, 121)}
    assert len(unpadded) == 53
