"""No repeated n-grams (decode/ngram.py, ``DecodeConfig.no_repeat_ngram``): bans computed by hand,
outputs without a repeated n-gram, greedy and beam search against a plain Python reference on a tiny
random model (cached decoder, C kernels, shared beam slots), forced prefixes, batches, and n = 0
leaving the search as it was."""
from __future__ import annotations

import importlib
import math

import pytest
import torch

import aiayn
from aiayn.cli import main
from aiayn.config import ConfigError, replace
from aiayn.decode.adapter import CachedDecoder
from aiayn.decode.config import DecodeConfig
from aiayn.decode.ngram import ban_repeated_ngrams
from aiayn.decode.search import Constraints, SpecialIds, length_penalty, search
from aiayn.decode.translator import Translator
from aiayn.kernels.loader import load as load_kernels
from tests.decode.stub import BOS, EOS, PAD, TableDecoder, table_value
from tests.rounding import log_prob_bound, same_float_search, score_bound

search_module = importlib.import_module("aiayn.decode.search")  # (aiayn.decode.search is also the function)
IDS = SpecialIds(pad=PAD, bos=BOS, eos=EOS)
NEG_INF = float("-inf")
A, B, C = 4, 5, 6


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one torch thread is as fast, and spares a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def banned_by(history: list[list[int]], n: int, V: int = 9, exempt: list[bool] | None = None) -> list[list[int]]:
    """The tokens (pad aside: the sink) ``ban_repeated_ngrams`` sets to -inf in each row."""
    lp = torch.zeros(len(history), V)
    ban_repeated_ngrams(lp, torch.tensor(history), n, PAD, None if exempt is None else torch.tensor(exempt))
    assert ((lp == 0) | (lp == NEG_INF)).all()  # the others untouched
    return [[v for v in range(V) if v != PAD and lp[r, v] == NEG_INF] for r in range(len(history))]


def repeats(seq: tuple[int, ...], n: int) -> set[int]:
    """The plain rule: the last tokens of the n-grams of ``seq`` that begin with its last n - 1 tokens."""
    if n < 1 or len(seq) < n:
        return set()
    grams = {tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)}
    last = tuple(seq[len(seq) - n + 1:])
    return {g[-1] for g in grams if g[:-1] == last}


def has_repeat(seq: tuple[int, ...], n: int) -> bool:
    grams = [tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)]
    return len(grams) != len(set(grams))


def test_banned_tokens_golden():
    # row 0 = 4 5 6 7 5 4 4 5
    #   n = 1: every token it holds: 4 5 6 7
    #   n = 2: its last token 5 came before at positions 2 (then 6) and 5 (then 4): 4 and 6
    #   n = 3: its last bigram (4 5) came before at 1-2 (then 6): 6
    #   n = 4: (4 4 5) never came before: nothing
    # row 1 = 7 x 8: 7 for every n up to 8 (the 7-gram 1-7 is followed by 7); n = 9 > 8 tokens: nothing
    rows = [[4, 5, 6, 7, 5, 4, 4, 5], [7] * 8]
    assert banned_by(rows, 1) == [[4, 5, 6, 7], [7]]
    assert banned_by(rows, 2) == [[4, 6], [7]]
    assert banned_by(rows, 3) == [[6], [7]]
    assert banned_by(rows, 4) == [[], [7]]
    assert banned_by(rows, 8) == [[], [7]]
    assert banned_by(rows, 9) == [[], []]
    assert banned_by(rows, 0) == [[], []]
    assert banned_by(rows, 2, exempt=[False, True]) == [[4, 6], []]  # a forced row is left alone
    assert banned_by([[4, 5, 4]], 2) == [[5]] and banned_by([[4, 5, 4]], 3) == [[]]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_bans_equal_the_plain_rule_on_random_rows(n):
    g = torch.Generator().manual_seed(n)
    history = torch.randint(4, 8, (64, 12), generator=g)  # 4 tokens: many repeats
    for L in (0, n - 1, n, 12):
        got = banned_by(history[:, :L].tolist(), n)
        assert got == [sorted(repeats(tuple(row), n)) for row in history[:, :L].tolist()], L


