"""Golden values and equivalence tests for the model of §3 (tiny models, float64, dropout off)."""
from __future__ import annotations

import math

import pytest
import torch

import aiayn
from aiayn.decode.cache import init_cache
from aiayn.errors import UserError
from aiayn.model.attention import attention_explicit
from aiayn.model.positional import sinusoidal_table
from tests.arith import gamma, within
from tests.rounding import logit_bounds


def tiny(**kw):
    base = dict(vocab_size=23, p_drop=0.0, n_layers=2, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=8)
    base.update(kw)
    return aiayn.get_preset("tiny", **base)


def make(cfg):
    model = aiayn.Transformer(cfg).double().eval()
    with torch.no_grad():  # attention biases (attn_bias) drawn not zero, so that every path must add them
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0.0, 0.1)
    return model


def test_positional_encoding_golden_d4():
    # §3.5 with d_model = 4: dims (sin, cos, sin, cos) with rates 1 and 1/10000^(2/4) = 1/100.
    pe = sinusoidal_table(2, 4, dtype=torch.float64)
    assert pe[0].tolist() == [0.0, 1.0, 0.0, 1.0]
    expected_pos1 = [math.sin(1.0), math.cos(1.0), math.sin(0.01), math.cos(0.01)]
    assert pe[1].tolist() == pytest.approx(expected_pos1, abs=1e-15)
    assert pe[1, 0].item() == pytest.approx(0.8414709848078965)
    assert pe[1, 1].item() == pytest.approx(0.5403023058681398)
    assert pe[1, 2].item() == pytest.approx(0.009999833334166664)
    assert pe[1, 3].item() == pytest.approx(0.9999500004166653)


def test_masked_positions_get_exactly_zero_weight():
    q = torch.randn(1, 1, 3, 4, dtype=torch.float64)
    k = torch.randn(1, 1, 5, 4, dtype=torch.float64)
    v = torch.randn(1, 1, 5, 4, dtype=torch.float64)
    mask = torch.tensor([True, True, False, True, False])[None, None, None, :]
    _, w = attention_explicit(q, k, v, mask)
    assert torch.all(w[..., 2] == 0) and torch.all(w[..., 4] == 0)
    assert torch.allclose(w.sum(-1), torch.ones(1, 1, 3, dtype=torch.float64))


def test_attention_golden_hand_computed():
    # One query, two keys, d_k = 4: scores = q.k / 2 = [1, 0] -> softmax [e/(e+1), 1/(e+1)].
    q = torch.tensor([[[[1.0, 1.0, 0.0, 0.0]]]], dtype=torch.float64)
    k = torch.tensor([[[[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]]]], dtype=torch.float64)
    v = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]], dtype=torch.float64)
    out, w = attention_explicit(q, k, v, None)
    e = math.e
    assert w[0, 0, 0].tolist() == pytest.approx([e / (e + 1), 1 / (e + 1)])
    assert out[0, 0, 0].tolist() == pytest.approx([e / (e + 1), 1 / (e + 1)])


def test_embedding_scaled_by_sqrt_d_model():
    cfg = tiny()
    model = make(cfg)
    tok = torch.tensor([[5, 7]])
    expected = model.src_embed.weight[tok] * math.sqrt(cfg.d_model)
    assert torch.allclose(model.src_embed(tok), expected)
    unscaled = make(tiny(scale_embeddings=False))
    assert torch.allclose(unscaled.src_embed(tok), unscaled.src_embed.weight[tok])


def test_embeddings_and_softmax_share_one_matrix():
    model = make(tiny())
    assert model.src_embed.weight is model.tgt_embed.weight
    h = torch.randn(1, 1, 16, dtype=torch.float64)
    assert torch.allclose(model.output_logits(h), h @ model.src_embed.weight.T)
    untied = make(tiny(tie_src_tgt_embeddings=False, tie_embeddings=False, tgt_vocab_size=31))
    assert untied.src_embed.weight is not untied.tgt_embed.weight
    assert untied(torch.tensor([[4, 5, 3]]), torch.tensor([[2, 30]])).shape == (1, 2, 31)


