"""Paired bootstrap resampling (Koehn 2004) and ``aiayn demo``'s choice of α on validation."""
from __future__ import annotations

import gzip
import math

import numpy as np
import pytest

from aiayn.errors import UserError
from aiayn.evaluate.alpha import p_values_text
from aiayn.evaluate.bleu import tokenized_bleu
from aiayn.evaluate.significance import bleu_from_stats, corpus_stats, format_p, paired_bootstrap, sentence_stats


def _read(path, n=0):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f]
    return lines[:n] if n else lines


def test_sentence_stats_by_hand():
    # hyp a a b c / ref a b c d: unigrams a (2, clipped to 1) + b + c = 3 of 4; bigrams "a b", "b c" = 2 of 3
    # ("a a" unmatched); trigram "a b c" = 1 of 2; the 4-gram "a a b c" = 0 of 1; lengths 4 and 4
    assert sentence_stats("a a b c", "a b c d").tolist() == [3, 2, 1, 0, 4, 3, 2, 1, 4, 4]
    assert sentence_stats("", "a b").tolist() == [0, 0, 0, 0, 0, 0, 0, 0, 0, 2]


def test_bleu_from_stats_by_hand():
    # matches 3/4, 2/3, 1/2, 1/1: geometric mean (1/4)^(1/4) = 0.707107; c 4 < r 5: BP exp(1 - 5/4) = 0.778801
    assert bleu_from_stats(np.array([3, 2, 1, 1, 4, 3, 2, 1, 4, 5.0])) == pytest.approx(100 * 0.25 ** 0.25 * math.exp(-0.25))
    assert bleu_from_stats(np.array([3, 2, 1, 1, 4, 3, 2, 1, 6, 5.0])) == pytest.approx(100 * 0.25 ** 0.25)  # longer: BP 1
    assert bleu_from_stats(np.array([3, 2, 1, 0, 4, 3, 2, 1, 4, 4.0])) == 0.0  # no 4-gram match, no smoothing
    assert bleu_from_stats(np.zeros(10)) == 0.0


def test_full_set_bleu_is_tokenized_bleu_on_real_data(shared_data):
    """The statistics reproduce sacreBLEU's tokenized BLEU (the Multi30k metric) on 300 validation lines."""
    refs = _read(shared_data / "multi30k/tok/val.lc.norm.tok.de.gz", 300)
    hyps = [" ".join(r.split()[:-2]) if i % 3 else r.replace(" der ", " die ") for i, r in enumerate(refs)]
    ours = float(bleu_from_stats(corpus_stats(hyps, refs).sum(axis=0)))
    assert ours == pytest.approx(tokenized_bleu(hyps, refs).score, abs=1e-9)
    assert 30 < ours < 90


def test_paired_bootstrap(shared_data):
    refs = _read(shared_data / "multi30k/tok/val.lc.norm.tok.de.gz", 400)
    worse = [" ".join(r.split()[:-1]) for r in refs]  # every line loses its last token
    almost = list(worse)
    almost[0] = refs[0]  # one line better than `worse`
    bs = paired_bootstrap({"ref": refs, "worse": worse, "almost": almost}, refs, n_samples=200)
    assert bs.full["ref"] == pytest.approx(100.0)
    assert bs.full["worse"] == pytest.approx(tokenized_bleu(worse, refs).score)
    assert bs.samples["worse"].shape == (200,)
    assert bs.p_value("ref", "worse") == 0.0 and bs.p_value("worse", "ref") == 1.0
    assert bs.p_value("worse", "worse") == 1.0  # a system never beats itself
    # one line in 400 is not a significant lead, though it raises the full-set score
    assert bs.full["almost"] > bs.full["worse"] and bs.p_value("almost", "worse") > 0.05
    # the samples scatter around the full-set score; the draws depend only on the seed
    assert abs(float(np.mean(bs.samples["worse"])) - bs.full["worse"]) < 1.0 and np.std(bs.samples["worse"]) > 0.1
    again = paired_bootstrap({"worse": worse}, refs, n_samples=200)
    assert np.array_equal(again.samples["worse"], bs.samples["worse"])
    other = paired_bootstrap({"worse": worse}, refs, n_samples=200, seed=7)
    assert not np.array_equal(other.samples["worse"], bs.samples["worse"])


def test_paired_bootstrap_bad_input():
    with pytest.raises(UserError, match="2 hypotheses but 1 references"):
        paired_bootstrap({"a": ["x", "y"]}, ["x"])
    with pytest.raises(UserError, match="at least one system"):
        paired_bootstrap({}, ["x"])


