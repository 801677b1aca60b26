"""The model options an imported Marian model needs: the FFN's activation and a bias on the
pre-softmax projection (ModelConfig.activation, ModelConfig.output_bias; aiayn/interop/hf_import.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import aiayn
from aiayn.config import ConfigError
from aiayn.model.layers import FeedForward
from tests.arith import within
from tests.rounding import logit_bounds, rounding_bound


def tiny(**kw):
    base = dict(vocab_size=23, p_drop=0.0, n_layers=1, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=8)
    return aiayn.get_preset("tiny", **{**base, **kw})


@pytest.mark.parametrize("activation, fn", [("relu", lambda h: h.clamp(min=0)),
                                            ("gelu", lambda h: 0.5 * h * (1 + torch.erf(h / 2 ** 0.5))),
                                            ("swish", lambda h: h * torch.sigmoid(h))])
def test_feed_forward_takes_the_named_activation(activation, fn):
    ffn = FeedForward(8, 16, 0.0, activation=activation).double()
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    want = ffn.w2(fn(ffn.w1(x)))
    assert torch.allclose(ffn(x), want, atol=1e-12)


def test_paper_defaults_and_unknown_activation_refused():
    cfg = aiayn.ModelConfig()
    assert cfg.activation == "relu" and cfg.output_bias is False
    assert "out_bias" not in aiayn.Transformer(tiny()).state_dict()
    with pytest.raises(ConfigError, match="activation must be one of relu, gelu, swish"):
        tiny(activation="tanh")


@pytest.mark.parametrize("tie", [True, False])
def test_output_bias_is_added_to_the_logits(tie):
    model = aiayn.Transformer(tiny(output_bias=True, tie_embeddings=tie)).double().eval()
    with torch.no_grad():
        model.out_bias.normal_()
    src, tgt = torch.tensor([[5, 6, 7, 3]]), torch.tensor([[2, 5, 6]])
    h, _, _ = model._decoder_stack(tgt, model.encode(src), None, False)
    W = model.tgt_embed.weight if tie else model.out_proj.weight
    # both float64 evaluations of the logits, each within float64's roundings of the exact ones (tests/rounding.py)
    within(model(src, tgt), (h @ W.T + model.out_bias).detach(), 2 * logit_bounds(model, "fp64", src, tgt))


def test_pre_softmax_carries_the_bias_as_a_column():
    """The chunked loss (train.fused_loss) takes h W^T from pre_softmax: with a bias, [h, 1] [W, b]^T,
    whose gradient reaches b as the plain logits' does."""
    model = aiayn.Transformer(tiny(output_bias=True)).double()
    with torch.no_grad():
        model.out_bias.normal_()
    src, tgt = torch.tensor([[5, 6, 7, 3]]), torch.tensor([[2, 5, 6]])
    pre = model(src, tgt, project=False)
    assert pre.h.shape[-1] == pre.weight.shape[-1] == 17
    logits = pre.h @ pre.weight.T
    within(logits, model(src, tgt).detach(), 2 * logit_bounds(model, "fp64", src, tgt))  # as above
    (g_col,) = torch.autograd.grad(logits.logsumexp(-1).sum(), model.out_bias)
    (g_plain,) = torch.autograd.grad(model(src, tgt).logsumexp(-1).sum(), model.out_bias)
    assert torch.allclose(g_col, g_plain, atol=1e-12)


def test_decoding_copies_keep_activation_and_bias():
    from aiayn.decode.int8 import int8_copy
    from aiayn.decode.packed import available, packed_copy
    model = aiayn.Transformer(tiny(activation="swish", output_bias=True)).eval()
    with torch.no_grad():
        model.out_bias.normal_()
    src, tgt = torch.tensor([[5, 6, 7, 3]]), torch.tensor([[2, 5, 6]])
    # how far each copy's log-probabilities may be from the exact ones, and the model's (tests/rounding.py)
    fp32, int8 = (rounding_bound(model, p, src, tgt, lambda lp: lp[0]).view(3, -1) for p in ("fp32", "int8"))
    with torch.no_grad():
        want = model(src, tgt)
        copies = [int8_copy(model)] + [packed_copy(model, lib) for lib in ("onednn", "mkl") if available(lib)]
        for copy in copies:
            got = copy(src, tgt)
            within(got.log_softmax(-1)[0], want.log_softmax(-1)[0].double(), (int8 if copy is copies[0] else fp32) + fp32)
            assert F.softmax(got, -1).argmax(-1).tolist() == want.argmax(-1).tolist()


def test_ffn_dropout_drops_the_activation_in_training_only():
    """ModelConfig.p_drop_ffn (fairseq's activation_dropout): dropout on max(0, x W1 + b1), inside
    Eq. 2, in training; the paper has none (default 0), and evaluation never drops."""
    assert aiayn.ModelConfig().p_drop_ffn == 0.0
    ffn = FeedForward(8, 16, 0.5).double()
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    torch.manual_seed(3)
    got = ffn(x)
    torch.manual_seed(3)
    mask = F.dropout(torch.ones(3, 5, 16, dtype=torch.float64), 0.5, training=True)
    assert torch.allclose(got, ffn.w2(ffn.w1(x).clamp(min=0) * mask), atol=1e-12)
    assert not torch.allclose(got, ffn.w2(ffn.w1(x).clamp(min=0)))
    assert torch.allclose(ffn.eval()(x), ffn.w2(ffn.w1(x).clamp(min=0)), atol=1e-12)
    model = aiayn.Transformer(tiny(p_drop_ffn=0.3, n_layers=2))
    layers = [*model.encoder_layers, *model.decoder_layers]
    assert len(layers) == 4 and all(layer.ffn.dropout.p == 0.3 for layer in layers)
