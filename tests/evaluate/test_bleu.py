"""Golden BLEU / chrF values computed by hand, and tensor2tensor's compound splitting."""
from __future__ import annotations

import json
import math

import pytest

from aiayn.cli import main
from aiayn.errors import UserError
from aiayn.evaluate.bleu import (chrf, compound_split_bleu, moses_tokenize, sacre_bleu, score_all,
                                 split_compounds, tokenized_bleu)

# Two sentences. S1 "a b c d e" vs "a b c d f": 1-4 grams match 4/5, 3/4, 2/3, 1/2.
# S2 "x y" vs "x y z w": 2/2, 1/1, 0/0, 0/0. Corpus: 6/7, 4/5, 2/3, 1/2; lengths 7 vs 9.
HYPS = ["a b c d e", "x y"]
REFS = ["a b c d f", "x y z w"]
BP = math.exp(1 - 9 / 7)
GOLD = 100 * BP * (6 / 7 * 4 / 5 * 2 / 3 * 1 / 2) ** 0.25  # 51.96


def test_bleu_golden_corpus():
    for res in (sacre_bleu(HYPS, REFS), tokenized_bleu(HYPS, REFS)):
        assert res.score == pytest.approx(GOLD, abs=1e-9)
        assert res.bp == pytest.approx(BP)
        assert (res.sys_len, res.ref_len) == (7, 9)
        assert res.length_ratio == pytest.approx(7 / 9)
        assert res.precisions == pytest.approx((600 / 7, 80.0, 200 / 3, 50.0))
    assert "tok:13a" in sacre_bleu(HYPS, REFS).signature
    assert "tok:none" in tokenized_bleu(HYPS, REFS).signature


def test_no_4gram_match_smoothing_differs():
    # "the cat sat on the mat" vs "the cat is on the mat": 5/6, 3/5, 1/4, 0/3.
    hyp, ref = ["the cat sat on the mat"], ["the cat is on the mat"]
    assert tokenized_bleu(hyp, ref).score == 0.0  # multi-bleu: a zero precision gives 0
    # sacreBLEU's exp smoothing replaces 0/3 by 1/(2*3)
    expected = 100 * (5 / 6 * 3 / 5 * 1 / 4 * 1 / 6) ** 0.25
    assert sacre_bleu(hyp, ref).score == pytest.approx(expected)


def test_tokenized_bleu_is_case_sensitive_unless_lowercased():
    assert tokenized_bleu(["A b c d"], ["a b c d"]).score < 100
    assert tokenized_bleu(["A b c d"], ["a b c d"], lowercase=True).score == pytest.approx(100)


def test_tokenized_bleu_does_not_retokenize():
    # 13a would split "d." into "d ." and find a match; given tokens do not
    assert tokenized_bleu(["a b c d."], ["a b c d ."]).precisions[0] == pytest.approx(75.0)
    assert sacre_bleu(["a b c d."], ["a b c d ."]).score == pytest.approx(100.0)


def test_multiple_references():
    res = tokenized_bleu(["a b c d"], [["a b c e"], ["x b c d"]])
    # "a b c" matches reference 1 and "b c d" reference 2; the 4-gram matches neither
    assert res.precisions == pytest.approx((100.0, 100.0, 100.0, 0.0))
    assert res.score == 0.0


def test_chrf_golden():
    # "abcd" vs "abce": char 1-4 grams 3/4, 2/3, 1/2, 0/1 (orders 5, 6 absent); P = R = mean
    assert chrf(["abcd"], ["abce"]).score == pytest.approx(100 * (3 / 4 + 2 / 3 + 1 / 2 + 0) / 4)
    assert chrf(["ab cd"], ["abcd"]).score == pytest.approx(100.0)  # whitespace is ignored


@pytest.mark.parametrize("line,expected", [
    ("rich-text format", "rich ##AT##-##AT## text format"),
    ("Rich-Text-Format", "Rich ##AT##-##AT## Text ##AT##-##AT## Format"),
    ("a-b-c", "a ##AT##-##AT## b-c"),  # Perl's matches do not overlap
    ("a-b c-d", "a ##AT##-##AT## b c ##AT##-##AT## d"),
    ("- a -b c- --", "- a -b c- --"),
    ("a--b", "a ##AT##-##AT## -b"),  # checked with perl
])
def test_split_compounds_as_perl(line, expected):
    assert split_compounds(line) == expected


