"""The search over a real tiny Transformer (float64): cache vs recomputation, batch independence."""
from __future__ import annotations

import pytest
import torch

import aiayn.model as M
from aiayn.decode.adapter import CachedDecoder, RecomputeDecoder
from aiayn.decode.config import DecodeConfig
from aiayn.decode.search import SpecialIds, search

V = 24


@pytest.fixture
def model():
    torch.manual_seed(0)
    # with this seed, hypotheses end at various steps (by EOS or at their maximum length)
    return M.Transformer(M.get_preset("tiny", vocab_size=V, p_drop=0.0)).double().eval()


def sources() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    lengths = [7, 3, 5, 1, 6]
    src = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for b, n in enumerate(lengths):
        src[b, :n - 1] = torch.randint(4, V, (n - 1,), generator=g)
        src[b, n - 1] = 3  # EOS ends every source, as aiayn.data.batching.collate does
    return src


def test_cache_reorder_equals_recomputing_the_reordered_prefixes(model):
    src = sources()[:2]
    g = torch.Generator().manual_seed(2)
    cached, plain = CachedDecoder(model), RecomputeDecoder(model)
    with torch.inference_mode():
        states = [cached.start(src, 9), plain.start(src, 9)]
        expand = torch.tensor([0, 0, 0, 1, 1, 1])
        states = [s.reorder(expand) for s in states]
        tokens = torch.full((6,), 2)
        for step in range(7):
            (lp_c, states[0]), (lp_p, states[1]) = cached.step(tokens, states[0]), plain.step(tokens, states[1])
            assert lp_c.shape == (tokens.numel(), V)
            assert torch.allclose(lp_c, lp_p, atol=1e-10), step
            n = tokens.numel()
            idx = {1: torch.randint(0, n, (n - 1,), generator=g),  # repeats and dropped rows
                   2: torch.arange(n).flip(0),  # same number of rows, other sentences
                   3: torch.tensor([0, 0, 1, 3, 3][:n]),  # within the first sentence
                   4: torch.tensor([0, 0, 2, 3, 4][:n]),  # one row moves: the in-place path
                   5: torch.arange(n)}.get(step)  # nothing moves
            if idx is not None:
                buf = states[0].cache.layers[0].self_k
                states = [s.reorder(idx) for s in states]
                if step in (4, 5):  # few rows moved: copied in place, the buffers stay
                    assert states[0].cache.layers[0].self_k is buf
            tokens = torch.randint(4, V, (states[1].prefix.size(0),), generator=g)


@pytest.mark.parametrize("cfg", [DecodeConfig(beam_size=4, nbest=2, max_len_b=6),
                                 DecodeConfig(beam_size=1, max_len_b=6)])
def test_cached_and_recomputed_search_agree(model, cfg):
    src = sources()
    a = search(CachedDecoder(model), src, cfg, SpecialIds())
    b = search(RecomputeDecoder(model), src, cfg, SpecialIds())
    assert [[h.tokens for h in hs] for hs in a] == [[h.tokens for h in hs] for hs in b]
    assert [h.score for hs in a for h in hs] == pytest.approx([h.score for hs in b for h in hs], rel=1e-9)


@pytest.mark.parametrize("cfg", [DecodeConfig(beam_size=4, nbest=4, max_len_b=6),
                                 DecodeConfig(beam_size=3, alpha=0.0, max_len_a=2.0, max_len_b=2),
                                 DecodeConfig(beam_size=1, max_len_b=6)])
def test_each_sentence_alone_equals_inside_the_batch(model, cfg):
    src = sources()
    together = search(CachedDecoder(model), src, cfg, SpecialIds())
    lengths = {(len(hs[0].tokens), hs[0].eos) for hs in together}
    assert len(lengths) > 2  # the batch really mixes hypotheses that end at different steps
    for b in range(src.size(0)):
        n = int((src[b] != 0).sum())
        alone = search(CachedDecoder(model), src[b:b + 1, :n], cfg, SpecialIds())[0]
        assert [h.tokens for h in alone] == [h.tokens for h in together[b]]
        assert [h.score for h in alone] == pytest.approx([h.score for h in together[b]], rel=1e-9, abs=1e-12)


def test_beams_of_a_sentence_share_its_encoder_rows(model):
    # Expanding B sentences to B*K rows groups them: cross keys/values stay at B rows, and
    # the grouped cross-attention gives the same log-probs and weights as the ungrouped cache.
    src = sources()[:3]
    K = 4
    dec = CachedDecoder(model)
    with torch.inference_mode():
        state = dec.start(src, 5).reorder(torch.arange(3).repeat_interleave(K))
        assert state.cache.group == K and state.cache.layers[0].cross_k.size(0) == 3
        plain = model.init_cache(model.encode(src), 5).reorder(torch.arange(3).repeat_interleave(K))
        assert plain.group == 1 and plain.layers[0].cross_k.size(0) == 3 * K
        tokens = torch.randint(4, V, (3 * K,), generator=torch.Generator().manual_seed(3))
        a = model.decode(tokens[:, None], cache=state.cache, need_weights=True)
        b = model.decode(tokens[:, None], cache=plain, need_weights=True)
    assert torch.allclose(a.logits, b.logits, atol=1e-12)
    for wa, wb in zip(a.cross_weights, b.cross_weights):
        assert torch.allclose(wa, wb, atol=1e-12)
