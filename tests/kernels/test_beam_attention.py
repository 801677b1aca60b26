"""beam_attention.c: the beam step's self- and cross-attention against Eq. 1 written out
(attention_explicit), by hand on a tiny case, in float32 and bfloat16, with 1 and 2 threads; its append
against the cache's; and the kernel inside beam search, against PyTorch's attention."""
import copy
import math

import pytest
import torch

from aiayn.model.attention import attention_explicit
from tests.decode.test_adapter import V, sources
from tests.arith import rounded_to, within
from tests.kernels.reference import eq1_bounds, shared_slot_case, tiny_model


def eq1_within_bounds(out, q, k, v, allowed, ref=None):
    """out (B,H,T,Dv), the kernel's, against Eq. 1 (ref, computed by hand, or else attention_explicit in
    float64) from q (B,H,T,K), k, v (B,H,S,K|Dv) within ``eq1_bounds`` (beam_attention.c's float32
    arithmetic, whatever its order or instruction set) plus, for bfloat16 heads, the one rounding of its
    result to bfloat16 (``rounded_to``)."""
    if ref is None:
        ref, _ = attention_explicit(q.double(), k.double(), v.double(), allowed)
    within(out, ref, rounded_to(q.dtype, eq1_bounds(q, k, v, allowed)["out"], ref))


def shared_slot_rows(k, v, anc, g):
    """Each row's own keys and values, gathered by hand (slot anc[s,r,j] at position j < n-1, its own
    slot r at n-1): (N,H,n,K) and (N,H,n,Dv)."""
    Bs, n = anc.size(0), k.size(2) // g
    rows = []
    for s in range(Bs):
        for r in range(g):
            idx = [j * g + int(anc[s, r, j]) for j in range(n - 1)] + [(n - 1) * g + r]
            rows.append((k[s][:, idx], v[s][:, idx]))
    return tuple(torch.stack(x) for x in zip(*rows))


def check_self_attention(out, q, k, v, anc, g, ref=None):
    """The shared-slot self-attention's out (N, H*Dv) against Eq. 1 over each row's own prefix (ref, if
    given, (N,H,1,Dv))."""
    N, H = q.size(0), q.size(1)
    k1, v1 = shared_slot_rows(k, v, anc, g)
    allowed = torch.ones(N, 1, 1, k1.size(2), dtype=torch.bool)
    eq1_within_bounds(out.view(N, 1, H, -1).transpose(1, 2), q, k1, v1, allowed, ref)


def check_cross_attention(out, q, k, v, pad, g, ref=None):
    """The cross-attention's out (Bs*g, H*Dv) against Eq. 1 over each sentence's unpadded keys (ref, if
    given, (Bs,H,g,Dv))."""
    Bs, H, _, K = k.shape
    qg = q.reshape(Bs, g, H, K).transpose(1, 2)  # (Bs,H,g,K)
    eq1_within_bounds(out.view(Bs, g, H, -1).transpose(1, 2), qg, k, v, ~pad[:, None, None, :], ref)


def test_hand_computed_cross_attention(kernels):
    # One sentence, one head, one beam row, d_k = 4: q = (2,0,0,0), keys e1, 0, e1 (the last is padding),
    # values (1,0), (0,1), (9,9). Scores q.k / sqrt(4) = 1, 0 (padding skipped): softmax e/(e+1), 1/(e+1).
    q = torch.tensor([2.0, 0, 0, 0]).view(1, 1, 1, 4)
    k = torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]]).view(1, 1, 3, 4)
    v = torch.tensor([[1.0, 0], [0, 1], [9, 9]]).view(1, 1, 3, 2)
    pad = torch.tensor([[False, False, True]])
    out = kernels.cross_attention(q, k, v, pad, g=1)
    e = math.e
    want = torch.tensor([e / (e + 1), 1 / (e + 1)], dtype=torch.float64).view(1, 1, 1, 2)
    check_cross_attention(out, q, k, v, pad, 1, want)