def test_compound_split_bleu_tokenizes_and_splits():
    hyps = ["Das Rich-Text-Format, gut."]
    refs = ["Das Rich-Text-Format, gut."]
    assert moses_tokenize(hyps, "de") == ["Das Rich-Text-Format , gut ."]
    res = compound_split_bleu(hyps, refs)
    # Das Rich ##AT##-##AT## Text ##AT##-##AT## Format , gut .  -> 9 tokens
    assert res.score == pytest.approx(100.0) and res.sys_len == 9
    assert res.signature.startswith("pre:moses-de+compound-split|")
    # a wrong compound part costs n-grams after splitting; unsplit it would be one wrong token
    split = compound_split_bleu(["ein Rich-Text-Feld ist da"], ["ein Rich-Text-Format ist da"])
    assert split.precisions[0] == pytest.approx(100 * 7 / 8)


def test_line_count_mismatch_is_a_user_error():
    with pytest.raises(UserError, match="2 hypotheses but reference 1 has 1"):
        sacre_bleu(HYPS, REFS[:1])


def test_score_all_labels():
    labels = [r.label for r in score_all(HYPS, REFS)]
    assert labels[0] == "sacreBLEU" and labels[1] == "chrF2" and "compound splitting" in labels[2]
    labels = [r.label for r in score_all(HYPS, REFS, tokenized=True)]
    assert labels[0].startswith("tokenized BLEU (multi-bleu")


def test_sacrebleu_lowercase_golden():
    """-lc: a lowercase system against cased references scores as if both were lowercase."""
    upper = ["A B C D F", "X Y Z W"]
    assert sacre_bleu(HYPS, upper).score == 0.0
    lc = sacre_bleu(HYPS, upper, lowercase=True)
    assert lc.score == pytest.approx(GOLD, abs=1e-9) and lc.label == "sacreBLEU -lc" and "case:lc" in lc.signature
    results = score_all(HYPS, upper, lowercase=True)
    assert [r.label for r in results][:2] == ["sacreBLEU", "sacreBLEU -lc"]
    assert results[0].score == 0.0 and results[1].score == pytest.approx(GOLD, abs=1e-9)


def test_cli_score(tmp_path, capsys, monkeypatch):
    (tmp_path / "ref").write_text("\n".join(REFS) + "\n")
    (tmp_path / "hyp").write_text("\n".join(HYPS) + "\n")
    assert main(["score", "--ref", str(tmp_path / "ref"), "--hyp", str(tmp_path / "hyp"), "--tokenized", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out[0]["score"] == pytest.approx(GOLD)
    import io
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(("\n".join(HYPS) + "\n").encode())))
    assert main(["score", "--ref", str(tmp_path / "ref")]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"sacreBLEU: {GOLD:.2f}") and "chrF2" in text and "paper's metric" in text
    assert main(["score", "--ref", str(tmp_path / "nope"), "--hyp", str(tmp_path / "hyp")]) == 2
    assert "nope: no such file" in capsys.readouterr().err
    (tmp_path / "latin1").write_bytes("\n".join(HYPS[:-1] + ["caf\xe9"]).encode("latin-1") + b"\n")
    assert main(["score", "--ref", str(tmp_path / "ref"), "--hyp", str(tmp_path / "latin1")]) == 2
    assert (f"{tmp_path / 'latin1'}:{len(HYPS)}: invalid UTF-8 (byte 4 of the line: b'\\xe9\\n')"
            in capsys.readouterr().err)  # counted as prepare and translate count it: line and byte from 1
    (tmp_path / "short").write_text("a b\n")
    assert main(["score", "--ref", str(tmp_path / "short"), "--hyp", str(tmp_path / "hyp")]) == 2
    err = capsys.readouterr().err  # the shorter file, at the first line it lacks
    assert f"{tmp_path / 'short'}:2: line counts differ: {tmp_path / 'short'} has 1 lines, {tmp_path / 'hyp'} has" in err
    (tmp_path / "empty").write_text("")
    for extra in ([], ["--json"], ["--tokenized"], ["--compare", str(tmp_path / "empty")]):
        assert main(["score", "--ref", str(tmp_path / "empty"), "--hyp", str(tmp_path / "empty"), *extra]) == 2
        assert f"{tmp_path / 'empty'} and {tmp_path / 'empty'} have no lines: nothing to score" in capsys.readouterr().err


def test_lowercase_applies_to_both_bleus_of_tokenized_text():
    """score --tokenized --lc: the tokenized BLEU and its compound-split form both -lc."""
    refs = [["ein kleines haus-boot am see .", "zwei hunde spielen im schnee ."]]
    hyps = [r.upper() for r in refs[0]]
    plain, split = score_all(hyps, refs, tokenized=True, lowercase=True)
    assert plain.score == pytest.approx(100.0) and split.score == pytest.approx(100.0)  # (exp of a sum of logs)
    assert score_all(hyps, refs, tokenized=True)[1].score == 0.0
