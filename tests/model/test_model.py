"""Golden values and equivalence tests for the model of §3 (tiny models, float64, dropout off)."""
from __future__ import annotations

import math

import pytest
import torch

import aiayn
from aiayn.model.attention import attention_explicit
from aiayn.model.positional import sinusoidal_table


def tiny(**kw):
    base = dict(vocab_size=23, p_drop=0.0, n_layers=2, d_model=16, d_ff=32, n_heads=2, d_k=8, d_v=8)
    base.update(kw)
    return aiayn.get_preset("tiny", **base)


def make(cfg):
    model = aiayn.Transformer(cfg).double().eval()
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


@pytest.mark.parametrize("pre_norm", [False, True])
@pytest.mark.parametrize("learned", [False, True])
def test_cached_decoding_equals_teacher_forced(pre_norm, learned):
    model = make(tiny(pre_norm=pre_norm, learned_positions=learned, d_k=5, d_v=7))
    src = torch.tensor([[5, 6, 7, 8, 3], [9, 10, 3, 0, 0]])
    tgt = torch.tensor([[2, 11, 12, 13, 14, 15], [2, 16, 17, 18, 19, 20]])
    enc = model.encode(src)
    full = model.decode(tgt, enc).logits
    cache = model.init_cache(enc, max_len=3)  # smaller than needed: the cache must grow
    steps = []
    for t in range(tgt.size(1)):
        out = model.decode(tgt[:, t:t + 1], cache=cache)
        cache = out.cache
        steps.append(out.logits)
    assert cache.length == tgt.size(1)
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-10)


def test_cached_chunk_then_steps_equals_full():
    model = make(tiny())
    src = torch.tensor([[5, 6, 7, 3]])
    tgt = torch.tensor([[2, 11, 12, 13, 14]])
    enc = model.encode(src)
    full = model.decode(tgt, enc).logits
    cache = model.init_cache(enc, max_len=8)
    first = model.decode(tgt[:, :3], cache=cache).logits
    rest = model.decode(tgt[:, 3:], cache=cache).logits
    assert torch.allclose(torch.cat([first, rest], 1), full, atol=1e-10)


def test_cache_reorder_equals_recomputing_reordered_prefixes():
    model = make(tiny())
    src = torch.tensor([[5, 6, 7, 3], [8, 9, 3, 0], [10, 3, 0, 0]])
    prefix = torch.tensor([[2, 11, 12], [2, 13, 14], [2, 15, 16]])
    enc = model.encode(src)
    cache = model.init_cache(enc, max_len=6)
    model.decode(prefix, cache=cache)
    order = torch.tensor([2, 0, 0, 1])
    cache = cache.reorder(order)
    nxt = torch.tensor([[17], [18], [19], [20]])
    got = model.decode(nxt, cache=cache).logits[:, -1]
    enc2 = aiayn.model.EncoderOutput(enc.memory[order], enc.src_pad[order])
    want = model.decode(torch.cat([prefix[order], nxt], 1), enc2).logits[:, -1]
    assert torch.allclose(got, want, atol=1e-10)


def test_sdpa_path_equals_explicit_path():
    model = make(tiny(d_k=6, d_v=10))
    src = torch.tensor([[5, 6, 7, 8, 3], [9, 10, 3, 0, 0]])
    tgt = torch.tensor([[2, 11, 12, 13], [2, 16, 17, 0]])
    enc_fast = model.encode(src)
    enc_slow = model.encode(src, need_weights=True)
    assert torch.allclose(enc_fast.memory, enc_slow.memory, atol=1e-12)
    fast = model.decode(tgt, enc_fast)
    slow = model.decode(tgt, enc_slow, need_weights=True)
    assert torch.allclose(fast.logits, slow.logits, atol=1e-12)
    # returned weights are distributions over keys, zero on padding and on the future
    for w in enc_slow.weights + slow.cross_weights:
        assert torch.allclose(w.sum(-1), torch.ones_like(w.sum(-1)))
    assert torch.all(enc_slow.weights[0][1, :, :, 3:] == 0)
    assert torch.all(slow.self_weights[0][0].triu(1) == 0)


