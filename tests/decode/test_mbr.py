"""decode/mbr.py and DecodeConfig.mbr: sentence BLEU as sacreBLEU computes it, expected utilities
by hand, and the Translator's MBR order against the beam's n-best list."""
import math
import random

import pytest
from sacrebleu.metrics import BLEU

from aiayn.config import ConfigError
from aiayn.decode.config import DecodeConfig
from aiayn.decode.mbr import expected_utilities, mbr_order, ngram_counts, sentence_bleu
from aiayn.decode.loading import load_model_for_inference
from aiayn.decode.translator import Translator

LINES = ["A man rides a bike.", "Two dogs play in the snow.", "A girl eats.", "",
         "People are walking down a busy street in the city.", "A woman is cooking dinner in the kitchen.",
         "An old man sits on a bench reading a newspaper."]


def test_sentence_bleu_is_sacrebleus():
    bleu = BLEU(effective_order=True)
    words = "ein Mann eine Frau Hund . , läuft im Park auf der Straße zwei Kinder spielen".split()
    rng = random.Random(0)
    for _ in range(500):
        hyp = " ".join(rng.choice(words) for _ in range(rng.randint(0, 9)))
        ref = " ".join(rng.choice(words) for _ in range(rng.randint(1, 9)))
        assert sentence_bleu(ngram_counts(hyp), ngram_counts(ref)) == pytest.approx(
            bleu.sentence_score(hyp, [ref]).score, abs=1e-9), (hyp, ref)


def test_sentence_bleu_golden():
    # "a b c d" against "a b c e": matches 3/4, 2/3, 1/2, 0/1 -> the 4-gram precision is
    # exp-smoothed to 100 / (2 * 1); lengths equal, no brevity penalty.
    want = (75 * (200 / 3) * 50 * 50) ** 0.25  # 59.4604
    assert sentence_bleu(ngram_counts("a b c d"), ngram_counts("a b c e")) == pytest.approx(want)
    assert want == pytest.approx(59.4604, abs=1e-4)
    assert sentence_bleu(ngram_counts("a b c d"), ngram_counts("x y z w")) == 0.0
    assert sentence_bleu(ngram_counts("a b c d"), ngram_counts("a b c d")) == pytest.approx(100.0)
    # shorter hypothesis: brevity penalty exp(1 - 4/2); "a b" against "a b c d": precisions 100, 100
    assert sentence_bleu(ngram_counts("a b"), ngram_counts("a b c d")) == pytest.approx(math.exp(1 - 2) * 100)


def test_expected_utilities_golden():
    texts = ["a b c d", "a b c e", "x y z w"]
    b = (75 * (200 / 3) * 50 * 50) ** 0.25
    # model probabilities 0.3, 0.3, 0.4: the most probable candidate is not the MBR choice
    u = expected_utilities(texts, [math.log(0.3), math.log(0.3), math.log(0.4)])
    assert u == pytest.approx([30 + 0.3 * b, 0.3 * b + 30, 40.0])
    assert mbr_order(texts, [math.log(0.3), math.log(0.3), math.log(0.4)]) == [0, 1, 2]  # tie: beam order
    # 0.2, 0.3, 0.5: now it is
    assert mbr_order(texts, [math.log(0.2), math.log(0.3), math.log(0.5)]) == [2, 1, 0]
    # only differences of log-probabilities matter
    assert expected_utilities(texts, [-1000.0, -1000.0, -999.0]) == pytest.approx(
        expected_utilities(texts, [0.0, 0.0, 1.0]))


def test_mbr_does_not_combine_with_sampling():
    with pytest.raises(ConfigError, match="mbr"):
        DecodeConfig(mbr=True, sampling=True)


def test_translator_mbr_reorders_the_beam(tiny_checkpoint):
    model, src_tok, tgt_tok = load_model_for_inference(tiny_checkpoint)
    base = dict(beam_size=4, max_len_b=8, batch_tokens=40)
    beam = Translator(model, src_tok, tgt_tok, DecodeConfig(**base, nbest=4)).translate_nbest(LINES)
    mbr_all = Translator(model, src_tok, tgt_tok, DecodeConfig(**base, nbest=4, mbr=True)).translate_nbest(LINES)
    mbr_one = Translator(model, src_tok, tgt_tok, DecodeConfig(**base, mbr=True))
    firsts = mbr_one.translate(LINES)
    moved = 0
    for ts, ms, first in zip(beam, mbr_all, firsts):
        if not ts:
            assert ms == [] and first == ""
            continue
        order = mbr_order([t.text for t in ts], [t.log_prob for t in ts])
        assert [m.tokens for m in ms] == [ts[j].tokens for j in order]  # a permutation of the beam's list
        assert first == ms[0].text
        moved += order != list(range(len(ts)))
    assert moved  # the MBR order differs from the beam's somewhere, so the test sees the choice
    assert len(mbr_one.translate_nbest(LINES)[0]) == 1  # nbest 1: only the MBR choice