def test_config_refuses_a_negative_n():
    with pytest.raises(ConfigError, match="no_repeat_ngram must be >= 0"):
        DecodeConfig(no_repeat_ngram=-1)


# ---------------------------------------------------------------------------------------------
# A plain reference: greedy and beam search written per sentence in Python, the ban by ``repeats``


def allowed_tokens(seq: tuple[int, ...], t: int, V: int, n: int, forced: tuple[int, ...]) -> list[int]:
    if t <= len(forced):
        return [forced[t - 1]]
    return [v for v in range(V) if v not in (PAD, BOS) and v not in repeats(seq, n)]


def reference_greedy(next_lp, max_len: int, n: int, forced: tuple[int, ...] = ()):
    """(tokens, log_prob, eos) of greedy search with the ban."""
    seq, total = (), 0.0
    for t in range(1, max_len + 1):
        lps = next_lp(seq)
        v = max(allowed_tokens(seq, t, len(lps), n, forced), key=lambda u: lps[u])
        total += lps[v]
        seq += (v,)
        if v == EOS:
            return seq[:-1], total, True
    return seq, total, False


def reference_beam(next_lp, max_len: int, K: int, F: int, alpha: float, n: int, forced: tuple[int, ...] = ()):
    """(tokens, log_prob, score) of the F best finished hypotheses of beam search with the ban,
    without early stopping."""
    live, finished = [((), 0.0)], []
    for t in range(1, max_len + 1):
        cands = []
        for seq, s in live:
            lps = next_lp(seq)
            cands += [(s + lps[v], seq + (v,)) for v in allowed_tokens(seq, t, len(lps), n, forced)
                      if lps[v] != NEG_INF]
        cands.sort(key=lambda c: -c[0])
        live = []
        for s, seq in cands[:K]:
            if seq[-1] == EOS or t >= max_len:
                tokens = seq[:-1] if seq[-1] == EOS else seq
                finished.append((tokens, s, s / length_penalty(float(t), alpha)))
            else:
                live.append((seq, s))
        if not live:
            break
    finished.sort(key=lambda f: -f[2])
    return finished[:F]


def tiny_model() -> aiayn.Transformer:
    cfg = aiayn.get_preset("tiny", vocab_size=24, p_drop=0.0, d_model=32, d_ff=64, n_heads=2, d_k=16, d_v=16)
    torch.manual_seed(5)
    return aiayn.Transformer(cfg).eval()


def model_log_probs(model: aiayn.Transformer, src_row: torch.Tensor):
    """next_lp(prefix) of the model for one sentence, by the full teacher-forced forward pass."""
    src = src_row[src_row != PAD][None]  # (1, S) without padding

    def next_lp(prefix: tuple[int, ...]) -> list[float]:
        with torch.no_grad():
            logits = model(src, torch.tensor([[BOS, *prefix]]))[0, -1]
        return logits.double().log_softmax(-1).tolist()
    return next_lp


SRC = torch.tensor([[9, 8, 7, 6, 5, 4, 3], [9, 8, 3, 0, 0, 0, 0], [10, 11, 12, 13, 3, 0, 0], [5, 3, 0, 0, 0, 0, 0]])
PREFIX = torch.tensor([[5, 6, 5, 6], [7, -1, -1, -1], [-1, -1, -1, -1], [8, 9, 8, -1]])


def forced_of(prefix: torch.Tensor | None, b: int) -> tuple[int, ...]:
    return () if prefix is None else tuple(v for v in prefix[b].tolist() if v >= 0)


def decoders(model):
    """The cached decoder with the C kernels and shared beam slots (what Translator uses on a CPU)
    and the copying cache without kernels."""
    return {"kernels-shared": CachedDecoder(model, share_slots=True, kernels=load_kernels()),
            "copying": CachedDecoder(model, share_slots=False)}


