"""decode/packed.py: float32 linear maps from oneDNN's and MKL's packed weights against F.linear, copies
and pickles of them, the decoding copy of a Transformer, the choice of library, and beam search with and
without them."""
import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from aiayn.decode import packed as packed_mod
from aiayn.decode.packed import PackedLinear, packed_copy
from tests.decode.test_adapter import V, sources, tiny_float_model
from tests.arith import gamma, within
from tests.rounding import same_float_search

LIBRARIES = [pytest.param(lib, marks=pytest.mark.skipif(not packed_mod.available(lib), reason=f"this PyTorch has no {lib} packed linear"))
             for lib in packed_mod.LIBRARIES]
pytestmark = pytest.mark.skipif(not any(map(packed_mod.available, packed_mod.LIBRARIES)),
                                reason="this PyTorch has no packed linear")


def _two_products_apart(x, weight, bias=None):
    """How far two float32 evaluations of x W^T + b may be apart, whatever their kernels' blocking,
    order of additions and use of FMA: each is within gamma_{I+1} (|x| |W|^T + |b|) of the exact value
    (I products and the bias: a sum of I + 1 terms in any order, Higham §3.1), so twice that. A
    max(0, .) after both moves neither further apart (it is 1-Lipschitz and exact)."""
    mag = x.double().abs() @ weight.double().abs().t()
    if bias is not None:
        mag = mag + bias.double().abs()
    return 2 * gamma(x.size(-1) + 1) * mag


@pytest.mark.parametrize("library", LIBRARIES)
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_is_f_linear(bias, library):
    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 300, bias=bias)
    p = PackedLinear.from_linear(lin, library)
    wide = torch.randn(9, 96)[:, :48]  # rows further apart than their length
    for x in (torch.randn(5, 48), torch.randn(3, 7, 48), wide, torch.randn(0, 48)):
        with torch.inference_mode():
            y = p(x)
        assert y.shape == x.shape[:-1] + (300,) and y.dtype == torch.float32
        within(y, F.linear(x, lin.weight, lin.bias).double(), _two_products_apart(x, lin.weight, lin.bias))
    assert p._packed is not None and p._packed.is_mkldnn  # both libraries' layouts are opaque tensors