@pytest.mark.parametrize("pre_norm, learned, attn_bias", [(False, False, False), (False, True, False),
                                                         (True, False, False), (True, True, False),
                                                         (False, False, True), (True, False, True)])
def test_cached_decoding_equals_teacher_forced(pre_norm, learned, attn_bias):
    model = make(tiny(pre_norm=pre_norm, learned_positions=learned, d_k=5, d_v=7, attn_bias=attn_bias))
    src = torch.tensor([[5, 6, 7, 8, 3], [9, 10, 3, 0, 0]])
    tgt = torch.tensor([[2, 11, 12, 13, 14, 15], [2, 16, 17, 18, 19, 20]])
    enc = model.encode(src)
    full = model.decode(tgt, enc).logits
    cache = init_cache(model, enc, max_len=3)  # smaller than needed: the cache must grow
    steps = []
    for t in range(tgt.size(1)):
        out = model.decode(tgt[:, t:t + 1], cache=cache)
        cache = out.cache
        steps.append(out.logits)
    assert cache.length == tgt.size(1)
    within(torch.cat(steps, 1), full, 2 * logit_bounds(model, "fp64", src, tgt))  # float64's roundings, derived


def test_cached_chunk_then_steps_equals_full():
    model = make(tiny())
    src = torch.tensor([[5, 6, 7, 3]])
    tgt = torch.tensor([[2, 11, 12, 13, 14]])
    enc = model.encode(src)
    full = model.decode(tgt, enc).logits
    cache = init_cache(model, enc, max_len=8)
    first = model.decode(tgt[:, :3], cache=cache).logits
    rest = model.decode(tgt[:, 3:], cache=cache).logits
    within(torch.cat([first, rest], 1), full, 2 * logit_bounds(model, "fp64", src, tgt))


def test_cache_reorder_equals_recomputing_reordered_prefixes():
    model = make(tiny())
    src = torch.tensor([[5, 6, 7, 3], [8, 9, 3, 0], [10, 3, 0, 0]])
    prefix = torch.tensor([[2, 11, 12], [2, 13, 14], [2, 15, 16]])
    enc = model.encode(src)
    cache = init_cache(model, enc, max_len=6)
    model.decode(prefix, cache=cache)
    order = torch.tensor([2, 0, 0, 1])
    cache = cache.reorder(order)
    nxt = torch.tensor([[17], [18], [19], [20]])
    got = model.decode(nxt, cache=cache).logits[:, -1]
    enc2 = aiayn.model.EncoderOutput(enc.memory[order], enc.src_pad[order])
    want = model.decode(torch.cat([prefix[order], nxt], 1), enc2).logits[:, -1]
    within(got, want, 2 * logit_bounds(model, "fp64", src[order], torch.cat([prefix[order], nxt], 1))[:, -1])


def test_sdpa_path_equals_explicit_path():
    model = make(tiny(d_k=6, d_v=10))
    src = torch.tensor([[5, 6, 7, 8, 3], [9, 10, 3, 0, 0]])
    tgt = torch.tensor([[2, 11, 12, 13], [2, 16, 17, 0]])
    enc_fast = model.encode(src)
    enc_slow = model.encode(src, need_weights=True)
    assert torch.allclose(enc_fast.memory, enc_slow.memory, atol=1e-12)
    fast = model.decode(tgt, enc_fast)
    slow = model.decode(tgt, enc_slow, need_weights=True)
    within(fast.logits, slow.logits, 2 * logit_bounds(model, "fp64", src, tgt))
    # returned weights are distributions over keys, zero on padding and on the future
    for w in enc_slow.weights + slow.cross_weights:
        assert torch.allclose(w.sum(-1), torch.ones_like(w.sum(-1)))
    assert torch.all(enc_slow.weights[0][1, :, :, 3:] == 0)
    assert torch.all(slow.self_weights[0][0].triu(1) == 0)


