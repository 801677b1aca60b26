"""The decoder step over fixed buffers (``GraphDecoder``, replayed as a CUDA graph on a GPU) against the
cached step (``CachedDecoder``): the same searches on the CPU, where the step runs without a graph.

Tolerances from the arithmetic: the fixed step attends over every slot of the bucket (masked slots
weigh exactly 0), so only the order of the sums changes. A search's scores, samples' too, are held
to both paths' roundings (``same_float_search``, tests/rounding.py: float64 or float32, as the model;
an ensemble's by its members')."""
from __future__ import annotations

import pytest
import torch

import aiayn.model as M
from aiayn.decode.adapter import CachedDecoder, EnsembleDecoder
from aiayn.decode.config import DecodeConfig
from aiayn.decode.graphs import GraphDecoder, Shape
from aiayn.decode.search import SpecialIds, search

from tests.decode.test_adapter import V, sources, tiny_model
from tests.rounding import same_float_search



@pytest.fixture
def model():
    return tiny_model()


def same_search(a, b, model, src, cfg):
    """The same hypotheses, scores within both searches' roundings (tests/rounding.py)."""
    fmt = "fp64" if next(model.parameters()).dtype == torch.float64 else "fp32"
    same_float_search(model, src, a, b, cfg, SpecialIds(), fmt)


@pytest.mark.parametrize("cfg", [DecodeConfig(beam_size=4, nbest=2, max_len_b=6),
                                 DecodeConfig(beam_size=3, nbest=3, alpha=0.0, max_len_a=2.0, max_len_b=2),
                                 DecodeConfig(beam_size=4, no_repeat_ngram=3, max_len_b=6),
                                 DecodeConfig(beam_size=1, max_len_b=6)])
def test_fixed_buffers_search_as_the_cache(model, cfg):
    src = sources()
    cached = search(CachedDecoder(model), src, cfg, SpecialIds())
    lengths = {(len(hs[0].tokens), hs[0].eos) for hs in cached}
    assert len(lengths) > 2  # sentences leave the search at different steps: their rows stay in the buffers
    same_search(search(GraphDecoder(model), src, cfg, SpecialIds()), cached, model, src, cfg)


@pytest.mark.parametrize("beam", [4, 1])
def test_forced_prefixes_as_the_cache(model, beam):
    from aiayn.decode.search import Constraints
    prefix = torch.tensor([[5, 6, -1], [7, -1, -1], [-1, -1, -1], [8, 9, 10], [11, -1, -1]])
    cfg, src = DecodeConfig(beam_size=beam, nbest=beam, max_len_b=6), sources()
    same_search(search(GraphDecoder(model), src, cfg, SpecialIds(), Constraints(prefix=prefix)),
                search(CachedDecoder(model), src, cfg, SpecialIds(), Constraints(prefix=prefix)), model, src, cfg)


def test_samples_as_the_cache(model):
    # float64 probabilities that differ in their last bits: a draw could only differ where a uniform
    # number falls within about 1e-15 of a boundary of the cumulative sums
    cfg, src = DecodeConfig(sampling=True, nbest=3, top_k=5, max_len_b=6, seed=3), sources()
    same_search(search(GraphDecoder(model), src, cfg, SpecialIds()), search(CachedDecoder(model), src, cfg, SpecialIds()),
                model, src, cfg)  # a sample's score is its tokens' log-probabilities: score_bound's


def test_one_bucket_serves_batches_of_similar_shape(model):
    # 5 and then 3 sentences, sources of 7 and 5, outputs under 32: the same bucket, its buffers cleared
    # for each batch (the second batch's rows must not see the first's keys)
    dec, cfg, src = GraphDecoder(model), DecodeConfig(beam_size=4, nbest=2, max_len_b=6), sources()
    first = search(dec, src, cfg, SpecialIds())
    second = search(dec, src[1:4, :5], cfg, SpecialIds())
    assert list(dec._buckets) == [Shape(8, 4, 32, 16)]
    same_search(first, search(CachedDecoder(model), src, cfg, SpecialIds()), model, src, cfg)
    same_search(second, search(CachedDecoder(model), src[1:4, :5], cfg, SpecialIds()), model, src[1:4, :5], cfg)


