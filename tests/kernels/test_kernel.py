"""kernels/loader.py: the C beam-step attention against Eq. 1 written out (attention_explicit), by hand on
a tiny case, in float32 and bfloat16, with 1 and 2 threads; the top-k log-probabilities against PyTorch's
log_softmax and topk; the int8 passes against PyTorch's; the same library built without -march=native
(the portable loops); and what happens without a compiler."""
import copy
import os
import math

import pytest
import torch

from aiayn.kernels import loader as kernel_mod
from aiayn.model.attention import attention_explicit
from tests.decode.test_adapter import V, sources


@pytest.fixture(scope="module")
def portable(tmp_path_factory):
    """The library compiled without -march=native: the plain C loops (no AVX-512 intrinsics)."""
    import ctypes

    cc = kernel_mod._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    path = tmp_path_factory.mktemp("portable") / "portable.so"
    assert kernel_mod._compile(cc, path, archs=([],)) is None
    return kernel_mod.Kernels(ctypes.CDLL(str(path)), path)


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("AIAYN_CACHE_DIR", str(tmp_path_factory.mktemp("kernels")))
    kernel_mod.load.cache_clear()
    k = kernel_mod.load()
    mp.undo()
    kernel_mod.load.cache_clear()
    if k is None:
        pytest.skip("no C compiler on this machine: decoding uses PyTorch's attention (tested elsewhere)")
    return k


def _shared_slot_case(Bs=3, g=4, H=2, n=5, K=8, Dv=6, dtype=torch.float32, cap=7):
    """Random q (N,H,1,K), slot buffers (Bs,H,cap*g,K) with n filled positions, ancestors (Bs,g,cap)."""
    q = torch.randn(Bs * g, 1, H, K).transpose(1, 2).to(dtype)  # (N,H,1,K), strided as project_qkv gives it
    k_buf = torch.randn(Bs, H, cap * g, K).to(dtype)
    v_buf = torch.randn(Bs, H, cap * g, Dv).to(dtype)
    anc = torch.randint(0, g, (Bs, g, cap))
    return q, k_buf[:, :, : n * g], v_buf[:, :, : n * g], anc


def _shared_slot_reference(q, k, v, anc, g):
    """Each row's own prefix gathered by hand (slot anc[s,r,j] at position j < n-1, its own slot r at
    n-1), then Eq. 1 in float32: (N, H*Dv)."""
    N, H, _, K = q.shape
    n = k.size(2) // g
    rows = []
    for row in range(N):
        s, r = divmod(row, g)
        idx = [j * g + int(anc[s, r, j]) for j in range(n - 1)] + [(n - 1) * g + r]
        ks, vs = k[s][:, idx].float(), v[s][:, idx].float()  # (H,n,K), (H,n,Dv)
        out, _ = attention_explicit(q[row].float()[None], ks[None], vs[None], None)  # (1,H,1,Dv)
        rows.append(out.reshape(-1))
    return torch.stack(rows)