def test_a_row_of_padding_alone_gets_zero_weights_on_both_paths():
    """A source row of padding alone: no key may be attended to. The fused path gives such a query a
    zero output; the explicit one (weights asked for) gives the same, zero weights, not softmax's 0/0 = NaN,
    and its gradient stays finite. The other rows are as they were."""
    model = make(tiny())
    src = torch.tensor([[5, 6, 7, 8, 3], [0, 0, 0, 0, 0]])
    tgt = torch.tensor([[2, 11, 12, 13], [2, 16, 17, 0]])
    enc_fast, enc_slow = model.encode(src), model.encode(src, need_weights=True)
    assert torch.isfinite(enc_slow.memory).all()
    assert all(torch.all(w[1] == 0) for w in enc_slow.weights)
    fast = model.decode(tgt, enc_fast)
    slow = model.decode(tgt, enc_slow, need_weights=True)
    assert torch.isfinite(slow.logits).all() and all(torch.all(w[1] == 0) for w in slow.cross_weights)
    within(fast.logits[:1], slow.logits[:1], 2 * logit_bounds(model, "fp64", src[:1], tgt[:1]))
    q = torch.randn(1, 1, 2, 4, dtype=torch.float64, requires_grad=True)
    out, w = attention_explicit(q, q.detach(), q.detach(), torch.zeros(1, 1, 1, 2, dtype=torch.bool))
    assert torch.all(out == 0) and torch.all(w == 0)
    out.sum().backward()
    assert torch.all(q.grad == 0)


@pytest.mark.parametrize("src, message", [
    (torch.tensor([5, 6, 3]), r"src: expected a \(B, L\) tensor of token ids \(torch.long, batch first; one sentence: "
                              r"src\[None\]\), got torch.int64 of shape \(3,\)$"),
    (torch.tensor([[[5, 6, 3]]]), r"src: expected a \(B, L\) tensor .* got torch.int64 of shape \(1, 1, 3\)$"),
    ([[5, 6, 3]], r"src: expected a \(B, L\) tensor of token ids .*, got list$"),
    (torch.tensor([[5.0, 6.0, 3.0]]), r"src: expected a \(B, L\) tensor of token ids \(torch.long.* got torch.float32 of shape \(1, 3\)"),
    (torch.tensor([[5, 23, 3]]), r"src: token ids must be in \[0, 23\) \(the model's vocabulary\), got ids from 3 to 23"),
    (torch.tensor([[5, -1, 3]]), r"src: token ids must be in \[0, 23\) .* got ids from -1 to 5"),
])
def test_misused_token_ids_are_one_line_errors(src, message):
    """What a caller gets wrong about the ids (a 1-D sentence, a list, floats, ids past the vocabulary)
    is said in one line naming the argument, not an index error from inside attention or the embedding."""
    model = make(tiny())
    with pytest.raises(UserError, match=message) as info:
        model.encode(src)
    err = info.value  # one line, and no chained traceback of the embedding's own error under it
    assert "\n" not in str(err) and err.__cause__ is None and (err.__context__ is None or err.__suppress_context__)


def test_misused_target_ids_are_one_line_errors():
    model = make(tiny())
    src = torch.tensor([[5, 6, 3], [7, 3, 0]])
    with pytest.raises(UserError, match=r"tgt_in: expected a \(B, L\) tensor .* got torch.int64 of shape \(3,\)"):
        model(src, torch.tensor([2, 5, 6]))
    with pytest.raises(UserError, match=r"tgt_in: token ids must be in \[0, 23\)"):
        model(src, torch.tensor([[2, 5], [2, 99]]))
    with pytest.raises(UserError, match=r"tgt_in: 3 rows for an encoder output of 2 \(as many, or one\)"):
        model(src, torch.tensor([[2, 5], [2, 6], [2, 7]]))
    enc = model.encode(src[:1])  # one encoder row is broadcast over the target rows, as before
    assert model.decode(torch.tensor([[2, 5], [2, 6], [2, 7]]), enc).logits.shape == (3, 2, 23)
    assert model(src.int(), torch.tensor([[2, 5], [2, 6]], dtype=torch.int32)).shape == (2, 2, 23)


