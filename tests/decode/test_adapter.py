"""The search over a real tiny Transformer (float64): cache vs recomputation, batch independence."""
from __future__ import annotations

import pytest
import torch

import aiayn.model as M
from aiayn.decode.adapter import CachedDecoder, RecomputeDecoder
from aiayn.decode.cache import init_cache
from aiayn.decode.config import DecodeConfig
from aiayn.decode.search import SpecialIds, search
from tests.arith import within
from tests.rounding import logit_bounds, same_float_search, step_bound

V = 24


def tiny_model() -> M.Transformer:
    """The tiny preset in float64, seed 0: with this seed, hypotheses end at various steps (by EOS or at
    their maximum length)."""
    torch.manual_seed(0)
    return M.Transformer(M.get_preset("tiny", vocab_size=V, p_drop=0.0)).double().eval()


def tiny_float_model(attn_bias: bool = False) -> M.Transformer:
    """The tiny preset in float32, seed 0: the paper's attention projections (§3.2.2), or with biases,
    drawn not zero (the fast paths' tests run both)."""
    torch.manual_seed(0)
    model = M.Transformer(M.get_preset("tiny", vocab_size=V, p_drop=0.0, attn_bias=attn_bias)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0.0, 0.1)
    return model


@pytest.fixture
def model():
    return tiny_model()


def sources() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    lengths = [7, 3, 5, 1, 6]
    src = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for b, n in enumerate(lengths):
        src[b, :n - 1] = torch.randint(4, V, (n - 1,), generator=g)
        src[b, n - 1] = 3  # EOS ends every source, as aiayn.data.batching.collate does
    return src


@pytest.mark.parametrize("share", [False, True])
def test_cache_reorder_equals_recomputing_the_reordered_prefixes(model, share):
    # with shared slots, step 1 (rows of no fixed group) falls back to the plain layout
    src = sources()[:2]
    g = torch.Generator().manual_seed(2)
    cached, plain = CachedDecoder(model, share_slots=share), RecomputeDecoder(model)
    with torch.inference_mode():
        states = [cached.start(src, 9), plain.start(src, 9)]
        expand = torch.tensor([0, 0, 0, 1, 1, 1])
        states = [s.reorder(expand) for s in states]
        sentence = expand  # each row's sentence
        tokens = torch.full((6,), 2)
        for step in range(7):
            (lp_c, states[0]), (lp_p, states[1]) = cached.step(tokens, states[0]), plain.step(tokens, states[1])
            assert lp_c.shape == (tokens.numel(), V)
            # both within float64's roundings of the exact step (tests/rounding.py), so within twice that
            within(lp_c, lp_p, 2 * step_bound(model, "fp64", src, states[1].prefix, sentence))
            n = tokens.numel()
            idx = {1: torch.randint(0, n, (n - 1,), generator=g),  # repeats and dropped rows
                   2: torch.arange(n).flip(0),  # same number of rows, other sentences
                   3: torch.tensor([0, 0, 1, 3, 3][:n]),  # within the first sentence
                   4: torch.tensor([0, 0, 2, 3, 4][:n]),  # one row moves: the in-place path
                   5: torch.arange(n)}.get(step)  # nothing moves
            if idx is not None:
                buf = states[0].cache.layers[0].self_k
                states = [s.reorder(idx) for s in states]
                sentence = sentence[idx]
                if step in (4, 5):  # few rows moved: copied in place, the buffers stay
                    assert states[0].cache.layers[0].self_k is buf
            tokens = torch.randint(4, V, (states[1].prefix.size(0),), generator=g)


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("cfg", [DecodeConfig(beam_size=4, nbest=2, max_len_b=6),
                                 DecodeConfig(beam_size=1, max_len_b=6)])