def test_hand_computed_cross_attention(kernels):
    # One sentence, one head, one beam row, d_k = 4: q = (2,0,0,0), keys e1, 0, e1 (the last is padding),
    # values (1,0), (0,1), (9,9). Scores q.k / sqrt(4) = 1, 0 (padding skipped): softmax e/(e+1), 1/(e+1).
    q = torch.tensor([2.0, 0, 0, 0]).view(1, 1, 1, 4)
    k = torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]]).view(1, 1, 3, 4)
    v = torch.tensor([[1.0, 0], [0, 1], [9, 9]]).view(1, 1, 3, 2)
    pad = torch.tensor([[False, False, True]])
    out = kernels.cross_attention(q, k, v, pad, g=1)
    e = math.e
    assert out.view(-1).tolist() == pytest.approx([e / (e + 1), 1 / (e + 1)], abs=1e-6)


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
    assert out.view(-1).tolist() == pytest.approx([20 * p0 + 30 * (1 - p0), 10 * p1 + 40 * (1 - p1)], abs=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_shared_slot_self_attention_is_eq1(kernels, dtype, tol, threads):
    q, k, v, anc = _shared_slot_case(dtype=dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernels.self_attention(q, k, v, anc, g=4)
    finally:
        torch.set_num_threads(before)
    assert out.dtype == dtype and out.shape == (12, 2 * 6)
    torch.testing.assert_close(out.float(), _shared_slot_reference(q, k, v, anc, 4), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cross_attention_is_eq1_with_padding(kernels, dtype, tol):
    Bs, g, H, S, K, Dv = 3, 4, 2, 6, 8, 6
    q = torch.randn(Bs * g, 1, H, K).transpose(1, 2).to(dtype)
    kv = torch.randn(Bs, S, H, K + Dv).to(dtype)  # keys and values of one projection, as project_kv splits them
    k, v = kv[..., :K].transpose(1, 2), kv[..., K:].transpose(1, 2)  # (Bs,H,S,K), (Bs,H,S,Dv), strided
    pad = torch.zeros(Bs, S, dtype=torch.bool)
    pad[1, 4:] = True
    pad[2, 1:] = True
    out = kernels.cross_attention(q, k, v, pad, g=g)
    qg = q.reshape(Bs, g, H, K).transpose(1, 2).float()  # (Bs,H,g,K)
    ref, _ = attention_explicit(qg, k.float(), v.float(), ~pad[:, None, None, :])
    torch.testing.assert_close(out.float(), ref.transpose(1, 2).reshape(Bs * g, H * Dv), atol=tol, rtol=tol)


@pytest.mark.parametrize("K", [32, 64])
@pytest.mark.parametrize("n", [1, 17, 35])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_register_blocked_path_is_eq1(kernels, K, n, dtype, tol):
    # beam 4 with d_k = d_v = 32 or 64 takes DEFINE_FAST in beam_attention.c (with AVX-512), the other
    # tests' d_k = 8 the general loop; n = 17 and 35 also leave a masked tail in the 16-wide softmax
    q, k, v, anc = _shared_slot_case(Bs=3, g=4, H=2, n=n, K=K, Dv=K, dtype=dtype, cap=n + 1)
    torch.testing.assert_close(kernels.self_attention(q, k, v, anc, g=4).float(),
                               _shared_slot_reference(q, k, v, anc, 4), atol=tol, rtol=tol)
    pad = torch.zeros(3, n, dtype=torch.bool)
    pad[1, n // 2 + 1:] = True
    ks, vs = k[:, :, :n], v[:, :, :n]  # (Bs,H,S,K): n source positions
    qg = q.reshape(3, 4, 2, K).transpose(1, 2).float()  # (Bs,H,g,K)
    ref, _ = attention_explicit(qg, ks.float(), vs.float(), ~pad[:, None, None, :])
    torch.testing.assert_close(kernels.cross_attention(q, ks, vs, pad, g=4).float(),
                               ref.transpose(1, 2).reshape(12, 2 * K), atol=tol, rtol=tol)


def test_bad_shapes_are_errors(kernels):
    q, k, v, anc = _shared_slot_case()
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
    from aiayn.model.cache import LayerCache, share_slots

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


def test_without_a_compiler_load_returns_none(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path / "kernels"))
    kernel_mod.load.cache_clear()
    try:
        with caplog.at_level("INFO", logger="aiayn.kernels.loader"):
            assert kernel_mod.load() is None
    finally:
        kernel_mod.load.cache_clear()
    assert "no C compiler" in caplog.text


def test_a_compile_error_is_logged_and_returns_none(monkeypatch, tmp_path, caplog):
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(kernel_mod, "SOURCES", (kernel_mod.SOURCES[0], bad))
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path / "kernels"))
    kernel_mod.load.cache_clear()
    try:
        if kernel_mod._compiler() is None:
            pytest.skip("no C compiler")
        with caplog.at_level("WARNING", logger="aiayn.kernels.loader"):
            assert kernel_mod.load() is None
    finally:
        kernel_mod.load.cache_clear()
    assert "could not compile beam_attention.c bad.c" in caplog.text
    assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-written is left to load


# ---- the kernel inside beam search -------------------------------------------------------------------

def _tiny_model(dtype=torch.float32):
    import aiayn.model as M

    torch.manual_seed(0)
    return M.Transformer(M.get_preset("tiny", vocab_size=V, p_drop=0.0)).to(dtype).eval()


def test_cached_steps_with_the_kernel_equal_pytorchs(kernels):
    # the same shared-slot cache driven step by step, beams reordered within sentences and a sentence
    # dropped: log-probabilities with the kernel equal those with PyTorch's attention
    from aiayn.decode.adapter import CachedDecoder

    model, src = _tiny_model(), sources()[:3]
    g = torch.Generator().manual_seed(2)
    decoders = [CachedDecoder(model, kernels=kernels), CachedDecoder(model)]
    with torch.inference_mode():
        states = [d.start(src, 12).reorder(torch.arange(3).repeat_interleave(4)) for d in decoders]
        assert states[0].cache.kernels is kernels and states[0].cache.shared_slots
        tokens = torch.full((12,), 2)
        for step in range(8):
            outs = [d.step(tokens, s) for d, s in zip(decoders, states)]
            torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-5, rtol=1e-5)
            states = [o[1] for o in outs]
            n = tokens.numel()
            if step == 4:  # the second sentence leaves
                idx = torch.tensor([r for r in range(n) if r // 4 != 1])
            else:  # each row continues a random beam of its own sentence
                idx = (torch.arange(n) // 4) * 4 + torch.randint(0, 4, (n,), generator=g)
            states = [s.reorder(idx) for s in states]
            assert states[0].cache.kernels is kernels and states[0].cache.shared_slots
            tokens = torch.randint(4, V, (idx.numel(),), generator=g)


@pytest.mark.parametrize("precision", ["fp32", "int8-bf16"])
def test_translator_beam_search_with_and_without_the_kernel(kernels, monkeypatch, precision):
    # the Translator's decoder gets the kernel from DecodeConfig.c_kernels; fp32 outputs are the same
    # hypotheses with the same scores, int8-bf16 (bfloat16 attention, rounded differently) nearly so
    from aiayn.decode import loading, translator as tr_mod
    from aiayn.decode.config import DecodeConfig
    from aiayn.decode.search import search

    monkeypatch.setattr(loading, "load_kernels", lambda: kernels)
    calls = []
    for name in ("self_attention", "cross_attention", "log_softmax_topk"):
        fn = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _fn=fn, _name=name: calls.append(_name) or _fn(*a))
    model, src = _tiny_model(), sources()
    out = {}
    for on in (True, False):
        t = tr_mod.Translator(model, None, None, DecodeConfig(beam_size=4, nbest=4, precision=precision, c_kernels=on))
        assert t.decoder.kernels is (kernels if on else None)
        with torch.inference_mode():
            out[on] = search(t.decoder, src, t.cfg, t.ids)
    layers = len(model.decoder_layers)
    assert calls.count("self_attention") == calls.count("cross_attention") > layers  # every step after the first
    assert calls.count("log_softmax_topk") >= calls.count("self_attention") // layers  # every step's selection
    if precision == "fp32":
        assert [[h.tokens for h in hs] for hs in out[True]] == [[h.tokens for h in hs] for hs in out[False]]
        for a, b in zip(out[True], out[False]):
            assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-5)
    else:
        best = [hs[0].tokens for hs in out[True]], [hs[0].tokens for hs in out[False]]
        assert sum(a == b for a, b in zip(*best)) >= len(best[0]) - 1


def test_decoding_kernels_follow_the_config(kernels, monkeypatch):
    from aiayn.decode import loading
    from aiayn.decode.config import DecodeConfig

    monkeypatch.setattr(loading, "load_kernels", lambda: kernels)
    model = _tiny_model()
    assert loading.decoding_kernels(DecodeConfig(), model) is kernels
    assert loading.decoding_kernels(DecodeConfig(c_kernels=False), model) is None
    q = loading.model_for_precision(model, "int8-bf16", kernels)
    assert q.out_proj.kernels is kernels
    assert copy.deepcopy(q).out_proj.kernels is kernels  # a copy shares the loaded library


# ---- the end of a beam step: log-softmax and each row's k best ---------------------------------------

def test_hand_computed_log_softmax_topk(kernels):
    # z = log(1, 2, 3, 4): p = (0.1, 0.2, 0.3, 0.4); token 3 banned, so the 2 best are 2 then 1
    z = torch.tensor([[0.0, math.log(2), math.log(3), math.log(4)]])
    values, ids = kernels.log_softmax_topk(z, 2, torch.tensor([3]))
    assert ids.tolist() == [[2, 1]]
    torch.testing.assert_close(values, torch.tensor([[math.log(0.3), math.log(0.2)]]), atol=1e-6, rtol=0)


def test_log_softmax_topk_ties_and_too_few_tokens(kernels):
    values, ids = kernels.log_softmax_topk(torch.zeros(2, 40), 3, torch.tensor([0]))
    assert ids.tolist() == [[1, 2, 3]] * 2  # equal values: the lower ids first
    torch.testing.assert_close(values, torch.full((2, 3), -math.log(40)), atol=1e-6, rtol=0)
    values, ids = kernels.log_softmax_topk(torch.tensor([[1.0, 2.0, 3.0]]), 2, torch.tensor([0, 2]))
    assert ids[0, 0] == 1 and values[0, 1] == float("-inf")  # one token allowed for k = 2
    with pytest.raises(ValueError, match="contiguous rows"):
        kernels.log_softmax_topk(torch.zeros(4, 10)[:, ::2], 2, torch.tensor([0]))
    with pytest.raises(ValueError, match="k = 11 for 10 tokens"):
        kernels.log_softmax_topk(torch.zeros(4, 10), 11, torch.tensor([0]))


def _log_softmax_topk_matches_pytorch(lib, dtype, threads):
    from aiayn.decode.search import select_topk

    torch.manual_seed(3)
    banned = torch.tensor([0, 2, 3])
    for V, k in ((8000, 4), (1003, 6), (37, 5)):  # V % 16 != 0: the tail after the blocks
        z = (torch.randn(50, V) * 4).to(dtype)
        z[7, 5] = 40.0  # one token far ahead: the other exponentials underflow
        with torch.inference_mode():
            torch.set_num_threads(threads)
            try:
                values, ids = lib.log_softmax_topk(z, k, banned)
            finally:
                torch.set_num_threads(2)
            lp = torch.log_softmax(z.float(), dim=-1)
            ref_values, ref_ids = select_topk(lp.clone(), k, banned)
        torch.testing.assert_close(values, ref_values, atol=2e-6, rtol=1e-6)
        assert not torch.isin(ids, banned).any()
        # the ids are those values' tokens (bfloat16 logits tie often; which of equal tokens comes first may differ)
        torch.testing.assert_close(lp.gather(1, ids), ref_values, atol=2e-6, rtol=1e-6)
        if dtype == torch.float32:
            assert torch.equal(ids, ref_ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_log_softmax_topk_is_pytorchs(kernels, dtype, threads):
    _log_softmax_topk_matches_pytorch(kernels, dtype, threads)


def test_the_portable_build_gives_the_same_numbers(portable):
    # the library without -march=native: attention, log-softmax top-k and int8 passes by the plain loops
    from aiayn.decode.int8 import quantize_rows

    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        q, k, v, anc = _shared_slot_case(H=2, K=16, Dv=16, dtype=dtype)
        torch.testing.assert_close(portable.self_attention(q, k, v, anc, 4).float(),
                                   _shared_slot_reference(q, k, v, anc, 4), atol=tol, rtol=tol)
        _log_softmax_topk_matches_pytorch(portable, dtype, 1)
        x = torch.randn(9, 70).to(dtype)
        assert all(torch.equal(a, b) for a, b in zip(portable.quantize_rows(x), quantize_rows(x)))


# ---- the passes around an int8 product ---------------------------------------------------------------

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


def test_steps_that_the_kernels_do_not_take(kernels, monkeypatch):
    # attention weights asked for, autocast, or a dtype the kernel lacks: PyTorch's attention, same numbers
    from aiayn.decode.adapter import CachedDecoder

    def refuse(*a, **k):
        raise AssertionError("the kernel was called")

    model, src = _tiny_model(), sources()[:2]
    with torch.inference_mode():
        state = CachedDecoder(model, kernels=kernels).start(src, 6).reorder(torch.arange(2).repeat_interleave(4))
        tokens = torch.full((8,), 2)
        reference = model.decode(tokens[:, None], cache=state.cache.unshared()).logits
        monkeypatch.setattr(kernels, "self_attention", refuse)
        monkeypatch.setattr(kernels, "cross_attention", refuse)
        out = model.decode(tokens[:, None], cache=state.cache, need_weights=True)  # as attention plots ask
        assert out.self_weights is not None
        torch.testing.assert_close(out.logits, reference, atol=1e-5, rtol=1e-5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            state64 = CachedDecoder(model, kernels=kernels).start(src, 6).reorder(torch.arange(2).repeat_interleave(4))
            model.decode(tokens[:, None], cache=state64.cache)
        double = _tiny_model(torch.float64)
        state64 = CachedDecoder(double, kernels=kernels).start(src, 6).reorder(torch.arange(2).repeat_interleave(4))
        double.decode(tokens[:, None], cache=state64.cache)


# ---- the label-smoothed loss of training (cross_entropy.c) -------------------------------------------

def _loss_with(kernels, base, target, eps_ls=0.1, pad_id=0, g_loss=0.7, g_nll=-0.3):
    """label_smoothed_loss's sums and the gradient of g_loss * loss + g_nll * nll (both backward terms)."""
    from aiayn.train.objective import label_smoothed_loss

    z = base.clone().requires_grad_(True)
    sums = label_smoothed_loss(z, target, eps_ls, pad_id, kernels)
    (g_loss * sums.loss + g_nll * sums.nll).backward()
    return sums.loss.item(), sums.nll.item(), int(sums.n_tokens), z.grad


def _loss_case(V, dtype, B=5, T=7):
    torch.manual_seed(V)
    target = torch.randint(0, V, (B, T))
    target[0, 3:] = 0  # padding
    target[-1, 2] = 0
    return (3 * torch.randn(B, T, V)).to(dtype), target


def _cross_entropy_matches_pytorch(kernels, dtype, threads=1):
    torch.set_num_threads(threads)
    try:
        for V in (4, 37, 300):  # below one vector of 16, a tail after whole vectors, several vectors
            base, target = _loss_case(V, dtype)
            l1, n1, k1, g1 = _loss_with(kernels, base, target)
            l2, n2, k2, g2 = _loss_with(None, base, target)
            assert k1 == k2
            assert l1 == pytest.approx(l2, rel=1e-5) and n1 == pytest.approx(n2, rel=1e-5)
            assert g1.dtype == dtype
            tol = 1e-6 if dtype == torch.float32 else 4e-3  # bf16: one rounding step of values below 0.5
            torch.testing.assert_close(g1.float(), g2.float(), atol=tol, rtol=1e-5 if dtype == torch.float32 else 8e-3)
            assert torch.all(g1[target == 0] == 0)  # padding positions get no gradient
    finally:
        torch.set_num_threads(2)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_kernel_is_the_pytorch_path(kernels, dtype, threads):
    _cross_entropy_matches_pytorch(kernels, dtype, threads)


def test_cross_entropy_kernel_portable_build(portable):
    for dtype in (torch.float32, torch.bfloat16):
        _cross_entropy_matches_pytorch(portable, dtype)


@pytest.mark.parametrize("V", [4, 20])
def test_hand_computed_cross_entropy_kernel(kernels, V):
    # d loss / d z = p - q on one kept row, target 3, eps 0.1, logits [0, 1, 2, 3] then (V = 20) -30s
    # whose probabilities are below 1e-14: q = [0, 0.05/(V-2) ...]; at V = 4 the existing golden case
    # p = softmax([0, 1, 2, 3]) = [0.0320586, 0.0871443, 0.2368828, 0.6439143], q = [0, .05, .05, .9].
    z = torch.full((1, 1, V), -30.0)
    z[0, 0, :4] = torch.tensor([0.0, 1.0, 2.0, 3.0])
    loss, nll, n, grad = _loss_with(kernels, z, torch.tensor([[3]]), g_loss=1.0, g_nll=0.0)
    eps_o = 0.1 / (V - 2)
    p = torch.tensor([0.0320586, 0.0871443, 0.2368828, 0.6439143])
    want = torch.full((V,), -eps_o)
    want[:4] = p - torch.tensor([0.0, eps_o, eps_o, 0.9])
    torch.testing.assert_close(grad.view(-1), want, atol=1e-6, rtol=0)
    log_z = math.log(sum(math.exp(x) for x in (0, 1, 2, 3)) + (V - 4) * math.exp(-30))
    assert nll == pytest.approx(log_z - 3.0, abs=1e-5)
    # loss = log Z - (1 - eps) z_gold - eps' (sum_z - z_gold - z_pad), pad id 0 (whose logit is 0)
    assert loss == pytest.approx(log_z - 0.9 * 3.0 - eps_o * (6.0 - 30.0 * (V - 4) - 3.0 - 0.0), abs=1e-5)
    assert n == 1


def test_cross_entropy_kernel_rejects_bad_input(kernels):
    z = torch.randn(3, 10)
    row = torch.zeros(3)
    with pytest.raises(ValueError):
        kernels.cross_entropy_backward(z, row, row, row, row, torch.tensor([1, 10, 2]), 0)  # gold id >= V
    with pytest.raises(ValueError):
        kernels.cross_entropy_backward(z, row, row, row, row, torch.tensor([1, 2, 3]), 10)  # pad id >= V
    with pytest.raises(ValueError):
        kernels.cross_entropy_forward(z.double())
    # rows with a stride of their own (a slice of wider logits): read in place
    from aiayn.train.objective import label_smoothed_loss

    base, target = _loss_case(37, torch.float32, B=1)
    grads = []
    for k in (kernels, None):
        wide = torch.cat([base, torch.randn(1, base.size(1), 5)], dim=-1).requires_grad_(True)
        sums = label_smoothed_loss(wide[..., :37], target, 0.1, 0, k)
        sums.loss.backward()
        grads.append((sums.loss.item(), wide.grad))
    assert wide[..., :37].reshape(-1, 37).stride(0) == 42  # the kernel's case: a row stride that is not V
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-6)
    torch.testing.assert_close(grads[0][1], grads[1][1], atol=1e-6, rtol=1e-5)
    assert torch.all(grads[0][1][..., 37:] == 0)


# -- seq_attention.c: the attention of training, forward and backward ---------------------------------------

def _heads_case(B=3, H=2, T=7, S=9, K=32, Dv=32, dtype=torch.float32, masked=True, seed=0):
    """q (B,H,T,K) and k, v (B,H,S,K|Dv) as the model makes them: views of (B, L, H*d) projection outputs
    (k and v slices of one fused tensor), and a key-padding mask (B,1,1,S) with a real key in every row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H * K, generator=g).to(dtype)
    kv = torch.randn(B, S, H * (K + Dv), generator=g).to(dtype)
    q = x.view(B, T, H, K).transpose(1, 2)
    k = kv[..., :H * K].view(B, S, H, K).transpose(1, 2)
    v = kv[..., H * K:].view(B, S, H, Dv).transpose(1, 2)
    lens = torch.randint(1, S + 1, (B,), generator=g)
    lens[0] = S
    mask = (torch.arange(S)[None] < lens[:, None])[:, None, None, :] if masked else None
    return q, k, v, mask


def _seq_attention_matches_eq1(lib, q, k, v, mask, causal, tol, threads=1):
    """Forward and backward of the kernel against attention_explicit's autograd in float32."""
    B, H, T, K = q.shape
    S, Dv = k.size(2), v.size(-1)
    torch.set_num_threads(threads)
    try:
        out, lse = lib.seq_attention_forward(q, k, v, mask, causal)
        g = torch.randn(B, T, H * Dv, generator=torch.Generator().manual_seed(1))
        dq, dk, dv = lib.seq_attention_backward(q, k, v, mask, causal, lse, g.to(q.dtype))
    finally:
        torch.set_num_threads(2)
    qf, kf, vf = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    m = mask
    if causal:
        c = torch.ones(T, S, dtype=torch.bool).tril(S - T)
        m = c if m is None else m & c
    ref, w = attention_explicit(qf, kf, vf, m)
    ref = ref.transpose(1, 2).reshape(B, T, H * Dv)
    (ref * g).sum().backward()
    seen = torch.isfinite(ref).all(-1)  # (B,T): rows with a key to see (others: the kernel's zeros)
    assert out.dtype == q.dtype and out.shape == (B, T, H * Dv)
    torch.testing.assert_close(out.float()[seen], ref[seen], atol=tol, rtol=tol)
    assert (out.float()[~seen] == 0).all()
    for got, want in ((dq, qf.grad), (dk, kf.grad), (dv, vf.grad)):
        assert got.shape == want.shape and got.dtype == q.dtype
        torch.testing.assert_close(got.float(), want.nan_to_num(), atol=tol, rtol=tol)
    scores = (qf @ kf.transpose(-2, -1)).detach() / math.sqrt(K)  # (B,H,T,S)
    if m is not None:
        scores = scores.masked_fill(~m, -math.inf)
    seen_h = seen[:, None, :].expand(B, H, T)
    torch.testing.assert_close(lse[seen_h], torch.logsumexp(scores, dim=-1)[seen_h], atol=1e-4, rtol=1e-4)
    return out, dq, dk, dv


@pytest.mark.parametrize("K,Dv", [(32, 32), (64, 64), (16, 24)])  # the AVX-512 path's two and the plain loops
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("causal,masked", [(False, False), (False, True), (True, False), (True, True)])
def test_seq_attention_is_eq1(kernels, K, Dv, dtype, tol, causal, masked):
    T = 9 if causal else 7  # causal: the decoder's self-attention, T = S
    _seq_attention_matches_eq1(kernels, *_heads_case(T=T, K=K, Dv=Dv, dtype=dtype, masked=masked), causal, tol)


def test_seq_attention_long_rows_and_bottom_right_causal(kernels):
    # more than four query blocks and several 16-key chunks with a tail; a causal T < S (a chunk of queries
    # after cached keys: query i sees keys j <= i + S - T) where PyTorch's masks are bottom-right aligned
    _seq_attention_matches_eq1(kernels, *_heads_case(B=2, T=37, S=45, K=32, Dv=32), False, 1e-4)
    _seq_attention_matches_eq1(kernels, *_heads_case(B=2, T=5, S=21, K=32, Dv=32, masked=False), True, 1e-4)
    _seq_attention_matches_eq1(kernels, *_heads_case(B=2, T=5, S=21, K=16, Dv=8, masked=False), True, 1e-4)


@pytest.mark.parametrize("K", [32, 16])
def test_seq_attention_two_threads_are_one(kernels, K):
    case = _heads_case(B=5, H=3, T=11, S=11, K=K, Dv=K, dtype=torch.bfloat16)
    one = _seq_attention_matches_eq1(kernels, *case, True, 2e-2, threads=1)
    two = _seq_attention_matches_eq1(kernels, *case, True, 2e-2, threads=2)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_seq_attention_portable_build(portable):
    assert not portable.seq_attention_fast(32, 32)  # no AVX-512 path there; the plain loops, the same numbers
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        for causal in (False, True):
            _seq_attention_matches_eq1(portable, *_heads_case(T=9, S=9, dtype=dtype), causal, tol)


def test_hand_computed_seq_attention(kernels):
    # one head, d_k = 32, one query q = e_0 * sqrt(32), keys k_0 = 0 and k_1 = ln(3) e_0: scores 0 and
    # ln 3, weights 1/4 and 3/4; values 4 and 8 in every column: out = 1 + 6 = 7. With dout = 1 in
    # every column: dv_j = p_j dout = 1/4, 3/4; dp_j = dout . v_j = 128, 256, D = 32 + 192 = 224,
    # ds = p (dp - D) = -24, 24; dq = ds_1 k_1 / sqrt(32) = 24 ln 3 / sqrt(32) at column 0; dk_j = ds_j q / sqrt(32)
    # = -24, 24 at column 0. A third key, masked, changes nothing.
    K = 32
    q = torch.zeros(1, 1, 1, K)
    q[..., 0] = math.sqrt(K)
    k = torch.zeros(1, 1, 3, K)
    k[0, 0, 1, 0] = math.log(3.0)
    k[0, 0, 2, 0] = 100.0
    v = torch.tensor([4.0, 8.0, -50.0]).view(1, 1, 3, 1).expand(1, 1, 3, K).contiguous()
    mask = torch.tensor([True, True, False]).view(1, 1, 1, 3)
    out, lse = kernels.seq_attention_forward(q, k, v, mask, False)
    torch.testing.assert_close(out, torch.full((1, 1, K), 7.0))
    assert lse.item() == pytest.approx(math.log(4.0), abs=1e-6)  # log(e^0 + e^ln3)
    dq, dk, dv = kernels.seq_attention_backward(q, k, v, mask, False, lse, torch.ones(1, 1, K))
    want_dq = torch.zeros(K)
    want_dq[0] = 24 * math.log(3.0) / math.sqrt(K)
    torch.testing.assert_close(dq.reshape(K), want_dq, atol=1e-4, rtol=1e-5)
    want_dk = torch.zeros(3, K)
    want_dk[0, 0], want_dk[1, 0] = -24.0, 24.0
    torch.testing.assert_close(dk.reshape(3, K), want_dk, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(dv.reshape(3, K)[:, 0], torch.tensor([0.25, 0.75, 0.0]))


def test_seq_attention_rejects_bad_input(kernels):
    q, k, v, mask = _heads_case()
    with pytest.raises(ValueError):
        kernels.seq_attention_forward(q.contiguous(), k, v, mask, False)  # heads not adjacent in a row
    with pytest.raises(ValueError):
        kernels.seq_attention_forward(q.double(), k.double(), v.double(), mask, False)
    with pytest.raises(ValueError):
        kernels.seq_attention_forward(q, k, v, mask[..., :3], False)  # mask of another length
    out, lse = kernels.seq_attention_forward(q, k, v, mask, False)
    with pytest.raises(ValueError):
        kernels.seq_attention_backward(q, k, v, mask, False, lse[:, :1], torch.zeros_like(out))


def _counting_build(monkeypatch, good: bytes) -> list:
    """``_compile`` replaced by a copy of an already built library (no compiler run); the paths
    it was asked to build (in the build's private temporary directory), in order."""
    built = []

    def compile_(cc, out, archs=None):
        built.append(out)
        out.write_bytes(good)
    monkeypatch.setattr(kernel_mod, "_compile", compile_)
    return built


def test_a_damaged_cached_library_is_built_again(kernels, monkeypatch, tmp_path):
    good = kernels.path.read_bytes()
    built = _counting_build(monkeypatch, good)
    try:
        monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path / "a"))
        kernel_mod.load.cache_clear()
        assert kernel_mod.load() is not None and len(built) == 1
        kernel_mod.load.cache_clear()
        assert kernel_mod.load() is not None and len(built) == 1  # intact: reused
        # another cache holding that library cut short (a full disk, a damaged file), with its checksum
        damaged = tmp_path / "b" / built[0].name
        damaged.parent.mkdir(mode=0o700)
        damaged.write_bytes(good[:4096])
        for p in tmp_path.glob("a/*.sha256"):
            (damaged.parent / p.name).write_bytes(p.read_bytes())
        monkeypatch.setenv("AIAYN_CACHE_DIR", str(damaged.parent))
        kernel_mod.load.cache_clear()
        k = kernel_mod.load()
        assert k is not None and len(built) == 2 and k.path == damaged and damaged.read_bytes() == good
    finally:
        kernel_mod.load.cache_clear()


def test_a_cached_library_others_could_write_is_not_loaded(kernels, monkeypatch, tmp_path):
    built = _counting_build(monkeypatch, kernels.path.read_bytes())
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path))
    try:
        kernel_mod.load.cache_clear()
        assert kernel_mod.load() is not None
        (tmp_path / built[0].name).chmod(0o666)  # anyone could have replaced it since
        kernel_mod.load.cache_clear()
        k = kernel_mod.load()
        assert k is not None and len(built) == 2 and k.path.stat().st_mode & 0o022 == 0
        tmp_path.chmod(0o777)  # a cache directory shared between users: each gets a private folder in it
        kernel_mod.load.cache_clear()
        k = kernel_mod.load()
        assert k is not None and len(built) == 3
        assert k.path.parent == tmp_path / f"user-{os.getuid()}" and k.path.parent.stat().st_mode & 0o777 == 0o700
    finally:
        kernel_mod.load.cache_clear()