@pytest.mark.parametrize("use_prefix", [False, True])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_greedy_matches_the_reference_on_a_tiny_model(n, use_prefix):
    model = tiny_model()
    prefix = PREFIX if use_prefix else None
    cfg = DecodeConfig(beam_size=1, max_len_a=1.0, max_len_b=6, no_repeat_ngram=n)
    for name, dec in decoders(model).items():
        out = search(dec, SRC, cfg, IDS, Constraints(prefix=prefix))
        for b in range(SRC.size(0)):
            forced = forced_of(prefix, b)
            max_len = max(int((SRC[b] != PAD).sum()) + 6, len(forced) + 1)
            tokens, log_prob, eos = reference_greedy(model_log_probs(model, SRC[b]), max_len, n, forced)
            [h] = out[b]
            assert (h.tokens, h.eos) == (tokens, eos), (name, b)
            # both float32 forwards, each within float32's roundings of the exact (tests/rounding.py)
            assert abs(h.log_prob - log_prob) <= 2 * log_prob_bound(model, "fp32", SRC[b], h, cfg, IDS), (name, b)


@pytest.mark.parametrize("use_prefix", [False, True])
@pytest.mark.parametrize("K,F,n", [(3, 2, 2), (4, 4, 3), (3, 1, 1), (2, 2, 4)])
def test_beam_matches_the_reference_on_a_tiny_model(K, F, n, use_prefix):
    model = tiny_model()
    prefix = PREFIX if use_prefix else None
    cfg = DecodeConfig(beam_size=K, nbest=F, alpha=0.6, max_len_a=1.0, max_len_b=4, no_repeat_ngram=n)
    for name, dec in decoders(model).items():
        out = search(dec, SRC, cfg, IDS, Constraints(prefix=prefix))
        for b in range(SRC.size(0)):
            forced = forced_of(prefix, b)
            max_len = max(int((SRC[b] != PAD).sum()) + 4, len(forced) + 1)
            ref = reference_beam(model_log_probs(model, SRC[b]), max_len, K, F, 0.6, n, forced)
            assert [h.tokens for h in out[b]] == [r[0] for r in ref], (name, b)
            for h, (_, log_prob, score) in zip(out[b], ref):  # within both forwards' float32 roundings
                bound = score_bound(model, "fp32", SRC[b], h, cfg, IDS)
                assert abs(h.score - score) <= 2 * bound, (name, b)
                assert abs(h.log_prob - log_prob) <= 2 * bound * length_penalty(h.length, cfg.alpha, cfg.length_norm), (name, b)


@pytest.mark.parametrize("K,F,n,min_len", [(1, 1, 2, 0), (3, 3, 2, 0), (4, 2, 3, 2), (2, 2, 1, 0)])
def test_search_matches_the_reference_on_tables(K, F, n, min_len):
    """Stub tables over 3 words and EOS (exact float64 sums), where the ban soon runs out of words."""
    dec = TableDecoder(V=7, random_vocab=True, dtype=torch.float64)
    src = torch.tensor([[11, 7, 7, 7, 7], [12, 7, 0, 0, 0], [13, 7, 7, 7, 0]])
    cfg = DecodeConfig(beam_size=K, nbest=F, alpha=0.6, max_len_a=1.0, max_len_b=6, no_repeat_ngram=n)
    out = search(dec, src, cfg, IDS)
    for b, key in enumerate([11, 12, 13]):
        max_len = int((src[b] != PAD).sum()) + 6

        def next_lp(seq, key=key):
            return dec._log_probs(key, seq).tolist()
        ref = reference_beam(next_lp, max_len, K, F, 0.6, n)
        assert [h.tokens for h in out[b]] == [r[0] for r in ref], b
        assert [h.score for h in out[b]] == pytest.approx([r[2] for r in ref], rel=1e-9), b


# ---------------------------------------------------------------------------------------------
# Outputs, prefixes, batches


@pytest.mark.parametrize("cfg", [DecodeConfig(beam_size=1), DecodeConfig(beam_size=4, nbest=4),
                                 DecodeConfig(beam_size=3, nbest=2, alpha=0.0),
                                 DecodeConfig(sampling=True, nbest=3, seed=1)])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_outputs_never_repeat_an_ngram(cfg, n):
    model = tiny_model()
    cfg = replace(cfg, max_len_a=2.0, max_len_b=8)
    plain = search(CachedDecoder(model, kernels=load_kernels()), SRC, cfg, IDS)
    assert any(has_repeat(h.tokens, n) for hs in plain for h in hs)  # the model repeats itself
    banned = replace(cfg, no_repeat_ngram=n)
    for dec in decoders(model).values():
        for hs in search(dec, SRC, banned, IDS):
            assert hs and all(not has_repeat(h.tokens, n) and math.isfinite(h.score) for h in hs)


