"""decode/packed.py: float32 linear maps from oneDNN's packed weights against F.linear, copies and
pickles of them, the decoding copy of a Transformer, and beam search with and without them."""
import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from aiayn.decode import packed as packed_mod
from aiayn.decode.packed import PackedLinear, packed_copy
from tests.decode.test_adapter import V, sources

pytestmark = pytest.mark.skipif(not packed_mod.available(), reason="this PyTorch has no oneDNN packed linear")


@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_is_f_linear(bias):
    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 300, bias=bias)
    p = PackedLinear.from_linear(lin)
    wide = torch.randn(9, 96)[:, :48]  # rows further apart than their length
    for x in (torch.randn(5, 48), torch.randn(3, 7, 48), wide, torch.randn(0, 48)):
        with torch.inference_mode():
            y = p(x)
        assert y.shape == x.shape[:-1] + (300,) and y.dtype == torch.float32
        torch.testing.assert_close(y, F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
    assert p._packed is not None and p._packed.is_mkldnn


def test_packed_linear_with_relu_is_relu_of_f_linear():
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 64)
    p = PackedLinear(lin.weight, lin.bias, relu=True)
    x = torch.randn(7, 32)
    with torch.inference_mode():
        y = p(x)
        assert (y == 0).any() and (y > 0).any()  # both sides of the max taken
        torch.testing.assert_close(y, F.relu(F.linear(x, lin.weight, lin.bias)), atol=1e-5, rtol=1e-5)
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


def test_a_copy_or_a_pickle_packs_its_own():
    torch.manual_seed(0)
    p = PackedLinear.from_linear(torch.nn.Linear(32, 40))
    x = torch.randn(6, 32)
    with torch.inference_mode():
        y = p(x)
        for other in (copy.deepcopy(p), pickle.loads(pickle.dumps(p))):
            assert other._packed is None
            torch.testing.assert_close(other(x), y, atol=0, rtol=0)
            assert other._packed is not None and other._packed is not p._packed


def _tiny_model():
    import aiayn.model as M

    torch.manual_seed(0)
    return M.Transformer(M.get_preset("tiny", vocab_size=V, p_drop=0.0)).eval()


def test_packed_copy_of_a_transformer():
    from aiayn.decode.translator import model_for_precision

    model = _tiny_model()
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    out = model_for_precision(model, "fp32", packed=True)
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
    with torch.inference_mode():
        torch.testing.assert_close(out(src, tgt), model(src, tgt), atol=1e-5, rtol=1e-5)
    assert packed_copy(model).out_proj is not None


def test_translator_beam_search_with_and_without_packed_weights():
    from aiayn.decode.config import DecodeConfig
    from aiayn.decode.search import search
    from aiayn.decode.translator import Translator

    model, src = _tiny_model(), sources()
    out = {}
    for on in (True, False):
        t = Translator(model, None, None, DecodeConfig(beam_size=4, nbest=4, packed_weights=on))
        assert any(isinstance(m, PackedLinear) for m in t.model.modules()) is on
        with torch.inference_mode():
            out[on] = search(t.decoder, src, t.cfg, t.ids)
    assert [[h.tokens for h in hs] for hs in out[True]] == [[h.tokens for h in hs] for hs in out[False]]
    for a, b in zip(out[True], out[False]):
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-5)
