"""Search against hand-written probability tables (stub decoder) and a plain reference."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from aiayn.config import ConfigError
from aiayn.decode.config import DecodeConfig
from aiayn.decode.search import (Constraints, SpecialIds, filter_logits, length_penalty, max_output_lengths,
                                 search, topk_rows)
from tests.decode.stub import BOS, EOS, PAD, TableDecoder, table_value
from tests.arith import gamma

A, B, C = 4, 5, 6
IDS = SpecialIds(pad=PAD, bos=BOS, eos=EOS)
ROOT = Path(__file__).resolve().parents[2]


def src_of(key: int, n_tokens: int) -> torch.Tensor:
    """A (1, S) source whose first token selects the table and with n_tokens non-pad tokens."""
    return torch.tensor([[key] + [7] * (n_tokens - 1)])


def lp(n: int, alpha: float) -> float:
    return ((5 + n) / 6) ** alpha


def test_length_penalty_golden():
    assert length_penalty(1.0, 0.6) == pytest.approx(1.0)
    assert length_penalty(7.0, 0.6) == pytest.approx(2 ** 0.6)  # (12/6)^0.6
    assert length_penalty(30.0, 0.0) == 1.0


def test_max_output_lengths_counts_non_pad_source_tokens():
    src = torch.tensor([[5, 6, 7, 3], [5, 3, 0, 0]])
    assert max_output_lengths(src, DecodeConfig(), PAD).tolist() == [54, 52]
    cfg = DecodeConfig(max_len_a=1.5, max_len_b=1)
    assert max_output_lengths(src, cfg, PAD).tolist() == [7, 4]
    assert max_output_lengths(src, DecodeConfig(), PAD, cap=53).tolist() == [53, 52]


def test_fairseqs_maximum_length_maps_as_the_migration_page_says():
    """docs/migrating.md's (a, b) of fairseq-generate as ours. fairseq's rule, transcribed from its
    SequenceGenerator: max_len = int(a * src_len + b), src_len the batch's source width, the source's
    EOS included (its Dictionary.encode_line appends it); steps 0 .. max_len, the last EOS only: at
    most max_len + 1 tokens, EOS included. A one-sentence batch of n tokens gives our |x| = n."""
    row = next(line for line in (ROOT / "docs" / "migrating.md").read_text(encoding="utf-8").splitlines()
               if line.startswith("| `--max-len-a a --max-len-b b`"))
    ours = re.search(r"their \(a, b\) is our \(a, ([^)]+)\)", row).group(1)
    for a, b, n in [(0.0, 200, 9), (1.0, 50, 9), (1.2, 10, 4), (1.5, 3, 7), (0.7, 0, 12)]:
        fairseq_tokens = int(a * n + b) + 1
        cfg = DecodeConfig(max_len_a=a, max_len_b=eval(ours, {"a": a, "b": b}))  # the page's expression
        assert max_output_lengths(torch.tensor([[5] * n]), cfg, PAD).item() == fairseq_tokens, (a, b, n)


# The table of the length-penalty example. Complete hypotheses and their log-probs:
#   [A EOS] ln .3   (|Y| = 2)     [B C EOS] ln .27 (|Y| = 3)     [A C EOS] ln .2    [EOS] ln .2
LP_TABLE = {1: {
    (): {A: 0.5, B: 0.3, EOS: 0.2},
    (A,): {EOS: 0.6, C: 0.4},
    (B,): {C: 0.9, EOS: 0.1},
    (A, C): {EOS: 1.0},
    (B, C): {EOS: 1.0},
}}


def test_length_penalty_changes_the_winner():
    # alpha 0.6: ln .3 / lp(2) = -1.0976 beats ln .27 / lp(3) = -1.1017
    hyps = search(TableDecoder(LP_TABLE), src_of(1, 3), DecodeConfig(beam_size=2, alpha=0.6, nbest=2), IDS)[0]
    assert [h.tokens for h in hyps] == [(A,), (B, C)]
    assert table_value(hyps[0].score, math.log(0.3) / lp(2, 0.6), hyps[0].length)
    assert table_value(hyps[1].score, math.log(0.27) / lp(3, 0.6), hyps[1].length)
    assert table_value(hyps[0].log_prob, math.log(0.3), hyps[0].length)
    assert (hyps[0].length, hyps[0].eos) == (2, True)
    # alpha 1.0: ln .27 / (8/6) = -0.982 beats ln .3 / (7/6) = -1.032
    hyps = search(TableDecoder(LP_TABLE), src_of(1, 3), DecodeConfig(beam_size=2, alpha=1.0, nbest=2), IDS)[0]
    assert [h.tokens for h in hyps] == [(B, C), (A,)]
    assert table_value(hyps[0].score, math.log(0.27) / lp(3, 1.0), hyps[0].length)
    # alpha 0: raw log-probs, [A EOS] wins
    hyps = search(TableDecoder(LP_TABLE), src_of(1, 3), DecodeConfig(beam_size=2, alpha=0.0), IDS)[0]
    assert [h.tokens for h in hyps] == [(A,)] and table_value(hyps[0].score, math.log(0.3), hyps[0].length)


def test_power_length_norm_is_transformers_length_penalty():
    # length_norm power divides by |Y|^α (transformers' length_penalty = α): at α 0.6 the longer
    # [B C EOS] wins, ln .27 / 3^0.6 = -0.677 against ln .3 / 2^0.6 = -0.794, where GNMT's picks [A EOS]
    assert length_penalty(3.0, 0.6, "power") == pytest.approx(3 ** 0.6)
    cfg = DecodeConfig(beam_size=2, alpha=0.6, nbest=2, length_norm="power")
    hyps = search(TableDecoder(LP_TABLE), src_of(1, 3), cfg, IDS)[0]
    assert [h.tokens for h in hyps] == [(B, C), (A,)]
    assert table_value(hyps[0].score, math.log(0.27) / 3 ** 0.6, hyps[0].length)
    assert table_value(hyps[1].score, math.log(0.3) / 2 ** 0.6, hyps[1].length)
    greedy = search(TableDecoder(LP_TABLE), src_of(1, 3), DecodeConfig(beam_size=1, alpha=1.0, length_norm="power"), IDS)
    assert table_value(greedy[0][0].score, math.log(0.3) / 2, greedy[0][0].length)  # [A EOS]
    with pytest.raises(ConfigError, match="length_norm"):
        DecodeConfig(length_norm="linear")


def test_eos_at_first_step_and_greedy():
    table = {1: {(): {EOS: 0.6, A: 0.4}, (A,): {EOS: 1.0}}}
    cfg = DecodeConfig(beam_size=1, alpha=0.6)
    [[h]] = search(TableDecoder(table), src_of(1, 2), cfg, IDS)
    assert h.tokens == () and h.length == 1 and h.eos
    assert table_value(h.score, math.log(0.6), h.length)  # lp(1) = 1
    # beam 2 still prefers [EOS] (ln .6 > ln .4 / lp(2)) and both are in the 2-best list
    hyps = search(TableDecoder(table), src_of(1, 2), DecodeConfig(beam_size=2, nbest=2), IDS)[0]
    assert [h.tokens for h in hyps] == [(), (A,)]


# Early stop: after step 2, [A EOS] has score ln .891 / lp(2) = -0.1056 and the only live
# hypothesis [B B] has log-prob ln .0999; its best reachable score ln .0999 / lp(max_len)
# is -0.597 with max_len = 52 (alpha 0.6), so the search must stop after 2 steps.
STOP_TABLE = {1: {(): {A: 0.9, B: 0.1}, (A,): {EOS: 0.99, C: 0.01}}}
STOP_DEFAULT = {B: 0.999, EOS: 0.001}


def test_early_stop_is_taken_when_no_live_hypothesis_can_win():
    dec = TableDecoder(STOP_TABLE, default=STOP_DEFAULT)
    [[h]] = search(dec, src_of(1, 2), DecodeConfig(beam_size=2, alpha=0.6), IDS)
    assert h.tokens == (A,)
    assert dec.max_len_seen == 52
    assert len(dec.rows_per_step) == 2


def test_early_stop_not_taken_when_the_bound_still_allows_a_win():
    # alpha 3: the bound ln .0999 / lp(52) = -0.0027 beats ln .891 / lp(2) = -0.073, so the
    # search goes on; the B chain then runs to max_len = 52, and the truncated hypothesis
    # [B]*52 (ln .1 + 51 ln .999 = -2.3536, / lp(52) = -0.00275) beats every finished one.
    dec = TableDecoder(STOP_TABLE, default=STOP_DEFAULT)
    [[h]] = search(dec, src_of(1, 2), DecodeConfig(beam_size=2, alpha=3.0), IDS)
    assert len(dec.rows_per_step) == 52
    assert h.tokens == (B,) * 52 and not h.eos and h.length == 52
    expected = (math.log(0.1) + 51 * math.log(0.999)) / lp(52, 3.0)
    assert table_value(h.score, expected, h.length)


def test_max_length_reached_without_eos():
    dec = TableDecoder(default={A: 0.7, B: 0.3})  # EOS impossible
    cfg = DecodeConfig(beam_size=2, alpha=0.6, max_len_a=0.0, max_len_b=3, nbest=2)
    hyps = search(dec, src_of(1, 4), cfg, IDS)[0]
    assert hyps[0].tokens == (A, A, A) and not hyps[0].eos and hyps[0].length == 3
    assert table_value(hyps[0].score, 3 * math.log(0.7) / lp(3, 0.6), hyps[0].length)
    assert hyps[1].tokens in {(A, A, B), (A, B, A), (B, A, A)}
    assert len(dec.rows_per_step) == 3
    [[g]] = search(TableDecoder(default={A: 0.7, B: 0.3}), src_of(1, 4), DecodeConfig(beam_size=1, max_len_a=0.0, max_len_b=3), IDS)
    assert g.tokens == (A, A, A) and not g.eos


def test_min_len_suppresses_eos():
    dec = TableDecoder(default={EOS: 0.9, A: 0.1})
    cfg = DecodeConfig(beam_size=2, min_len=3)
    [[h]] = search(dec, src_of(1, 2), cfg, IDS)
    assert h.tokens == (A, A, A) and h.eos and h.length == 4
    assert table_value(h.log_prob, 3 * math.log(0.1) + math.log(0.9), h.length)  # no renormalization
    # min_len = max_len forces a fixed length (the benchmark setting)
    cfg = DecodeConfig(beam_size=2, min_len=5, max_len_a=0.0, max_len_b=5)
    [[h]] = search(TableDecoder(default={EOS: 0.9, A: 0.1}), src_of(1, 2), cfg, IDS)
    assert h.tokens == (A,) * 5 and not h.eos


def test_finished_sentences_leave_the_batch():
    tables = {1: {(): {EOS: 1.0}}, 2: {}}
    dec = TableDecoder(tables, default={A: 0.6, EOS: 0.4})
    cfg = DecodeConfig(beam_size=2, alpha=0.0, max_len_a=0.0, max_len_b=4)
    src = torch.cat([src_of(1, 2), src_of(2, 2)])
    out = search(dec, src, cfg, IDS)
    assert out[0][0].tokens == () and out[1][0].tokens == ()
    # sentence 0 finished at step 1; sentence 1 at step 2 (its best finished ln .4 then beats
    # the live [A A] with ln .36), so the steps saw 2 x 2 beams, then 1 x 2.
    assert dec.rows_per_step == [4, 2]


# --------------------------------------------------------------------------------------------
# A plain reference: same beam semantics, written per sentence in Python, and WITHOUT early
# stopping (runs until no live hypothesis is left). Equal results mean the early stop is exact.


def reference_beam(dec: TableDecoder, key: int, max_len: int, K: int, F: int, alpha: float,
                   min_len: int = 0) -> list[tuple[float, tuple[int, ...], float]]:
    """(score, tokens, log_prob) of the F best finished hypotheses."""
    live = [((), 0.0)]
    finished = []
    for t in range(1, max_len + 1):
        cands = []
        for prefix, s in live:
            for v, logp in enumerate(dec._log_probs(key, prefix).tolist()):
                if v in (PAD, BOS) or (v == EOS and t <= min_len) or logp == float("-inf"):
                    continue
                cands.append((s + logp, prefix + (v,)))
        cands.sort(key=lambda c: -c[0])
        live = []
        for s, seq in cands[:K]:
            if seq[-1] == EOS:
                finished.append((s / lp(t, alpha), seq[:-1], s))
            elif t >= max_len:
                finished.append((s / lp(t, alpha), seq, s))
            else:
                live.append((seq, s))
        if not live:
            break
    finished.sort(key=lambda f: -f[0])
    return finished[:F]


@pytest.mark.parametrize("K,F,alpha,min_len,V", [(2, 1, 0.6, 0, 9), (4, 4, 0.6, 0, 9), (3, 2, 0.0, 0, 9),
                                                 (4, 1, 2.0, 2, 9), (5, 3, 1.0, 0, 9),
                                                 (4, 2, 0.6, 0, 150), (3, 3, 1.0, 1, 107),
                                                 # V // 16 >= 4K: topk_rows' block path on each beam's row
                                                 (4, 2, 0.6, 0, 300), (3, 3, 1.0, 1, 200)])
def test_beam_matches_the_reference_without_early_stop(K, F, alpha, min_len, V):
    dec = TableDecoder(V=V, random_vocab=True, dtype=torch.float64)
    src = torch.tensor([[11, 7, 7, 7], [12, 7, 0, 0], [13, 7, 7, 0], [14, 0, 0, 0]])
    cfg = DecodeConfig(beam_size=K, nbest=F, alpha=alpha, min_len=min_len, max_len_a=1.0, max_len_b=4)
    out = search(dec, src, cfg, IDS)
    for b, key in enumerate([11, 12, 13, 14]):
        n_src = int((src[b] != PAD).sum())
        ref = reference_beam(dec, key, n_src + 4, K, F, alpha, min_len)
        assert [h.tokens for h in out[b]] == [r[1] for r in ref]
        assert [h.score for h in out[b]] == pytest.approx([r[0] for r in ref], rel=1e-9)
        assert [h.log_prob for h in out[b]] == pytest.approx([r[2] for r in ref], rel=1e-9)


def test_beam_wider_than_the_vocabulary_matches_the_reference():
    # K = 6 beams over V = 5 tokens (3 of them pad, BOS, EOS): each beam offers fewer than K tokens.
    dec = TableDecoder(V=5, random_vocab=True, dtype=torch.float64)
    src = torch.tensor([[11, 7, 7], [12, 7, 0]])
    cfg = DecodeConfig(beam_size=6, nbest=3, alpha=0.6, max_len_a=1.0, max_len_b=3)
    out = search(dec, src, cfg, IDS)
    for b, key in enumerate([11, 12]):
        ref = reference_beam(dec, key, int((src[b] != PAD).sum()) + 3, 6, 3, 0.6)
        assert [h.tokens for h in out[b]] == [r[1] for r in ref]
        assert [h.score for h in out[b]] == pytest.approx([r[0] for r in ref], rel=1e-9)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_beam_size_one_equals_greedy(alpha):
    src = torch.tensor([[11, 7, 7], [12, 7, 0], [13, 0, 0], [15, 7, 7]])
    greedy = search(TableDecoder(V=9, random_vocab=True), src, DecodeConfig(beam_size=1, alpha=alpha), IDS)
    dec = TableDecoder(V=9, random_vocab=True)
    from aiayn.decode.search import _beam_search  # the beam code path with K = 1
    beam1 = _beam_search(dec, src, DecodeConfig(beam_size=1, alpha=alpha), IDS, None).hypotheses()
    assert [[h.tokens for h in hs] for hs in greedy] == [[h.tokens for h in hs] for hs in beam1]
    for g, b in zip(greedy, beam1):  # the same log-probabilities (all <= 0), summed and divided by the penalty
        assert abs(g[0].score - b[0].score) <= 2 * float(gamma(b[0].length + 1)) * abs(b[0].score)  # in any order


@pytest.mark.parametrize("cfg", [DecodeConfig(beam_size=4, nbest=3), DecodeConfig(beam_size=1),
                                 DecodeConfig(beam_size=3, alpha=0.0, max_len_a=2.0, max_len_b=1)])
def test_output_does_not_depend_on_batch_composition(cfg):
    src = torch.tensor([[11, 7, 7, 7, 7], [12, 7, 0, 0, 0], [13, 7, 7, 0, 0], [14, 0, 0, 0, 0]])
    together = search(TableDecoder(V=9, random_vocab=True), src, cfg, IDS)
    for b in range(4):
        alone = search(TableDecoder(V=9, random_vocab=True), src[b:b + 1], cfg, IDS)[0]
        assert alone == together[b]
    reordered = search(TableDecoder(V=9, random_vocab=True), src.flip(0), cfg, IDS)
    assert reordered[::-1] == together


# --------------------------------------------------------------------------------------------
# Sampling


def test_filter_logits_top_k_top_p_temperature():
    logp = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    top2 = filter_logits(logp, DecodeConfig(sampling=True, top_k=2))
    assert torch.isinf(top2[0, 2:]).all() and torch.isfinite(top2[0, :2]).all()
    # nucleus p = 0.8: {0.5, 0.3} reaches 0.8 -> keep 2; p = 0.81 -> keep 3
    assert torch.isfinite(filter_logits(logp, DecodeConfig(sampling=True, top_p=0.8))).sum() == 2
    assert torch.isfinite(filter_logits(logp, DecodeConfig(sampling=True, top_p=0.81))).sum() == 3
    assert torch.isfinite(filter_logits(logp, DecodeConfig(sampling=True, top_p=0.1))).sum() == 1
    hot = filter_logits(logp, DecodeConfig(sampling=True, temperature=2.0)).softmax(-1)
    expected = torch.tensor([0.5, 0.3, 0.15, 0.05]).sqrt()
    assert torch.allclose(hot[0], expected / expected.sum())


def test_sampling_with_top_k_1_is_greedy_and_scores_use_model_log_probs():
    src = torch.tensor([[11, 7, 7], [12, 7, 0], [13, 0, 0]])
    greedy = search(TableDecoder(V=9, random_vocab=True), src, DecodeConfig(beam_size=1), IDS)
    cfg = DecodeConfig(sampling=True, top_k=1, nbest=2, temperature=0.5)
    sampled = search(TableDecoder(V=9, random_vocab=True), src, cfg, IDS)
    for g, s in zip(greedy, sampled):
        assert len(s) == 2 and s[0].tokens == s[1].tokens == g[0].tokens
        assert abs(s[0].score - g[0].score) <= 2 * float(gamma(g[0].length + 1)) * abs(g[0].score)  # as above


def test_sampling_draws_from_the_distribution():
    dec = TableDecoder(default={A: 0.75, EOS: 0.25})
    cfg = DecodeConfig(sampling=True, nbest=400, max_len_a=0.0, max_len_b=1, seed=3)
    hyps = search(dec, src_of(1, 2), cfg, IDS)[0]
    share_a = sum(h.tokens == (A,) for h in hyps) / len(hyps)
    assert 0.68 < share_a < 0.82  # binomial(400, .75): sd 0.022
    again = search(TableDecoder(default={A: 0.75, EOS: 0.25}), src_of(1, 2), cfg, IDS)[0]
    assert again == hyps  # the seed makes it reproducible


def test_config_errors():
    with pytest.raises(ConfigError):
        DecodeConfig(alpha=-0.1)
    with pytest.raises(ConfigError):
        DecodeConfig(beam_size=2, nbest=3)
    with pytest.raises(ConfigError):
        DecodeConfig(top_p=0.0)


@pytest.mark.parametrize("field", ["alpha", "max_len_a", "temperature", "top_p"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_settings_are_refused(field, value):
    """NaN passes every bound check (NaN < 0 is False): a NaN alpha made every score NaN and every
    output empty, a NaN max_len_a every output one token."""
    with pytest.raises(ConfigError, match=f"{field} must be a finite number"):
        DecodeConfig(**{field: value})


@pytest.mark.parametrize("seed", [-1, 1 << 63, 10 ** 23])
def test_seed_out_of_the_generators_range_is_refused(seed):
    with pytest.raises(ConfigError, match="seed must be in"):
        DecodeConfig(seed=seed)


@pytest.mark.parametrize("flags, said", [(["--alpha", "nan"], "alpha must be a finite number, got nan"),
                                         (["--sampling", "--seed", "99999999999999999999999"], "seed must be in")])
def test_translate_refuses_a_non_finite_or_out_of_range_setting_in_one_line(flags, said, tmp_path, capsys):
    from aiayn.cli import main
    assert main(["translate", "--checkpoint", str(tmp_path / "m.pt"), *flags]) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1 and "Traceback" not in err, err


# --------------------------------------------------------------------------------------------
# topk_rows: the beam's top-k by block maxima


@pytest.mark.parametrize("R,M,k,blocks", [(3, 1000, 4, 16), (5, 4003, 5, 16), (2, 640, 1, 8), (4, 50, 4, 16)])
def test_topk_rows_equals_torch_topk(R, M, k, blocks):
    g = torch.Generator().manual_seed(R * M)
    x = torch.randn(R, M, generator=g, dtype=torch.float64)
    x[0, ::3] = float("-inf")  # masked tokens and dead beams
    x[1, M - 1] = 10.0  # the best entry in the tail columns past the last whole block
    values, idx = topk_rows(x, k, blocks)
    ref = x.topk(k, dim=1)
    assert torch.equal(values, ref.values)
    assert torch.equal(idx, ref.indices)  # no ties here, so the indices are determined


def test_topk_rows_with_ties_gives_the_same_values_and_distinct_indices():
    x = torch.randint(0, 6, (6, 2000), generator=torch.Generator().manual_seed(0)).double()  # many ties
    x[2] = float("-inf")  # a row with no finite entry
    x[3, :1990] = float("-inf")  # fewer finite entries than blocks
    values, idx = topk_rows(x, 4, 16)
    assert torch.equal(values, x.topk(4, dim=1).values)
    assert torch.equal(x.gather(1, idx), values)
    assert all(len(set(row)) == 4 for row in idx.tolist())


def test_topk_rows_hand_example():
    # 41 columns, 2 blocks -> n = 20 blocks of 2 interleaved columns {j, j + 20}, and column 40
    # left over (the tail). Block maxima: block 5 = {5, 25} 9, block 3 = {3, 23} 7, the rest 0.
    # The top 3 are 9 (col 25), 8.5 (col 40, from the tail) and 8 (col 5, found because it
    # shares block 5 with col 25, although block 3's 7 ranks above the other blocks).
    x = torch.zeros(1, 41)
    x[0, 25], x[0, 3], x[0, 5], x[0, 40] = 9.0, 7.0, 8.0, 8.5
    values, idx = topk_rows(x, 3, blocks=2)  # n = 20 >= 4k: the block path; col 40 is the tail
    assert values.tolist() == [[9.0, 8.5, 8.0]] and idx.tolist() == [[25, 40, 5]]


def test_decoding_on_cuda_leaves_out_cudnn_attention():
    """cuDNN's attention plans a kernel per shape and a decoding step's shapes change every step:
    decoding on CUDA selects flash / memory-efficient / math only; elsewhere the flags are untouched.
    (The flags are process settings, so this runs without a GPU.)"""
    from aiayn.decode.search import attention_backends
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with attention_backends(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    with attention_backends(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_pool_merge_without_endings_changes_nothing():
    """Beam search on CUDA merges every step without asking whether a hypothesis ended (a host
    round trip): a merge where nothing ends must leave the pool exactly as it was."""
    from aiayn.decode.search import _Pool
    pool = _Pool(2, 2, 4, torch.device("cpu"), torch.float32)
    toks = torch.arange(2 * 3 * 4).view(2, 3, 4)
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, -9.0]])
    ends = torch.tensor([[True, False, False], [False, False, True]])
    pool.merge(toks, lp, ends, ends, 2, 0.6)
    before = {k: getattr(pool, k).clone() for k in ("tokens", "score", "log_prob", "length", "eos")}
    pool.merge(toks + 100, lp - 0.1, torch.zeros_like(ends), torch.zeros_like(ends), 3, 0.6)
    for k, v in before.items():
        assert torch.equal(getattr(pool, k), v), k


@pytest.mark.parametrize("beam", [1, 2])
def test_allowed_masks_tokens_before_the_choice(beam):
    # LP_TABLE without A at the first step: [B C EOS] (ln .27) wins in greedy and beam search alike;
    # the constraint sees each hypothesis's sentence (row 0) and its prefix.
    seen = []

    def allowed(rows, prefix):
        seen.append((rows.tolist(), prefix.shape[1]))
        mask = torch.ones(rows.size(0), 8, dtype=torch.bool)
        if prefix.shape[1] == 0:
            mask[:, A] = False
        return mask

    hyps = search(TableDecoder(LP_TABLE), src_of(1, 3), DecodeConfig(beam_size=beam, alpha=0.6), IDS,
                  Constraints(allowed=allowed))[0]
    assert [h.tokens for h in hyps] == [(B, C)]
    assert table_value(hyps[0].log_prob, math.log(0.27), hyps[0].length)
    assert seen[0] == ([0] * beam, 0) and seen[1] == ([0] * beam, 1)


@pytest.mark.parametrize("cfg", [DecodeConfig(beam_size=4, nbest=2), DecodeConfig(beam_size=1)])
def test_allowing_everything_changes_nothing(cfg):
    src = torch.tensor([[11, 7, 7, 7], [12, 7, 0, 0], [13, 7, 7, 0]])
    plain = search(TableDecoder(V=9, random_vocab=True), src, cfg, IDS)
    everything = search(TableDecoder(V=9, random_vocab=True), src, cfg, IDS,
                        Constraints(allowed=lambda rows, prefix: torch.ones(rows.size(0), 9, dtype=torch.bool)))
    assert everything == plain


@pytest.mark.parametrize("cfg", [DecodeConfig(beam_size=1, max_len_b=12),
                                 DecodeConfig(beam_size=3, nbest=2, max_len_b=12),
                                 DecodeConfig(sampling=True, nbest=2, seed=3, max_len_b=12)])
def test_stop_is_asked_before_every_step_and_ends_the_search(cfg):
    from aiayn.decode.search import Stopped
    src = torch.tensor([[4, 7, 7], [5, 7, 3]])
    plain = search(TableDecoder(V=9, random_vocab=True), src, cfg, IDS)
    asked = []
    dec = TableDecoder(V=9, random_vocab=True)
    kept = search(dec, src, cfg, IDS, stop=lambda: asked.append(1) and False)
    assert [[(h.tokens, h.score) for h in hs] for hs in kept] == [[(h.tokens, h.score) for h in hs] for hs in plain]
    assert len(asked) == len(dec.rows_per_step)  # one question per step, before it
    stopper = TableDecoder(V=9, random_vocab=True)
    with pytest.raises(Stopped, match="before step 4"):
        search(stopper, src, cfg, IDS, stop=lambda: len(stopper.rows_per_step) == 3)
    assert len(stopper.rows_per_step) == 3  # no step after the one that said stop