@pytest.mark.parametrize("beam", [1, 2])
def test_a_forced_prefix_counts_in_the_history(beam):
    # The prefix (A B) holds the bigram A B: after (A B A) the model's first choice B is banned, C taken.
    table = {1: {(A, B): {A: 0.6, EOS: 0.4}, (A, B, A): {B: 0.6, C: 0.3, EOS: 0.1}, (A, B, A, C): {EOS: 1.0},
                 (A, B, A, B): {EOS: 1.0}}}
    prefix = torch.tensor([[A, B]])
    cfg = DecodeConfig(beam_size=beam, nbest=beam, alpha=0.0)
    free = search(TableDecoder(table), torch.tensor([[1, 7]]), cfg, IDS, Constraints(prefix=prefix))[0]
    assert (A, B, A, B) in [h.tokens for h in free]
    hyps = search(TableDecoder(table), torch.tensor([[1, 7]]), replace(cfg, no_repeat_ngram=2), IDS,
                  Constraints(prefix=prefix))[0]
    assert (A, B, A, B) not in [h.tokens for h in hyps]
    if beam == 1:  # (the forced A and B: uniform over the 8 tokens)
        assert hyps[0].tokens == (A, B, A, C)
        assert table_value(hyps[0].log_prob, math.log(0.6 * 0.3 / 64), hyps[0].length)


@pytest.mark.parametrize("beam", [1, 3])
def test_forced_tokens_are_never_banned(beam):
    # The forced (A B A B) repeats the bigram A B at its 4th token: forced all the same. Greedy then
    # takes B (A is banned after B), then EOS (A and B both are); the beam's best ends at once
    # (ln .2 beats ln .3 + ln .2 at α = 0).
    dec = TableDecoder(default={A: 0.5, B: 0.3, EOS: 0.2})
    prefix = torch.tensor([[A, B, A, B]])
    hyps = search(dec, torch.tensor([[1, 7]]), DecodeConfig(beam_size=beam, alpha=0.0, no_repeat_ngram=2), IDS,
                  Constraints(prefix=prefix))[0]
    tail = (B,) if beam == 1 else ()
    assert hyps[0].tokens == (A, B, A, B, *tail) and hyps[0].eos
    assert table_value(hyps[0].log_prob, math.log(0.5 * 0.3 * 0.5 * 0.3 * 0.3 ** len(tail) * 0.2), hyps[0].length)
    # no prefix: A A, then B (A A is taken), A, then EOS (A A and A B are taken)
    [h] = search(dec, torch.tensor([[1, 7]]), DecodeConfig(beam_size=1, no_repeat_ngram=2), IDS)[0]
    assert h.tokens == (A, A, B, A) and h.eos


@pytest.mark.parametrize("cfg", [DecodeConfig(beam_size=1, no_repeat_ngram=2),
                                 DecodeConfig(beam_size=4, nbest=2, no_repeat_ngram=2),
                                 DecodeConfig(beam_size=3, no_repeat_ngram=3, max_len_a=2.0, max_len_b=3)])
def test_batched_equals_one_by_one(cfg):
    model = tiny_model()
    dec = CachedDecoder(model, kernels=load_kernels())
    together = search(dec, SRC, cfg, IDS, Constraints(prefix=PREFIX))
    for b in range(SRC.size(0)):
        row = SRC[b:b + 1, : int((SRC[b] != PAD).sum())]
        alone = search(dec, row, cfg, IDS, Constraints(prefix=PREFIX[b:b + 1]))[0]
        same_float_search(model, SRC[b:b + 1], [alone], [together[b]], cfg, IDS)
    tables = search(TableDecoder(V=9, random_vocab=True), SRC, cfg, IDS)
    for b in range(SRC.size(0)):
        assert search(TableDecoder(V=9, random_vocab=True), SRC[b:b + 1], cfg, IDS)[0] == tables[b]