def test_cached_and_recomputed_search_agree(model, cfg, share):
    src = sources()
    a = search(CachedDecoder(model, share_slots=share), src, cfg, SpecialIds())
    b = search(RecomputeDecoder(model), src, cfg, SpecialIds())
    same_float_search(model, src, a, b, cfg, SpecialIds(), "fp64")  # up to float64's roundings, derived


@pytest.mark.parametrize("cfg", [DecodeConfig(beam_size=4, nbest=4, max_len_b=6),
                                 DecodeConfig(beam_size=3, alpha=0.0, max_len_a=2.0, max_len_b=2),
                                 DecodeConfig(beam_size=1, max_len_b=6)])
@pytest.mark.parametrize("share", [False, True])
def test_each_sentence_alone_equals_inside_the_batch(model, cfg, share):
    src = sources()
    together = search(CachedDecoder(model, share_slots=share), src, cfg, SpecialIds())
    lengths = {(len(hs[0].tokens), hs[0].eos) for hs in together}
    assert len(lengths) > 2  # the batch really mixes hypotheses that end at different steps
    for b in range(src.size(0)):
        n = int((src[b] != 0).sum())
        alone = search(CachedDecoder(model, share_slots=share), src[b:b + 1, :n], cfg, SpecialIds())[0]
        same_float_search(model, src[b:b + 1], [alone], [together[b]], cfg, SpecialIds(), "fp64")


def test_beams_of_a_sentence_share_its_encoder_rows(model):
    # Expanding B sentences to B*K rows groups them: cross keys/values stay at B rows, and
    # the grouped cross-attention gives the same log-probs and weights as the ungrouped cache.
    src = sources()[:3]
    K = 4
    dec = CachedDecoder(model, share_slots=False)
    with torch.inference_mode():
        state = dec.start(src, 5).reorder(torch.arange(3).repeat_interleave(K))
        assert state.cache.group == K and state.cache.layers[0].cross_k.size(0) == 3
        plain = init_cache(model, model.encode(src), 5).reorder(torch.arange(3).repeat_interleave(K))
        assert plain.group == 1 and plain.layers[0].cross_k.size(0) == 3 * K
        tokens = torch.randint(4, V, (3 * K,), generator=torch.Generator().manual_seed(3))
        a = model.decode(tokens[:, None], cache=state.cache, need_weights=True)
        b = model.decode(tokens[:, None], cache=plain, need_weights=True)
    # each row's logits within float64's roundings of the exact ones (tests/rounding.py), so within twice
    bound = logit_bounds(model, "fp64", src.repeat_interleave(K, 0), tokens[:, None].clone())  # (3K,1,V)
    within(a.logits, b.logits, 2 * bound)
    for wa, wb in zip(a.cross_weights, b.cross_weights):
        assert torch.allclose(wa, wb, atol=1e-12)


