"""int8_gemm.c: the int8 product of Int8Linear on CPUs without VNNI, exact (aiayn/decode/int8.py)."""
import pytest
import torch

import aiayn.decode.int8 as int8
from aiayn.decode.int8 import Int8Linear

# (N, I, O): none, some or all of them multiples of the 6-row tiles, the input pairs and the 16-output blocks
SHAPES = [(1, 1, 1), (3, 17, 70), (17, 513, 33), (70, 3, 17), (6, 32, 16), (13, 1024, 513), (12, 64, 48)]


@pytest.fixture(params=["native", "portable"])
def build(request, kernels, portable):
    return kernels if request.param == "native" else portable


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def exact(x_q, w_q):
    return (x_q.long() @ w_q.long().T).int()


def test_pack_int8_lays_out_pairs_in_blocks_of_16_outputs(kernels):
    w = torch.arange(1, 18 * 3 + 1, dtype=torch.int8).view(18, 3)  # O = 18, I = 3: two blocks, two pairs
    packed = kernels.pack_int8(w)
    assert packed.shape == (2, 2, 16, 2) and packed.dtype == torch.int16
    assert packed[0, 0, 0].tolist() == [1, 2] and packed[0, 1, 0].tolist() == [3, 0]  # the odd column: zero
    assert packed[1, 0, 1].tolist() == [52, 53] and packed[1, 1, 1].tolist() == [54, 0]  # output 17
    assert not packed[1, :, 2:].any()  # outputs 18..31 do not exist


@pytest.mark.parametrize("N,I,O", SHAPES)
def test_int8_mm_is_exact(build, threads, N, I, O):
    torch.manual_seed(N * I + O)
    x = torch.randint(-127, 128, (N, I), dtype=torch.int8)
    w = torch.randint(-127, 128, (O, I), dtype=torch.int8)
    acc = build.int8_mm(x, build.pack_int8(w), O)
    assert acc.dtype == torch.int32 and torch.equal(acc, exact(x, w))


@pytest.mark.parametrize("sign", [1, -1])
def test_int8_mm_extremes_do_not_saturate(build, threads, sign):
    # ±127 everywhere: every int16 pair sum is 2 * 127² (where u8 x s8 pair sums saturate) and the row sums
    # reach I * 127²; alternating signs cancel exactly
    N, I, O = 7, 4099, 19
    x = torch.full((N, I), 127, dtype=torch.int8)
    w = torch.full((O, I), 127 * sign, dtype=torch.int8)
    w[1::2, 1::2] *= -1
    acc = build.int8_mm(x, build.pack_int8(w), O)
    assert torch.equal(acc, exact(x, w))
    assert acc[:, 0].tolist() == [sign * I * 127 ** 2] * N and acc[:, 1].tolist() == [sign * 127 ** 2] * N


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_rescales_bit_for_bit_as_the_unfused_passes(build, threads, out_dtype, bias):
    torch.manual_seed(0)
    N, I, O = 23, 96, 37
    x_q = torch.randint(-127, 128, (N, I), dtype=torch.int8)
    w_q = torch.randint(-127, 128, (O, I), dtype=torch.int8)
    s_x = torch.rand(N, 1) * torch.logspace(-4, 2, N)[:, None]
    s_w = torch.rand(O) / 127
    b = torch.randn(O) if bias else None
    y = build.int8_linear(x_q, s_x, build.pack_int8(w_q), s_w, b, out_dtype)
    ref = (exact(x_q, w_q) * s_w).mul_(s_x)  # Int8Linear's PyTorch rescaling
    if b is not None:
        ref.add_(b)
    assert y.dtype == out_dtype and torch.equal(y, ref.to(out_dtype))
    assert torch.equal(y, build.rescale(build.int8_mm(x_q, build.pack_int8(w_q), O), s_x, s_w, b, out_dtype))


def test_int8_products_refuse_mismatched_operands(kernels):
    w = kernels.pack_int8(torch.ones(16, 8, dtype=torch.int8))
    with pytest.raises(ValueError, match="packed"):
        kernels.int8_mm(torch.ones(2, 9, dtype=torch.int8), w, 16)  # I = 9 against a packed I of 8
    with pytest.raises(ValueError, match="packed"):
        kernels.int8_mm(torch.ones(2, 8, dtype=torch.int8), w, 17)  # O = 17 needs two blocks
    with pytest.raises(ValueError, match="int8"):
        kernels.int8_mm(torch.ones(2, 8), w, 16)


def _linear_and_input(out_dtype, bias):
    torch.manual_seed(0)
    lin = torch.nn.Linear(70, 45, bias=bias)
    return lin, torch.randn(5, 9, 70).to(out_dtype)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_takes_the_kernel_without_vnni_and_gives_the_same(kernels, monkeypatch, out_dtype, bias):
    lin, x = _linear_and_input(out_dtype, bias)
    vnni = int8.onednn_vnni()
    native = Int8Linear.from_linear(lin, out_dtype, kernels)  # torch._int_mm where it is exact (VNNI)
    monkeypatch.setattr(int8, "onednn_vnni", lambda: False)
    fast = Int8Linear.from_linear(lin, out_dtype, kernels)
    plain = Int8Linear.from_linear(lin, out_dtype)  # no kernels, no VNNI: float32 products of the integers
    assert fast.w_packed is not None and plain.w_packed is None and (native.w_packed is None) == vnni
    with torch.inference_mode():
        y = fast(x)
        assert y.dtype == out_dtype and y.shape == (5, 9, 45)
        assert torch.equal(y, plain(x))
        for b in range(5):  # batched = single
            assert torch.equal(fast(x[b, 3:4]), y[b, 3:4])


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_with_the_kernel_is_onednns_vnni_product(kernels, monkeypatch, out_dtype, bias):
    # the kernel's product and rescaling, bit for bit what Int8Linear gives on VNNI (torch._int_mm); without
    # VNNI (the CPU, or ONEDNN_MAX_CPU_ISA) torch._int_mm is not exact, so there is nothing to compare with
    if not int8.onednn_vnni():
        pytest.skip("no VNNI for oneDNN (the CPU, or ONEDNN_MAX_CPU_ISA): torch._int_mm is not exact here")
    lin, x = _linear_and_input(out_dtype, bias)
    native = Int8Linear.from_linear(lin, out_dtype, kernels)
    monkeypatch.setattr(int8, "onednn_vnni", lambda: False)
    fast = Int8Linear.from_linear(lin, out_dtype, kernels)
    assert native.w_packed is None and fast.w_packed is not None
    with torch.inference_mode():
        assert torch.equal(fast(x), native(x))  # bit for bit oneDNN's VNNI product


def test_the_build_says_whether_it_has_the_avx2_loop(kernels, portable):
    # decode/int8.py refuses precision int8 without VNNI where the product would be the plain loops
    from aiayn.host.isa import cpu_flags as _cpu_flags
    from aiayn.kernels.loader import _march

    assert not portable.int8_vector  # built without -march: no AVX2
    if "avx2" in _cpu_flags() and _march() in ("native", "x86-64-v3", "x86-64-v4"):
        assert kernels.int8_vector