def test_a_batch_reads_nothing_an_earlier_one_left(model):
    # masked slots weigh 0, but 0 x NaN is NaN: a new batch clears what a diverged one could leave,
    # and the padding sentences that fill a bucket compute finite rows (one source key each)
    dec, cfg, src = GraphDecoder(model), DecodeConfig(beam_size=4, nbest=2, max_len_b=6), sources()
    search(dec, src, cfg, SpecialIds())
    bucket = next(iter(dec._buckets.values()))
    with torch.inference_mode():
        for buf in (*bucket.self_kv[0], *bucket.cross_kv[0]):
            buf.fill_(float("nan"))
    same_search(search(dec, src[1:4, :5], cfg, SpecialIds()), search(CachedDecoder(model), src[1:4, :5], cfg, SpecialIds()),
                model, src[1:4, :5], cfg)
    with torch.inference_mode():
        assert torch.isfinite(bucket._step()[0]).all()  # 3 sentences and 5 padding ones, every row
    # (PyTorch's CPU attention gives a row with every key masked zeros; other kernels may give NaN)
    assert not bucket.src_pad.all(dim=1).any()


def test_ensemble_of_fixed_steps_as_the_cached_ensemble(model):
    torch.manual_seed(1)
    other = M.Transformer(M.get_preset("tiny", vocab_size=V, p_drop=0.0)).double().eval()
    cfg, src = DecodeConfig(beam_size=4, nbest=2, max_len_b=6), sources()
    graphs = search(EnsembleDecoder([GraphDecoder(model), GraphDecoder(other)]), src, cfg, SpecialIds())
    cached = search(EnsembleDecoder([CachedDecoder(model), CachedDecoder(other)]), src, cfg, SpecialIds())
    same_float_search([model, other], src, graphs, cached, cfg, SpecialIds(), "fp64")  # float64's roundings


def test_float32_confident_search_as_the_cache(confident_model):
    model, src = confident_model
    cfg = DecodeConfig(beam_size=4, nbest=2)
    same_search(search(GraphDecoder(model), src, cfg, SpecialIds()),
                search(CachedDecoder(model), src, cfg, SpecialIds()), model, src, cfg)


def test_buckets_round_up_and_the_oldest_goes(model, monkeypatch):
    import aiayn.decode.graphs as graphs
    assert Shape.of(5, 4, 33, 7) == Shape(8, 4, 64, 16)
    monkeypatch.setattr(graphs, "KEPT_GRAPHS", 2)
    dec, cfg, src = GraphDecoder(model), DecodeConfig(beam_size=2, max_len_b=6), sources()
    for B in (3, 9, 17):  # three shapes: 8, 16 and 24 sentences
        search(dec, src.repeat(4, 1)[:B], cfg, SpecialIds())
    assert [s.sentences for s in dec._buckets] == [16, 24]
    monkeypatch.setattr(graphs, "KEPT_GRAPHS", 8)
    monkeypatch.setattr(graphs, "KEPT_BYTES", dec._buckets[Shape(24, 2, 32, 16)].nbytes)  # room for the 24's alone
    search(dec, src.repeat(4, 1)[:3], cfg, SpecialIds())  # 8 sentences: the 16 go (over the bytes, the older)
    assert [s.sentences for s in dec._buckets] == [24, 8]


def test_a_state_moves_only_as_beams_move(model):
    dec = GraphDecoder(model)
    with torch.inference_mode():
        state = dec.start(sources()[:2], 6).reorder(torch.tensor([0, 0, 1, 1]))
        dec.step(torch.full((4,), 2), state)
        with pytest.raises(ValueError, match="reorders only"):
            state.reorder(torch.tensor([1, 0, 3, 2]))


def test_translator_replays_graphs_on_cuda_only(untrained_checkpoint, monkeypatch):
    from aiayn.cli import build_parser
    from aiayn.commands.decode_settings import decode_config
    from aiayn.decode.translator import Translator
    args = build_parser().parse_args(["translate", "--checkpoint", str(untrained_checkpoint), "--cuda-graphs"])
    cfg = decode_config(args, [str(untrained_checkpoint)])
    assert cfg.cuda_graphs
    assert isinstance(Translator.from_checkpoint(untrained_checkpoint, cfg).decoder, CachedDecoder)  # the CPU's
    monkeypatch.setattr("aiayn.decode.translator.replays_graphs", lambda device: True)  # the device's answer
    tr = Translator.from_checkpoint(untrained_checkpoint, cfg)
    assert isinstance(tr.decoder, GraphDecoder)
    assert not isinstance(Translator.from_checkpoint(untrained_checkpoint, DecodeConfig()).decoder, GraphDecoder)