def test_choose_alpha_keeps_the_first_unless_validation_says_otherwise(shared_data):
    """``aiayn demo``'s rule: §6.1's α (the first) unless another beats it significantly on validation."""
    from aiayn.evaluate.alpha import choose_alpha
    m = shared_data / "multi30k"
    raw, tok = _read(m / "raw/val.de.gz", 400), _read(m / "tok/val.lc.norm.tok.de.gz", 400)
    worse = [" ".join(r.split()[:-2]) for r in raw]  # the first α's output: each line two words short
    almost = list(worse)
    almost[5] = raw[5]
    # a clear lead: chosen, with p 0 against the first
    alpha, p = choose_alpha({0.6: worse, 1.0: almost, 1.4: raw}, tok, "de", 0.05, n_samples=200)
    assert alpha == 1.4 and set(p) == {1.0, 1.4} and p[1.4] == 0.0 and p[1.0] > 0.05
    # a lead of one line in 400: the highest score, but not significant, so the first stays
    alpha, p = choose_alpha({0.6: worse, 1.0: almost}, tok, "de", 0.05, n_samples=200)
    assert alpha == 0.6 and p[1.0] > 0.05
    # p-level 0: the highest-scoring α, however small its lead
    assert choose_alpha({0.6: worse, 1.0: almost}, tok, "de", 0.0, n_samples=200) == (1.0, {})
    # a lower score is never chosen, whatever its p
    alpha, _ = choose_alpha({0.6: raw, 1.0: worse}, tok, "de", 1.0, n_samples=200)
    assert alpha == 0.6


def test_a_p_value_no_set_reversed_is_below_the_resolution_not_0():
    """p = 0 from n resampled sets means fewer than 1 in n reverse the order: printed "< 1/n"."""
    assert format_p(0.0, 1000) == "< 0.001" and format_p(0.0, 200) == "< 0.005" and format_p(0.0, 300) == "< 0.00333"
    assert format_p(0.281, 1000) == "0.281" and format_p(0.0125, 200) == "0.013" and format_p(1.0, 1000) == "1.000"
    assert p_values_text({1.0: 0.281, 1.4: 0.0}) == "1.0 0.281, 1.4 < 0.001"  # the demos' line, 1,000 sets