def test_shared_slots_move_no_keys_and_equal_recomputation(model):
    # Beam search's reorders on a cache with shared slots: within sentences only the ancestor
    # table changes (the buffers stay); a dropped sentence leaves the buffers. Log-probs,
    # self-attention weights and the materialized per-row keys match the plain paths.
    src, K = sources()[:3], 3
    g = torch.Generator().manual_seed(4)
    shared, copied, plain = CachedDecoder(model), CachedDecoder(model, share_slots=False), RecomputeDecoder(model)
    with torch.inference_mode():
        expand = torch.arange(3).repeat_interleave(K)
        states = [d.start(src, 4).reorder(expand) for d in (shared, copied, plain)]  # capacity 4: grows
        assert states[0].cache.shared_slots and not states[1].cache.shared_slots
        tokens = torch.full((9,), 2)
        reorders = {1: torch.tensor([2, 2, 0, 3, 5, 4, 6, 6, 6]),  # within sentences, repeats
                    2: torch.tensor([1, 0, 0, 8, 7, 6]),  # sentence 1 leaves, the others reorder
                    3: torch.tensor([0, 1, 2, 3, 4, 5]),  # nothing moves
                    4: torch.tensor([5, 5, 3]),  # sentence 0 leaves
                    5: torch.tensor([2, 2, 2])}
        sentence = expand  # each row's sentence
        for step in range(7):
            out = model.decode(tokens[:, None], cache=states[0].cache, need_weights=True)
            ref = model.decode(tokens[:, None], cache=states[1].cache, need_weights=True)
            lp_p, states[2] = plain.step(tokens, states[2])
            states[0] = type(states[0])(out.cache, states[0].sentence, None, True)
            states[1] = type(states[1])(ref.cache, states[1].sentence, states[1].spare, False)
            # each row's step within float64's roundings of the exact one (tests/rounding.py): the three
            # paths within twice that of each other
            bound = step_bound(model, "fp64", src, states[2].prefix, sentence)
            within(out.logits[:, -1].log_softmax(-1), lp_p, 2 * bound)
            within(out.logits[:, -1].log_softmax(-1), ref.logits[:, -1].log_softmax(-1), 2 * bound)
            for wa, wb in zip(out.self_weights, ref.self_weights):
                assert torch.allclose(wa, wb, atol=1e-12), step
            unshared = states[0].cache.unshared()
            L = unshared.length
            for la, lb in zip(unshared.layers, states[1].cache.layers):
                assert torch.allclose(la.self_k[:, :, :L], lb.self_k[:, :, :L], atol=1e-12), step
                assert torch.allclose(la.self_v[:, :, :L], lb.self_v[:, :, :L], atol=1e-12), step
            idx = reorders.get(step)
            if idx is not None:
                buf = states[0].cache.layers[0].self_k
                states = [s.reorder(idx) for s in states]
                sentence = sentence[idx]
                assert states[0].cache.shared_slots
                assert (states[0].cache.layers[0].self_k is buf) == (step in (1, 3, 5))  # no copy within sentences
            tokens = torch.randint(4, V, (states[2].prefix.size(0),), generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_softmax_in_place_equals_the_out_of_place_call(dtype):
    from aiayn.decode.adapter import log_softmax_rows
    g = torch.Generator().manual_seed(3)
    for shape in [(1, 7), (5, 300), (256, 8000)]:
        logits = (torch.randn(shape, generator=g) * 6).to(dtype)
        logits[0, :3] = float("-inf")  # masked entries stay -inf
        expected = logits.log_softmax(dim=-1, dtype=torch.float32)
        got = log_softmax_rows(logits.clone())
        assert got.dtype == torch.float32
        assert torch.equal(got, expected)
    view = torch.randn(4, 3, 50, generator=g)[:, -1]  # not contiguous: computed out of place
    before = view.clone()
    assert torch.equal(log_softmax_rows(view), before.log_softmax(dim=-1)) and torch.equal(view, before)


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("cfg", [DecodeConfig(beam_size=4, nbest=2, max_len_b=40),
                                 DecodeConfig(beam_size=1, max_len_b=40)])
def test_a_cache_that_grows_decodes_as_one_made_whole(model, cfg, share, monkeypatch):
    """The cache starts at ``first_capacity`` positions, not max_len (which may be a model's every
    position), and doubles as the outputs grow: from 1 position, or from max_len, the same search."""
    import aiayn.decode.cache as cache_module
    from aiayn.decode.cache import first_capacity
    assert first_capacity(1024, 7) == 30 and first_capacity(9, 7) == 9
    src = sources()
    out = {}
    for name, first in (("grows", lambda max_len, S: 1), ("whole", lambda max_len, S: max_len)):
        monkeypatch.setattr(cache_module, "first_capacity", first)
        out[name] = search(CachedDecoder(model, share_slots=share), src, cfg, SpecialIds())
    assert max(len(hs[0].tokens) for hs in out["whole"]) > 8  # several doublings from 1
    # (the buffers' strides differ, so a product may round otherwise: up to float64's roundings, derived)
    same_float_search(model, src, out["grows"], out["whole"], cfg, SpecialIds(), "fp64")