def test_padded_batch_equals_each_sentence_alone():
    model = make(tiny())
    srcs = [[5, 6, 7, 8, 3], [9, 10, 3], [11, 3]]
    tgts = [[2, 11, 12, 13], [2, 14], [2, 15, 16]]
    S, T = max(map(len, srcs)), max(map(len, tgts))
    src = torch.tensor([s + [0] * (S - len(s)) for s in srcs])
    tgt = torch.tensor([t + [0] * (T - len(t)) for t in tgts])
    batched = model(src, tgt)
    for i, (s, t) in enumerate(zip(srcs, tgts)):
        alone = model(torch.tensor([s]), torch.tensor([t]))
        assert torch.allclose(batched[i, : len(t)], alone[0], atol=1e-10)


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
    out, _ = post.encoder_layers[0](torch.randn(1, 3, 16, dtype=torch.float64), None)
    assert torch.allclose(out.mean(-1), torch.zeros(1, 3, dtype=torch.float64), atol=1e-9)


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


class _Counting:
    """A Kernels stand-in that counts the attention calls it passes on to the real library."""

    def __init__(self, lib):
        self.lib, self.forward, self.backward = lib, 0, 0

    def seq_attention_fast(self, d_k, d_v):
        return self.lib.seq_attention_fast(d_k, d_v)

    def supports_heads(self, *a):
        return self.lib.supports_heads(*a)

    def seq_attention_forward(self, *a):
        self.forward += 1
        return self.lib.seq_attention_forward(*a)

    def seq_attention_backward(self, *a):
        self.backward += 1
        return self.lib.seq_attention_backward(*a)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_attention_kernels_are_pytorchs_attention(precision):
    """train.c_kernels' attention (seq_attention.c through Transformer.use_attention_kernels) is a fast
    path: every attention of the model's forward goes through it (encoder, masked decoder, encoder-decoder),
    and the loss and every parameter's gradient are PyTorch's, up to rounding, in float32 and under bf16
    autocast (whose attention is computed in float32 either way)."""
    from aiayn.kernels.loader import load
    from aiayn.train import runtime as rt

    lib = load()
    if lib is None or not lib.seq_attention_fast(32, 32):
        pytest.skip("no C compiler or no AVX-512: training uses PyTorch's attention")
    torch.manual_seed(0)
    model = aiayn.Transformer(aiayn.ModelConfig(vocab_size=60, n_layers=2, d_model=64, d_ff=96, n_heads=2, d_k=32, d_v=32,
                                    p_drop=0.0))
    src, tgt = torch.randint(4, 60, (4, 9)), torch.randint(4, 60, (4, 7))
    src[1, 6:] = 0  # source padding: masked keys
    tgt[2, 4:] = 0
    counting = _Counting(lib)
    results = []
    for k in (counting, None):
        model.use_attention_kernels(k)
        model.zero_grad()
        with rt.autocast(torch.device("cpu"), precision):
            logits = model(src, tgt)
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, 60), tgt.view(-1), ignore_index=0)
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert counting.forward == 3 * 2 and counting.backward == 3 * 2  # 2 layers: encoder self, decoder self and cross
    (l1, g1), (l2, g2) = results
    tol = 1e-5 if precision == "fp32" else 2e-2
    assert l1 == pytest.approx(l2, rel=tol)
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], atol=tol * g2[name].abs().max().item() + 1e-7, rtol=tol)


def test_attention_kernels_step_aside():
    """Where the kernels do not apply, PyTorch's attention: weights asked for, attention dropout in
    training, heads the AVX-512 path lacks, and a module with no kernels."""
    from aiayn.kernels.loader import load

    lib = load()
    if lib is None:
        pytest.skip("no C compiler")
    model = aiayn.Transformer(aiayn.ModelConfig(vocab_size=60, n_layers=1, d_model=64, d_ff=96, n_heads=2, d_k=32, d_v=32,
                                    p_drop=0.0, p_drop_attn=0.1))
    counting = _Counting(lib)
    model.use_attention_kernels(counting)
    src, tgt = torch.randint(4, 60, (2, 5)), torch.randint(4, 60, (2, 4))
    model.train()
    model(src, tgt)  # attention dropout in training
    assert counting.forward == 0
    model.eval()
    model.encode(src, need_weights=True)
    assert counting.forward == 0
    model(src, tgt)  # evaluation: no dropout, so the kernels (where this build has them)
    assert counting.forward == (3 if lib.seq_attention_fast(32, 32) else 0)
    odd = aiayn.Transformer(aiayn.ModelConfig(vocab_size=60, n_layers=1, d_model=64, d_ff=96, n_heads=2, d_k=16, d_v=16))
    odd.use_attention_kernels(counting)
    odd.eval()(src, tgt)
    assert counting.forward == (3 if lib.seq_attention_fast(32, 32) else 0)  # d_k 16: not taken


