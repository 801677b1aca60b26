"""int8_rows.c: the passes around an int8 product, bit for bit PyTorch's (aiayn/decode/int8.py)."""
import pytest
import torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_is_bit_identical(kernels, dtype):
    from aiayn.decode.int8 import quantize_rows

    x = (torch.randn(37, 300) * torch.logspace(-3, 3, 37)[:, None]).to(dtype)
    x[5] = 0  # an all-zero row: the scale floor
    x[7, :3] = torch.tensor([2.5, -0.5, 1.5]) * x[7].abs().max() / 127  # ties: round half to even
    wide = torch.randn(4, 600).to(dtype)[:, :300]  # rows further apart than their length
    for a in (x, wide):
        q, s = kernels.quantize_rows(a)
        q_ref, s_ref = quantize_rows(a)
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    with pytest.raises(ValueError, match="contiguous rows"):
        kernels.quantize_rows(x[:, ::2])


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_with_the_kernels_is_bit_identical(kernels, out_dtype, bias):
    from aiayn.decode.int8 import Int8Linear

    lin = torch.nn.Linear(48, 40, bias=bias)
    plain = Int8Linear.from_linear(lin, out_dtype)
    fast = Int8Linear.from_linear(lin, out_dtype, kernels)
    for x in (torch.randn(3, 7, 48), torch.randn(20, 48).to(out_dtype)):
        with torch.inference_mode():
            y, y_ref = fast(x), plain(x)
        assert y.dtype == out_dtype and y.shape == y_ref.shape and torch.equal(y, y_ref)