@pytest.mark.skipif(not packed_mod.available("mkl"), reason="this PyTorch has no MKL packed linear")
def test_mkl_packs_once_for_every_row_count():
    """MKL is told a row count when it packs (128) and at each product, where a count other than the
    input's means F.linear instead of the packed kernels: the module packs once, tells each product its
    own count, and the products equal F.linear's up to rounding for every count."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 1000)
    p = PackedLinear.from_linear(lin, "mkl")
    with torch.inference_mode():
        for rows in (1, 3, 8, 100, 128, 200, 513):
            x = torch.randn(rows, 256)
            within(p(x), F.linear(x, lin.weight, lin.bias).double(), _two_products_apart(x, lin.weight, lin.bias))
        packed = p._packed
        x = torch.randn(100, 256)
        assert p(x) is not None and p._packed is packed  # packed once
        assert torch.equal(p(x), torch.ops.mkl._mkl_linear(x, packed, lin.weight, lin.bias, 100))


def test_auto_takes_mkl_on_intel_and_onednn_elsewhere(monkeypatch):
    have = {lib: packed_mod.available(lib) for lib in packed_mod.LIBRARIES}
    for vendor, order in (("GenuineIntel", ("mkl", "onednn")), ("AuthenticAMD", ("onednn", "mkl")), ("", ("onednn", "mkl"))):
        monkeypatch.setattr(packed_mod, "_cpu_vendor", lambda v=vendor: v)
        assert packed_mod.resolve_library("auto") == next((lib for lib in order if have[lib]), None)
    for lib in packed_mod.LIBRARIES:
        assert packed_mod.resolve_library(lib) == (lib if have[lib] else None)
    with pytest.raises(ValueError, match="packed library"):
        packed_mod.available("blas")
    from aiayn.config import ConfigError
    from aiayn.decode.config import DecodeConfig

    with pytest.raises(ConfigError, match="packed_library"):
        DecodeConfig(packed_library="blas")


@pytest.mark.parametrize("library", LIBRARIES)
def test_packed_linear_with_relu_is_relu_of_f_linear(library):
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 64)
    p = PackedLinear(lin.weight, lin.bias, relu=True, library=library)
    x = torch.randn(7, 32)
    with torch.inference_mode():
        y = p(x)
        assert (y == 0).any() and (y > 0).any()  # both sides of the max taken
        within(y, F.relu(F.linear(x, lin.weight, lin.bias)).double(), _two_products_apart(x, lin.weight, lin.bias))
        with torch.autocast("cpu", dtype=torch.bfloat16):  # through F.linear, then F.relu
            assert torch.equal(p(x), F.relu(F.linear(x, lin.weight, lin.bias)))


def test_inputs_it_does_not_take_go_through_f_linear():
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8)
    p = PackedLinear.from_linear(lin)
    x = torch.randn(4, 16)
    with torch.inference_mode():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, ref = p(x), F.linear(x, lin.weight, lin.bias)
        assert y.dtype == torch.bfloat16 and torch.equal(y, ref)
    assert p._packed is None  # nothing was packed for those
    with pytest.raises(ValueError, match="float32 CPU weight"):
        PackedLinear(torch.randn(3, 3, dtype=torch.float64))


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_copy_or_a_pickle_packs_its_own(library):
    torch.manual_seed(0)
    p = PackedLinear.from_linear(torch.nn.Linear(32, 40), library)
    x = torch.randn(6, 32)
    with torch.inference_mode():
        y = p(x)
        for other in (copy.deepcopy(p), pickle.loads(pickle.dumps(p))):
            assert other._packed is None
            torch.testing.assert_close(other(x), y, atol=0, rtol=0)
            assert other._packed is not None and other._packed is not p._packed


@pytest.mark.parametrize("attn_bias", [False, True], ids=["paper", "attn_bias"])
@pytest.mark.parametrize("library", LIBRARIES)
def test_packed_copy_of_a_transformer(library, attn_bias, monkeypatch):
    from aiayn.decode.loading import model_for_precision

    model = tiny_float_model(attn_bias)
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    out = model_for_precision(model, "fp32", packed=True, library=library)
    assert {m.library for m in out.modules() if isinstance(m, PackedLinear)} == {library}
    assert out is not model and not any(isinstance(m, torch.nn.Linear) for m in out.modules())
    ffns = [m for m in out.modules() if isinstance(m, packed_mod.PackedFeedForward)]
    assert len(ffns) == len(model.encoder_layers) + len(model.decoder_layers) and all(f.w1.relu for f in ffns)
    tied = {"out_proj.weight"} if model.out_proj is None else set()  # the packed copy's own name for it
    assert set(out.state_dict()) == set(model.state_dict()) | tied
    assert sum(isinstance(m, PackedLinear) for m in out.modules()) == n_linear + (model.out_proj is None)
    if model.out_proj is None:  # tied (§3.4): the pre-softmax projection multiplies by the embedding matrix itself
        assert out.out_proj.weight is out.tgt_embed.weight
    assert any(isinstance(m, torch.nn.Linear) for m in model.modules())  # the caller's model as it was
    assert model_for_precision(out, "fp32", packed=True) is out  # already a decoding copy
    assert model_for_precision(model, "fp32", packed=False) is model
    src, tgt = sources(), torch.randint(4, V, (5, 6))
    # the copy is the model up to its products: each packed product within _two_products_apart of
    # F.linear of the input it was given in the copy's forward ...
    seen = []
    hooks = [m.register_forward_hook(lambda m, args, y: seen.append((m, args[0], y)))
             for m in out.modules() if isinstance(m, PackedLinear)]
    with torch.inference_mode():
        out(src, tgt)
    for h in hooks:
        h.remove()
    assert {m for m, _, _ in seen} == {m for m in out.modules() if isinstance(m, PackedLinear)}
    for m, x, y in seen:
        want = F.linear(x, m.weight, m.bias)
        within(y, (F.relu(want) if m.relu else want).double(), _two_products_apart(x, m.weight, m.bias))
    # ... and with F.linear in their place, the model's own numbers bit for bit (the same maps, weights
    # and order of operations everywhere else)
    monkeypatch.setattr(PackedLinear, "forward", lambda m, x: F.relu(F.linear(x, m.weight, m.bias)) if m.relu
                        else F.linear(x, m.weight, m.bias))
    with torch.inference_mode():
        assert torch.equal(out(src, tgt), model(src, tgt))
    assert packed_copy(model).out_proj is not None


@pytest.mark.parametrize("attn_bias", [False, True], ids=["paper", "attn_bias"])
@pytest.mark.parametrize("library", LIBRARIES)
def test_translator_beam_search_with_and_without_packed_weights(library, attn_bias):
    from aiayn.decode.config import DecodeConfig
    from aiayn.decode.search import search
    from aiayn.decode.translator import Translator

    model, src = tiny_float_model(attn_bias), sources()
    out = {}
    for on in (True, False):
        t = Translator(model, None, None, DecodeConfig(beam_size=4, nbest=4, packed_weights=on, packed_library=library))
        assert {m.library for m in t.model.modules() if isinstance(m, PackedLinear)} == ({library} if on else set())
        with torch.inference_mode():
            out[on] = search(t.decoder, src, t.cfg, t.ids)
    same_float_search(model, src, out[True], out[False], t.cfg, t.ids)  # up to float32's roundings, derived


@pytest.mark.skipif(not packed_mod.available("onednn"), reason="this PyTorch has no oneDNN packed linear")
def test_onednn_row_counts_are_padded_to_a_bounded_set(monkeypatch):
    """oneDNN builds and keeps a kernel for each row count it multiplies, so a translator that saw every
    count from 1 to 512 kept 512 sets of kernels. With row_bits b = 4 the products reach oneDNN with the
    counts ``padded_rows`` gives: the 15 under 2^4 as they are, then 2^(b-1) = 8 for each of the 5
    doublings from 16 to 511, and 512: at most 56, each output row still its own input row's product."""
    from aiayn.execution.linear import padded_rows

    seen = set()
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda rows, *a: seen.add(rows.size(0)) or real(rows, *a))
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 24)
    p = PackedLinear(lin.weight, lin.bias, relu=True, library="onednn", row_bits=4)
    with torch.inference_mode():
        for M in range(1, 513):
            x = torch.randn(M, 16) if M % 2 else torch.randn(2, M // 2, 16)  # (M, I) or (2, M/2, I)
            y = p(x)
            assert y.shape == x.shape[:-1] + (24,)
            within(y, F.relu(F.linear(x, lin.weight, lin.bias)).double(), _two_products_apart(x, lin.weight, lin.bias))
    assert seen == {padded_rows(M, 4) for M in range(1, 513)}
    assert len(seen) <= 15 + 8 * 5 + 1


@pytest.mark.parametrize("library", LIBRARIES)
def test_translator_pads_the_packed_copy_as_cpu_row_bits_says(library):
    from aiayn.decode.config import DecodeConfig
    from aiayn.decode.translator import Translator

    for bits in (0, 5):
        t = Translator(tiny_float_model(), None, None, DecodeConfig(packed_library=library, cpu_row_bits=bits))
        assert {m.row_bits for m in t.model.modules() if isinstance(m, PackedLinear)} == {bits}