def test_hand_computed_shared_slots(kernels):
    # One sentence, g = 2 rows, one head, d_k = 1, two positions. Slots: position 0 holds keys 1 (slot 0)
    # and 3 (slot 1); position 1 (the new one) holds 0 and 2. Row 0's prefix is slot 1 at position 0,
    # row 1's is slot 0. q = 1 for both rows: row 0 sees keys (3, 0) -> softmax(3, 0); row 1 sees (1, 2).
    q = torch.ones(2, 1, 1, 1)
    k = torch.tensor([1.0, 3.0, 0.0, 2.0]).view(1, 1, 4, 1)
    v = torch.tensor([10.0, 20.0, 30.0, 40.0]).view(1, 1, 4, 1)
    anc = torch.tensor([[[1, 0], [0, 0]]])  # (Bs=1, g=2, cap=2); anc[0, r, 1] is ignored (own slot)
    out = kernels.self_attention(q, k, v, anc, g=2)
    p0 = 1 / (1 + math.exp(-3))  # weight of key 3 against key 0
    p1 = 1 / (1 + math.exp(1))  # weight of key 1 against key 2
    want = torch.tensor([20 * p0 + 30 * (1 - p0), 10 * p1 + 40 * (1 - p1)], dtype=torch.float64).view(2, 1, 1, 1)
    check_self_attention(out, q, k, v, anc, 2, want)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_slot_self_attention_is_eq1(kernels, dtype, threads):
    q, k, v, anc = shared_slot_case(dtype=dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernels.self_attention(q, k, v, anc, g=4)
    finally:
        torch.set_num_threads(before)
    assert out.dtype == dtype and out.shape == (12, 2 * 6)
    check_self_attention(out, q, k, v, anc, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_attention_is_eq1_with_padding(kernels, dtype):
    Bs, g, H, S, K, Dv = 3, 4, 2, 6, 8, 6
    q = torch.randn(Bs * g, 1, H, K).transpose(1, 2).to(dtype)
    kv = torch.randn(Bs, S, H, K + Dv).to(dtype)  # keys and values of one projection, as project_kv splits them
    k, v = kv[..., :K].transpose(1, 2), kv[..., K:].transpose(1, 2)  # (Bs,H,S,K), (Bs,H,S,Dv), strided
    pad = torch.zeros(Bs, S, dtype=torch.bool)
    pad[1, 4:] = True
    pad[2, 1:] = True
    check_cross_attention(kernels.cross_attention(q, k, v, pad, g=g), q, k, v, pad, g)


@pytest.fixture(params=["native", "x86-64-v3", "portable"])
def build(request):
    """The native build (AVX-512's paths on AVX-512 CPUs), the AVX2 one, and the plain loops."""
    return request.getfixturevalue({"native": "kernels", "x86-64-v3": "x86_64_v3"}.get(request.param, request.param))


@pytest.mark.parametrize("K", [32, 64])
@pytest.mark.parametrize("n", [1, 17, 35])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_register_blocked_path_is_eq1(build, K, n, dtype):
    # beam 4 with d_k = d_v = 32 or 64 takes DEFINE_FAST in beam_attention.c (with AVX-512, or AVX2 +
    # FMA), the other tests' d_k = 8 the general loop; n = 17 and 35 also leave a tail after the 16-
    # or 8-wide blocks of the softmax
    q, k, v, anc = shared_slot_case(Bs=3, g=4, H=2, n=n, K=K, Dv=K, dtype=dtype, cap=n + 1)
    check_self_attention(build.self_attention(q, k, v, anc, g=4), q, k, v, anc, 4)
    pad = torch.zeros(3, n, dtype=torch.bool)
    pad[1, n // 2 + 1:] = True
    ks, vs = k[:, :, :n], v[:, :, :n]  # (Bs,H,S,K): n source positions
    check_cross_attention(build.cross_attention(q, ks, vs, pad, g=4), q, ks, vs, pad, 4)


@pytest.mark.parametrize("K", [32, 64])
@pytest.mark.parametrize("n", [1, 13, 35])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_register_blocked_path_is_the_general_one_bit_for_bit(build, K, n, dtype):
    # the same rows as beam 4 (DEFINE_FAST) and as beam 1 (the general loop's dot_* and axpy_*), each row
    # its own sentence with its own keys: the same operations in the same order, so the same bits
    Bs, g, H = 3, 4, 2
    q, k, v, anc = shared_slot_case(Bs=Bs, g=g, H=H, n=n, K=K, Dv=K, dtype=dtype, cap=n + 1)
    k1, v1 = shared_slot_rows(k, v, anc, g)  # row s*g + r's keys and values, position by position
    own = torch.zeros(Bs * g, 1, n + 1, dtype=torch.int64)  # beam 1: every position's only slot
    assert torch.equal(build.self_attention(q, k, v, anc, g=g), build.self_attention(q, k1, v1, own, g=1))
    pad = torch.zeros(Bs, n, dtype=torch.bool)
    pad[1, n // 2 + 1:] = True
    ks, vs = k[:, :, :n], v[:, :, :n]  # (Bs,H,S,K): n source positions
    assert torch.equal(build.cross_attention(q, ks, vs, pad, g=g),
                       build.cross_attention(q, ks.repeat_interleave(g, 0), vs.repeat_interleave(g, 0),
                                             pad.repeat_interleave(g, 0), g=1))


def test_bad_shapes_are_errors(kernels):
    q, k, v, anc = shared_slot_case()
    with pytest.raises(ValueError, match="bad shapes"):
        kernels.self_attention(q[:-1], k, v, anc, g=4)
    with pytest.raises(ValueError, match="new keys/values"):
        kernels.self_attention(q, k, v, anc, g=4, new_k=q)  # new_v missing
    with pytest.raises(ValueError, match="new keys/values"):
        kernels.self_attention(q, k, v, anc, g=4, new_k=q[:-1], new_v=q[:-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [8, 64])
def test_the_kernels_append_is_the_caches(kernels, K, dtype):
    # self_attention with the step's new keys/values on DecoderCache.slots writes what DecoderCache.append
    # writes and returns what it returns after append, bit for bit, over steps that grow the cache
    from aiayn.decode.cache import LayerCache, share_slots

    Bs, g, H = 3, 4, 2

    def cache():
        empty = torch.empty(Bs, H, 0, K, dtype=dtype)
        return share_slots([LayerCache(empty, empty, empty, empty)], torch.zeros(Bs, 5, dtype=torch.bool), g, 2)

    plain_cache, fused_cache = cache(), cache()  # capacity 2: the third step grows both
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        q = torch.randn(Bs * g, 1, H, K, generator=gen).transpose(1, 2).to(dtype)  # (N,H,1,K), as project_qkv
        kv = torch.randn(Bs * g, 1, 2 * H * K, generator=gen).to(dtype)  # one projection, split as project_qkv
        k, v = (x.view(Bs * g, 1, H, K).transpose(1, 2) for x in kv.split(H * K, dim=-1))
        plain = kernels.self_attention(q, *plain_cache.append(0, k, v), plain_cache.ancestors, g)
        fused = kernels.self_attention(q, *fused_cache.slots(0), fused_cache.ancestors, g, k, v)
        assert torch.equal(plain, fused)
        L = step + 1
        for name in ("self_k", "self_v"):
            assert torch.equal(getattr(plain_cache.layers[0], name)[:, :, : L * g],
                               getattr(fused_cache.layers[0], name)[:, :, : L * g])
        anc = torch.randint(0, g, (Bs, g, L), generator=gen)  # the beams of each sentence continue random slots
        for c in (plain_cache, fused_cache):
            c.ancestors[:, :, :L] = anc
            c.length = L


def test_cached_steps_with_the_kernel_equal_pytorchs(kernels):
    # the same shared-slot cache driven step by step, beams reordered within sentences and a sentence
    # dropped: log-probabilities with the kernel equal those with PyTorch's attention up to both paths'
    # float32 roundings (step_bound of each row's step, its history followed through the reorders)
    from aiayn.decode.adapter import CachedDecoder
    from tests.rounding import step_bound

    model, src = tiny_model(), sources()[:3]
    g = torch.Generator().manual_seed(2)
    decoders = [CachedDecoder(model, kernels=kernels), CachedDecoder(model)]
    sentence = torch.arange(3).repeat_interleave(4)  # each row's sentence, and its tokens so far
    history = torch.full((12, 1), 2)
    with torch.inference_mode():
        states = [d.start(src, 12).reorder(sentence) for d in decoders]
        assert states[0].cache.kernels is kernels and states[0].cache.shared_slots
        tokens = torch.full((12,), 2)
        for step in range(8):
            outs = [d.step(tokens, s) for d, s in zip(decoders, states)]
            within(outs[0][0], outs[1][0].double(), 2 * step_bound(model, "fp32", src, history, sentence))
            states = [o[1] for o in outs]
            n = tokens.numel()
            if step == 4:  # the second sentence leaves
                idx = torch.tensor([r for r in range(n) if r // 4 != 1])
            else:  # each row continues a random beam of its own sentence
                idx = (torch.arange(n) // 4) * 4 + torch.randint(0, 4, (n,), generator=g)
            states = [s.reorder(idx) for s in states]
            assert states[0].cache.kernels is kernels and states[0].cache.shared_slots
            tokens = torch.randint(4, V, (idx.numel(),), generator=g)
            sentence, history = sentence[idx], torch.cat([history[idx], tokens[:, None]], 1)


@pytest.mark.parametrize("precision", ["fp32", "int8-bf16"])
def test_translator_beam_search_with_and_without_the_kernel(request, kernels, monkeypatch, precision):
    # the Translator's decoder gets the kernel from DecodeConfig.c_kernels; fp32 outputs are the same
    # hypotheses with the same scores up to float32's roundings (same_float_search; a random model); int8-bf16 (bfloat16 attention, rounded
    # differently, and emulated on CPUs without bf16 instructions) the same best hypotheses, on a model
    # whose decisions lead by more than that rounding moves them (confident_model), each score within
    # score_bound (int8's steps and bfloat16's roundings along its path, tests/rounding.py) of
    # the exact one, so the two within twice that. Without VNNI decoding refuses int8-bf16 without the
    # kernels (test_int8_bf16_is_refused_without_vnni_and_without_the_kernels_avx2_product): lifted
    # here, its int8 products are then int_mm_float's, exact, the same sums as the kernel's
    from aiayn.decode import loading, translator as tr_mod
    from aiayn.decode.config import DecodeConfig
    from aiayn.decode.search import search
    from tests.rounding import same_float_search, score_bound

    monkeypatch.setattr(loading, "load_kernels", lambda: kernels)
    monkeypatch.setattr(loading, "require_int8_product", lambda precision, kernels: None)
    calls = []
    for name in ("self_attention", "cross_attention", "log_softmax_topk"):
        fn = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _fn=fn, _name=name: calls.append(_name) or _fn(*a))

    model, src = (tiny_model(), sources()) if precision == "fp32" else request.getfixturevalue("confident_model")
    out = {}
    for on in (True, False):
        t = tr_mod.Translator(model, None, None, DecodeConfig(beam_size=4, nbest=4, precision=precision, c_kernels=on))
        assert t.decoder.kernels is (kernels if on else None)
        with torch.inference_mode():
            out[on] = search(t.decoder, src, t.cfg, t.ids)
    layers = len(model.decoder_layers)
    assert calls.count("self_attention") == calls.count("cross_attention") > layers  # every step after the first
    assert calls.count("log_softmax_topk") >= calls.count("self_attention") // layers  # every step's selection
    if precision == "fp32":  # the same hypotheses, each score within both paths' float32 roundings
        same_float_search(model, src, out[True], out[False], t.cfg, t.ids)
    else:
        assert [hs[0].tokens for hs in out[True]] == [hs[0].tokens for hs in out[False]]
        for s, (a, b) in enumerate(zip(out[True], out[False])):
            assert abs(a[0].score - b[0].score) <= 2 * score_bound(model, precision, src[s], b[0], t.cfg, t.ids)


def test_int8_bf16_is_refused_without_vnni_and_without_the_kernels_avx2_product(portable, monkeypatch):
    # on a CPU without VNNI (onednn_vnni, here made to say so on any CPU) the Translator refuses int8-bf16
    # with the kernels off, and with a build of the kernels' plain loops (no AVX2) alike: when it is made,
    # not at its first batch in each worker process; and so does a decoding copy made without a Translator
    from aiayn.decode import int8, loading, translator as tr_mod
    from aiayn.decode.config import DecodeConfig
    from aiayn.errors import UserError

    model = tiny_model()
    monkeypatch.setattr(int8, "onednn_vnni", lambda: False)
    monkeypatch.setattr(loading, "load_kernels", lambda: portable)
    assert not portable.int8_vector
    for on in (False, True):
        for n in (1, 2):
            with pytest.raises(UserError, match="needs a CPU with VNNI"):
                tr_mod.Translator(model, None, None, DecodeConfig(beam_size=4, precision="int8-bf16", c_kernels=on,
                                                                   workers=n))
        with pytest.raises(UserError, match="needs a CPU with VNNI"):
            loading.model_for_precision(model, "int8-bf16", portable if on else None)


def test_decoding_kernels_follow_the_config(kernels, monkeypatch, int8_anywhere):
    from aiayn.decode import loading
    from aiayn.decode.config import DecodeConfig

    monkeypatch.setattr(loading, "load_kernels", lambda: kernels)
    model = tiny_model()
    assert loading.decoding_kernels(DecodeConfig(), model) is kernels
    assert loading.decoding_kernels(DecodeConfig(c_kernels=False), model) is None
    q = loading.model_for_precision(model, "int8-bf16", kernels)
    assert q.out_proj.kernels is kernels
    assert copy.deepcopy(q).out_proj.kernels is kernels  # a copy shares the loaded library


def test_steps_that_the_kernels_do_not_take(kernels, monkeypatch):
    # attention weights asked for, autocast, or a dtype the kernel lacks: PyTorch's attention, same numbers
    from aiayn.decode.adapter import CachedDecoder
    from tests.rounding import step_bound

    def refuse(*a, **k):
        raise AssertionError("the kernel was called")

    model, src = tiny_model(), sources()[:2]
    with torch.inference_mode():
        state = CachedDecoder(model, kernels=kernels).start(src, 6).reorder(torch.arange(2).repeat_interleave(4))
        tokens = torch.full((8,), 2)
        reference = model.decode(tokens[:, None], cache=state.cache.unshared()).logits
        monkeypatch.setattr(kernels, "self_attention", refuse)
        monkeypatch.setattr(kernels, "cross_attention", refuse)
        out = model.decode(tokens[:, None], cache=state.cache, need_weights=True)  # as attention plots ask
        assert out.self_weights is not None
        bound = step_bound(model, "fp32", src).repeat_interleave(4, 0)  # the first step's, float32's roundings (8, V)
        within(out.logits[:, 0].log_softmax(-1), reference[:, 0].log_softmax(-1).double(), 2 * bound)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            state64 = CachedDecoder(model, kernels=kernels).start(src, 6).reorder(torch.arange(2).repeat_interleave(4))
            model.decode(tokens[:, None], cache=state64.cache)
        double = tiny_model(torch.float64)
        state64 = CachedDecoder(double, kernels=kernels).start(src, 6).reorder(torch.arange(2).repeat_interleave(4))
        double.decode(tokens[:, None], cache=state64.cache)
