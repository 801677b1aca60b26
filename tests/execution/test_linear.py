"""Row-padded linear maps (aiayn/execution/linear.py): which row counts reach the matmul, and that the
padded model computes what the unpadded one does."""
from __future__ import annotations

import pytest
import torch

import aiayn
from aiayn.execution import linear as lin, pad_linear_rows
from aiayn.execution.linear import RowPaddedLinear as Linear, row_padded_linear
from tests.arith import gamma, rounded_to, within


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


@pytest.mark.parametrize("M, bits, expected", [
    (63, 6, 63),        # under 2^6 rows: never padded
    (64, 6, 64),        # 7 bits, step 2: already even
    (65, 6, 66),
    (127, 6, 128),
    (130, 6, 132),      # 8 bits, step 4
    (2999, 6, 3008),    # 12 bits, step 64
    (3072, 6, 3072),
    (4097, 6, 4224),    # 13 bits, step 128
    (2999, 4, 3072),    # step 256
    (2999, 0, 2999),    # 0 = off
])
def test_padded_rows_golden(M, bits, expected):
    assert lin.padded_rows(M, bits) == expected
    if bits:
        assert (expected - M) * 2 ** (bits - 1) < M  # fewer than 1/2^(bits-1) more rows


@pytest.mark.parametrize("M, bits, autocast, expected", [
    (37, 4, True, 40),      # 6 bits, step 4
    (37, 6, True, 37),      # under 2^6: untouched
    (130, 6, True, 132),
    (130, 0, True, 130),    # 0 = off
    (130, 6, False, 130),   # float32 on the CPU: never padded
])
def test_rows_reaching_the_product(seen_rows, M, bits, autocast, expected):
    x, w = torch.randn(M, 8), torch.randn(5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = row_padded_linear(x, w, None, bits)
    assert seen_rows == [expected]
    assert y.shape == (M, 5)


def test_bf16_input_without_autocast_is_padded(seen_rows):
    y = row_padded_linear(torch.randn(3, 7, 8, dtype=torch.bfloat16), torch.randn(5, 8, dtype=torch.bfloat16), None, 3)
    assert seen_rows == [24] and y.shape == (3, 7, 5)  # 21 rows, 5 bits, step 4


def test_linear_keeps_nn_linear_state_dict():
    a, b = torch.nn.Linear(4, 3), Linear(4, 3)
    b.load_state_dict(a.state_dict())
    assert list(b.state_dict()) == ["weight", "bias"] and isinstance(b, torch.nn.Linear)


def _model(tied: bool):
    torch.manual_seed(0)
    cfg = aiayn.get_preset("tiny", vocab_size=50, p_drop=0.0, n_layers=2, d_model=32, d_ff=64, n_heads=2,
                           d_k=16, d_v=16, tie_embeddings=tied)
    return aiayn.Transformer(cfg)


def _check_product(p):
    """The backward of one product of a padded map under bf16 autocast, x (M, D_in) -> y (M, D_out), from
    dy: dx = dy W, dW = dy^T x and db = sum_rows dy, each against the exact value from the bfloat16
    operands autocast multiplies (x, W rounded to bfloat16; dy as given), over the M real rows only: a
    float32 sum of n products (exact in float32) in any order, blocked as the padded row count has it, is
    within gamma_n of the sum of their absolute values (Higham §3.1; zero rows add nothing), then one
    rounding to bfloat16 (2^-8 relative)."""
    x, W, dy = (t.detach().reshape(-1, t.size(-1)) if t.dim() > 1 else t for t in (p["x"], p["w"], p["dy"]))
    X, Wb, DY = x.to(torch.bfloat16).double(), W.to(torch.bfloat16).double(), dy.double()
    M, D_out = X.size(0), Wb.size(0)
    rows = lin.padded_rows(M, p["bits"])  # the sums' length as the kernel sees it (padding included)
    for name, want, size, n in (("dx", DY @ Wb, DY.abs() @ Wb.abs(), D_out),
                                ("dw", DY.t() @ X, DY.abs().t() @ X.abs(), rows),
                                ("db", DY.sum(0), DY.abs().sum(0), rows - 1)):
        if name in p:
            within(p[name].reshape(want.shape), want, rounded_to(torch.bfloat16, gamma(n) * size, want))


@pytest.mark.parametrize("tied", [True, False])
def test_padded_model_equals_unpadded_under_bf16(tied, monkeypatch):
    """Forward and backward of a batch with odd row counts (B x S = 5 x 11, B x T = 5 x 9, padded to 56
    and 48 with 3 bits) under bf16 autocast: the logits are the same numbers, and the backward of every
    product of the padded maps is that of its real rows to its float32 sums and one rounding to bfloat16
    (``_check_product``; the products' kernels block the rows differently, so the gradients are not the
    unpadded model's bit for bit)."""
    products, real = [], lin.row_padded_linear

    def spy(x, weight, bias, bits):  # views: this use's own gradients, whatever else uses x or the weight
        p = {"x": x, "w": weight, "bits": bits}
        views = {"dx": x.view_as(x), "dw": weight.view_as(weight), "db": None if bias is None else bias.view_as(bias)}
        for name, t in views.items():
            if t is not None and t.requires_grad:
                t.register_hook(lambda g, name=name: p.__setitem__(name, g))
        y = real(views["dx"], views["dw"], views["db"], bits)
        y.register_hook(lambda g: p.__setitem__("dy", g))
        products.append(p)
        return y

    torch.manual_seed(1)
    src, tgt = torch.randint(4, 50, (5, 11)), torch.randint(4, 50, (5, 9))
    results = []
    for bits in (0, 3):
        model = _model(tied)
        pad_linear_rows(model, bits)
        if bits:
            monkeypatch.setattr(lin, "row_padded_linear", spy)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(src, tgt)
        logits.float().pow(2).mean().backward()
        results.append(logits.detach())
    assert torch.equal(*results)
    assert len(products) == sum(isinstance(m, Linear) for m in model.modules()) + tied
    for p in products:
        _check_product(p)


def test_pad_linear_rows_reaches_every_product(seen_rows):
    """Every linear map of the model, the tied output layer included, sees a padded row count."""
    model = _model(tied=True)
    pad_linear_rows(model, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (3, 5)))  # 21 -> 24 rows, 15 -> 16
    assert seen_rows and set(seen_rows) == {24, 16}
    n_linear = sum(isinstance(m, Linear) for m in model.modules())
    assert len(seen_rows) == n_linear + 1  # each map once, and the output layer through the tied embedding


def test_row_counts_bounded_over_many_lengths(seen_rows):
    """Token-bounded batches (B = 3125 // L for every length L of 1..250) give 97 row counts unpadded,
    (2,892 to 3,125 rows) and 4 with 6 bits (multiples of 64: 2,944 to 3,136)."""
    w = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for L in range(1, 251):
            row_padded_linear(torch.randn(3125 // L, L, 8), w, None, 6)
    unpadded = {(3125 // L) * L for L in range(1, 251)}
    assert len(unpadded) == 97
    assert sorted(set(seen_rows)) == [2944, 3008, 3072, 3136]