def test_attn_fp32_upcasts_on_the_cpu_only():
    """``attn_fp32``: under CPU bf16 autocast the attention core is float32 (the same numbers as
    attending the same bf16 heads in float32 by hand); on CUDA it is not upcast, since the fused
    kernels keep the softmax in float32 themselves (a stand-in for a CUDA tensor: only its device
    type and dtype are read)."""
    from types import SimpleNamespace

    from aiayn.model.attention import MultiHeadAttention
    torch.manual_seed(0)
    mha = MultiHeadAttention(d_model=16, n_heads=2, d_k=8, d_v=8, p_drop_attn=0.0, self_attention=True).eval()
    x = torch.randn(2, 5, 16)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])[:, None, None, :]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k, v = mha.project_qkv(x)
        assert q.dtype == torch.bfloat16 and mha._upcast(q)
        out, _ = mha.attend(q, k, v, mask)
        want = attention_explicit(q.float(), k.float(), v.float(), mask)[0]
        want = mha.out_proj(want.transpose(1, 2).reshape(2, 5, 16).to(torch.bfloat16))
    assert torch.allclose(out.float(), want.float(), atol=1e-2)  # (one bf16 rounding of the output apart)
    cuda_heads = SimpleNamespace(device=torch.device("cpu"), dtype=torch.bfloat16)
    cuda_heads.device = SimpleNamespace(type="cuda")
    assert not mha._upcast(cuda_heads)
    mha.attn_fp32 = False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not mha._upcast(mha.project_qkv(x)[0])


@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("S,T", [(9, 7), (40, 33)])
def test_no_key_mask_for_a_source_without_padding(kernels, precision, S, T):
    """``src_padded=False`` (``Batch.src_padded``: the batch is known to hold no padding) gives the
    attention no key mask, so the fused kernels may take flash; on the CPU the same logits and gradients,
    bit for bit, as the all-true mask, through PyTorch's attention and through the C kernels."""
    from aiayn.kernels.loader import load
    from aiayn.train import runtime as rt

    lib = load() if kernels else None
    if kernels and (lib is None or not lib.seq_attention_fast(32, 32)):
        pytest.skip("no C compiler or no AVX-512")
    torch.manual_seed(0)
    model = aiayn.Transformer(aiayn.ModelConfig(vocab_size=60, n_layers=2, d_model=64, d_ff=96, n_heads=2, d_k=32,
                                                d_v=32, p_drop=0.0))
    model.use_attention_kernels(lib)
    src, tgt = torch.randint(4, 60, (3, S)), torch.randint(4, 60, (3, T))
    results = []
    for padded in (True, False):
        model.zero_grad()
        with rt.autocast(torch.device("cpu"), precision):
            logits = model(src, tgt, src_padded=padded)
        logits.float().square().mean().backward()
        results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    (a, ga), (b, gb) = results
    assert torch.equal(a, b)
    assert all(torch.equal(x, y) for x, y in zip(ga, gb))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_additive_key_mask_equals_the_boolean_one(dtype):
    """``key_mask`` with a dtype (what CUDA's training gets, made once for every layer): 0 at tokens,
    -inf at padding, its rows 16 entries apart (no copy by the memory-efficient kernel), and the same
    attention as the boolean mask."""
    from aiayn.model.attention import MultiHeadAttention, key_mask
    src_pad = torch.tensor([[False] * 7, [False] * 4 + [True] * 3])
    additive = key_mask(src_pad, dtype)
    assert additive.shape == (2, 1, 1, 7) and additive.dtype == dtype and additive.stride()[0] % 16 == 0
    assert additive[1, 0, 0].tolist() == [0.0] * 4 + [float("-inf")] * 3
    torch.manual_seed(0)
    mha = MultiHeadAttention(d_model=16, n_heads=2, d_k=8, d_v=8, p_drop_attn=0.0, self_attention=True).to(dtype)
    q, k, v = mha.project_qkv(torch.randn(2, 7, 16, dtype=dtype))
    plain, _ = mha.attend(q, k, v, key_mask(src_pad))
    fast, _ = mha.attend(q, k, v, additive)
    torch.testing.assert_close(fast, plain, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-2)