def test_cli_score_compare(tmp_path, capsys, shared_data):
    """aiayn score --compare: paired bootstrap of --hyp against other systems, on 300 test_2016 references."""
    import json

    from aiayn.cli import main
    from aiayn.evaluate.bleu import sacre_bleu
    refs = _read(shared_data / "multi30k/raw/test_2016_flickr.de.gz", 300)
    better = [" ".join(r.split()[:-1]) if i % 4 == 0 else r for i, r in enumerate(refs)]
    worse = [" ".join(r.split()[:-1]) for r in refs]
    for name, lines in (("ref", refs), ("better", better), ("worse", worse)):
        (tmp_path / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    args = ["score", "--ref", str(tmp_path / "ref"), "--hyp", str(tmp_path / "better"), "--samples", "200"]
    assert main(args + ["--compare", str(tmp_path / "worse"), str(tmp_path / "better"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["scores"][0]["label"] == "sacreBLEU"
    vs_worse, vs_self = out["paired_bootstrap"]
    # detokenized text: sacreBLEU's 13a tokens, so the full-set scores are sacreBLEU's (no order without a match)
    assert vs_worse["hyp_bleu"] == pytest.approx(sacre_bleu(better, refs).score, abs=0.01)
    assert vs_worse["bleu"] == pytest.approx(sacre_bleu(worse, refs).score, abs=0.01)
    assert vs_worse["difference"] > 5 and vs_worse["p_value"] == 0.0
    lo, hi = vs_worse["hyp_interval_95"]
    assert lo < vs_worse["hyp_bleu"] < hi
    assert vs_self["difference"] == 0.0 and vs_self["p_value"] == 1.0
    # the text form; the tokenized form scores the given tokens
    assert main(args + ["--compare", str(tmp_path / "worse")]) == 0
    assert "p < 0.005" in capsys.readouterr().out.splitlines()[-1]  # no set of 200 reversed the order
    assert main(args + ["--tokenized", "--compare", str(tmp_path / "worse"), "--json"]) == 0
    tok = json.loads(capsys.readouterr().out)["paired_bootstrap"][0]
    assert tok["hyp_bleu"] == pytest.approx(tokenized_bleu(better, refs).score, abs=0.01)
    # bad input names the file
    (tmp_path / "short").write_text("a b\n")
    assert main(args + ["--compare", str(tmp_path / "short")]) == 2
    assert f"short:2: line counts differ: {tmp_path / 'short'} has 1 line, {tmp_path / 'better'}" \
        in capsys.readouterr().err  # the shorter file, at the first line it lacks
    assert main(["score", "--ref", str(tmp_path / "ref"), str(tmp_path / "ref"), "--hyp", str(tmp_path / "better"),
                 "--compare", str(tmp_path / "worse")]) == 2
    assert "one reference file, not 2" in capsys.readouterr().err


def test_same_resampled_sets_as_sacrebleu_paired_bs_but_a_one_sided_p(shared_data):
    """With sacreBLEU's seed (12345) and sample count, ``paired_bootstrap`` draws sacreBLEU ``--paired-bs``'s
    sets: each system's mean over them is sacreBLEU's "mean". Its p-value is Koehn's one-sided share of sets on
    which the system does not win; sacreBLEU's is two-sided, (#{|Δ_s| - mean|Δ| > |Δ|} + 1) / (n + 1), which the
    same samples reproduce. 400 newstest2014 En-De references, two systems that each drop
    a different seventh of the words (BLEU 65.5 and 64.9)."""
    from sacrebleu.metrics import BLEU
    from sacrebleu.significance import PairedTest
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    refs = _read(shared_data / "wmt14-newstest/newstest2014-deen.de.gz", 400)
    a = [" ".join(w for j, w in enumerate(r.split()) if (i + j) % 7) for i, r in enumerate(refs)]
    b = [" ".join(w for j, w in enumerate(r.split()) if (i + 2 * j + 1) % 7) for i, r in enumerate(refs)]
    n = 300
    test = PairedTest([("b", b), ("a", a)], {"BLEU": BLEU(references=[refs])}, None, test_type="bs", n_samples=n)
    theirs = test()[1]["BLEU"][1]  # system a against baseline b
    tok = Tokenizer13a()
    bs = paired_bootstrap({"a": [tok(h) for h in a], "b": [tok(h) for h in b]}, [tok(r) for r in refs], n_samples=n)
    # sacreBLEU's resampled statistics are float32 (integer sums below 2^24: exact), so each of the 4 precisions
    # and r/c is rounded by at most u = 2^-24 relative: log BLEU is off by at most u + 1.2u (r/c < 1.2 here)
    assert float(np.mean(bs.samples["a"])) == pytest.approx(theirs.mean, rel=4 * 2.0 ** -24)
    assert bs.full["a"] == pytest.approx(theirs.score, rel=1e-12)  # the full set: float64 on both sides
    d = np.abs(bs.samples["a"] - bs.samples["b"])
    two_sided = (np.sum(d - d.mean() > abs(bs.full["a"] - bs.full["b"])) + 1) / (n + 1)
    assert two_sided == pytest.approx(theirs.p_value, abs=1 / (n + 1))  # that rounding may move one set
    assert 0.01 < theirs.p_value < 0.5 and bs.p_value("a", "b") == float(np.mean(bs.samples["a"] <= bs.samples["b"]))


def test_cli_score_compare_says_it_lowercased(tmp_path, capsys, shared_data):
    """With --lc, the bootstrap scores lowercased text: its line says so, as the scores beside it are -lc ones."""
    from aiayn.cli import main
    from aiayn.evaluate.bleu import sacre_bleu
    refs = _read(shared_data / "multi30k/raw/test_2016_flickr.de.gz", 100)
    hyp = [r.upper() if i % 2 else " ".join(r.split()[:-1]) for i, r in enumerate(refs)]
    for name, lines in (("ref", refs), ("hyp", hyp), ("other", refs)):
        (tmp_path / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    args = ["score", "--ref", str(tmp_path / "ref"), "--hyp", str(tmp_path / "hyp"), "--samples", "50",
            "--compare", str(tmp_path / "other"), "--lc"]
    assert main(args) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("paired bootstrap (50 sets, 13a tokens, lowercased, no smoothing)")
    assert f"{sacre_bleu(hyp, refs, lowercase=True).score:.2f}" in line
    assert main(args + ["--tokenized"]) == 0
    assert "(50 sets, given tokens, lowercased, no smoothing)" in capsys.readouterr().out.splitlines()[-1]