# ---------------------------------------------------------------------------------------------
# n = 0: the search as it was


class FusedCounts:
    """A decoder noting which of its methods each step takes."""

    def __init__(self, decoder):
        self.decoder, self.calls = decoder, []

    def start(self, src, max_len):
        return self.decoder.start(src, max_len)

    def step(self, tokens, state):
        self.calls.append("step")
        return self.decoder.step(tokens, state)

    def step_topk(self, tokens, state, k, banned):
        self.calls.append("step_topk")
        return self.decoder.step_topk(tokens, state, k, banned)


@pytest.mark.parametrize("cfg", [DecodeConfig(beam_size=4, nbest=2), DecodeConfig(beam_size=1),
                                 DecodeConfig(sampling=True, nbest=2)])
def test_n_zero_never_reaches_the_ban(cfg, monkeypatch):
    model = tiny_model()
    before = [search(CachedDecoder(model), SRC, cfg, IDS, Constraints(prefix=p)) for p in (None, PREFIX)]

    def fail(*args, **kwargs):
        raise AssertionError("the ban ran with no_repeat_ngram = 0")
    monkeypatch.setattr(search_module, "ban_repeated_ngrams", fail)
    assert [search(CachedDecoder(model), SRC, cfg, IDS, Constraints(prefix=p)) for p in (None, PREFIX)] == before
    counted = FusedCounts(CachedDecoder(model, kernels=load_kernels()))
    search(counted, SRC, cfg, IDS)
    assert set(counted.calls) == ({"step_topk"} if cfg.beam_size > 1 and not cfg.sampling else {"step"})


def test_beam_takes_the_fused_step_until_an_ngram_can_repeat():
    """With n = 3, steps 1-3 (at most 2 tokens generated) take ``step_topk``; later ones ``step``."""
    counted = FusedCounts(CachedDecoder(tiny_model(), kernels=load_kernels()))
    search(counted, SRC, DecodeConfig(beam_size=3, no_repeat_ngram=3, max_len_b=4), IDS)
    assert counted.calls[:3] == ["step_topk"] * 3 and set(counted.calls[3:]) == {"step"}


@pytest.mark.parametrize("cfg", [DecodeConfig(beam_size=4, nbest=2), DecodeConfig(beam_size=1)])
def test_an_n_longer_than_every_output_changes_nothing(cfg):
    model = tiny_model()
    dec = CachedDecoder(model, kernels=load_kernels())
    long = replace(cfg, no_repeat_ngram=100)
    forced = Constraints(prefix=PREFIX)
    assert search(dec, SRC, long, IDS, forced) == search(dec, SRC, cfg, IDS, forced)


# ---------------------------------------------------------------------------------------------
# The commands


def test_translate_and_evaluate_take_the_option(untrained_checkpoint, tmp_path, capsys):
    lines = ["a b c d e f", "g h", "a a a b b b c c c"]
    (tmp_path / "src.txt").write_text("\n".join(lines) + "\n")
    cfg = DecodeConfig(max_len_b=12, no_repeat_ngram=2, long_lines="truncate")
    with Translator.from_checkpoint(untrained_checkpoint, cfg) as tr:
        want = tr.translate(lines)
        ids = [t[0].tokens for t in tr.translate_nbest(lines)]
    assert all(not has_repeat(t, 2) for t in ids)
    args = ["--checkpoint", str(untrained_checkpoint), "--max-len-b", "12", "--no-repeat-ngram", "2"]
    assert main(["translate", "--input", str(tmp_path / "src.txt"), *args]) == 0
    assert capsys.readouterr().out.splitlines() == want
    out = tmp_path / "hyp.txt"
    assert main(["evaluate", "--src", str(tmp_path / "src.txt"), "--ref", str(tmp_path / "src.txt"),
                 "--out", str(out), *args]) == 0
    assert out.read_text().splitlines() == want
    capsys.readouterr()
    assert main(["translate", "--input", str(tmp_path / "src.txt"), *args[:2], "--no-repeat-ngram", "-1"]) == 2
    assert "--no-repeat-ngram must be >= 0" in capsys.readouterr().err