@pytest.mark.parametrize("attn_bias", [False, True])
def test_padded_batch_equals_each_sentence_alone(attn_bias):
    model = make(tiny(attn_bias=attn_bias))
    srcs = [[5, 6, 7, 8, 3], [9, 10, 3], [11, 3]]
    tgts = [[2, 11, 12, 13], [2, 14], [2, 15, 16]]
    S, T = max(map(len, srcs)), max(map(len, tgts))
    src = torch.tensor([s + [0] * (S - len(s)) for s in srcs])
    tgt = torch.tensor([t + [0] * (T - len(t)) for t in tgts])
    batched = model(src, tgt)
    for i, (s, t) in enumerate(zip(srcs, tgts)):
        alone = model(torch.tensor([s]), torch.tensor([t]))
        within(batched[i, : len(t)], alone[0], 2 * logit_bounds(model, "fp64", torch.tensor([s]), torch.tensor([t]))[0])


def test_dk_dv_independent_of_d_model_over_h():
    cfg = tiny(n_heads=3, d_k=5, d_v=7)  # 3*5 != 16
    model = make(cfg)
    attn = model.encoder_layers[0].self_attn
    assert attn.qkv_proj.weight.shape == (3 * (5 + 5 + 7), 16)
    assert attn.out_proj.weight.shape == (16, 3 * 7)
    assert model(torch.tensor([[4, 3]]), torch.tensor([[2, 5]])).shape == (1, 2, 23)


def test_pre_norm_has_final_layer_norms_post_norm_does_not():
    pre, post = make(tiny(pre_norm=True)), make(tiny())
    assert isinstance(pre.encoder_norm, torch.nn.LayerNorm) and isinstance(pre.decoder_norm, torch.nn.LayerNorm)
    assert isinstance(post.encoder_norm, torch.nn.Identity)
    # post-norm: each sub-layer output is normalized (zero mean, unit variance over D)
    norm = post.encoder_layers[0].conn_ffn.norm
    seen = []
    norm.register_forward_hook(lambda mod, inputs, out: seen.append(inputs[0].detach()))
    out, _ = post.encoder_layers[0](torch.randn(1, 3, 16, dtype=torch.float64), None)
    # float64: the mean μ (D + 1 roundings below mean|x|) moves every (x - μ) r alike, each of those and
    # the test's own mean round too (γ below mean|y|); the weight 1 and bias 0 are exact
    x, u64 = seen[-1], 2.0 ** -53
    r = torch.rsqrt(x.var(-1, unbiased=False) + norm.eps)
    bound = r * gamma(18, u64) * x.abs().mean(-1) + gamma(20, u64) * out.detach().abs().mean(-1)
    within(out.mean(-1), torch.zeros(1, 3, dtype=torch.float64), bound)


def test_learned_positions_refuse_too_long_input():
    model = make(tiny(learned_positions=True, max_positions=4))
    with pytest.raises(ValueError, match="max_positions"):
        model.encode(torch.tensor([[5, 6, 7, 8, 3]]))


def test_dropout_sites_active_in_training_only():
    cfg = tiny(p_drop=0.5)
    model = aiayn.Transformer(cfg).double()
    src, tgt = torch.tensor([[5, 6, 3]]), torch.tensor([[2, 7]])
    model.train()
    assert not torch.allclose(model(src, tgt), model(src, tgt))
    model.eval()
    assert torch.allclose(model(src, tgt), model(src, tgt))


def test_public_api_unknown_override_is_an_error():
    with pytest.raises(ValueError, match="unknown field"):
        aiayn.get_preset("base", d_modle=3)
    with pytest.raises(ValueError, match="unknown preset"):
        aiayn.get_preset("huge")


@pytest.mark.parametrize("field, value", [("p_drop_attn", 1.5), ("p_drop_ffn", -0.1), ("p_drop_attn", float("nan")),
                                          ("layer_norm_eps", 0.0), ("layer_norm_eps", -1e-6),
                                          ("layer_norm_eps", float("nan"))])
def test_config_refuses_dropout_and_epsilon_out_of_range(field, value):
    """A dropout rate outside [0, 1) fails torch's check only at the first training step, with a
    traceback; an epsilon <= 0 or NaN makes LayerNorm's outputs NaN without any error."""
    from aiayn.config import ConfigError
    with pytest.raises(ConfigError, match=f"{field} must be in"):
        aiayn.get_preset("tiny", vocab_size=50, **{field: value})
