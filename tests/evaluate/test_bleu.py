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
    # perl -ple reads bytes: a match ends inside a two-byte letter, so the next one starts at its second byte
    ("vis-à-vis", "vis ##AT##-##AT## à ##AT##-##AT## vis"),  # newstest2014 En-Fr, checked with perl
    ("c&apos; est-à-dire", "c&apos; est ##AT##-##AT## à ##AT##-##AT## dire"),
    ("Groß-ö-Ä", "Groß ##AT##-##AT## ö ##AT##-##AT## Ä"),
    ("x\u00a0-y", "x\u00a0 ##AT##-##AT## y"),  # a no-break space is two non-space bytes to perl
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
    assert f"{tmp_path / 'short'}:2: line counts differ: {tmp_path / 'short'} has 1 line, {tmp_path / 'hyp'} has" in err
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


def _multi_bleu_perl(hyps: list[str], refs: list[list[str]], lc: bool = False) -> tuple[float, int, int]:
    """multi-bleu.perl's rules, written out: UTF-8 bytes split at ASCII whitespace (Perl's ``split`` on
    undecoded text), ``lc`` of ASCII letters only, n-grams clipped by the most any reference has, the
    closest reference length (the shorter on a tie), corpus brevity penalty, no smoothing."""
    import re
    from collections import Counter

    def words(line):
        line = line.encode()
        return re.split(rb"[ \t\n\r\f\v]+", (re.sub(rb"[A-Z]", lambda m: m[0].lower(), line) if lc else line).strip())

    correct, total, c, r = [0] * 4, [0] * 4, 0, 0
    for i, hyp in enumerate(hyps):
        h = [w for w in words(hyp) if w]
        ref_words = [[w for w in words(stream[i]) if w] for stream in refs]
        r += min((abs(len(h) - len(rw)), len(rw)) for rw in ref_words)[1]
        c += len(h)
        for n in range(1, 5):
            hn = Counter(tuple(h[k:k + n]) for k in range(len(h) - n + 1))
            rn = Counter()
            for rw in ref_words:
                rn |= Counter(tuple(rw[k:k + n]) for k in range(len(rw) - n + 1))
            total[n - 1] += sum(hn.values())
            correct[n - 1] += sum(min(v, rn[g]) for g, v in hn.items())
    if not all(correct):
        return 0.0, c, r
    log_p = sum(math.log(m / t) for m, t in zip(correct, total)) / 4
    return 100 * math.exp(min(0.0, 1 - r / c) + log_p), c, r


def test_tokenized_bleu_is_multi_bleu_perl_on_moses_tokenized_text(shared_data):
    """IWSLT14 (lowercased, Moses-tokenized) and Multi30k references, words dropped, lines shuffled or emptied,
    one and two references: the score multi-bleu.perl's rules give, to float64 rounding of a few logs."""
    import gzip
    import random

    def read(path, n):
        with gzip.open(shared_data / path, "rt", encoding="utf-8") as f:
            return [line.rstrip("\n") for line, _ in zip(f, range(n))]

    rng = random.Random(3)
    for refs in (read("iwslt14-de-en-test/test.en.gz", 1500),
                 read("multi30k/tok/test_2016_flickr.lc.norm.tok.de.gz", 1000)):
        hyps = []
        for line in refs:
            w = [x for x in line.split() if rng.random() > 0.1]
            hyps.append("" if rng.random() < 0.05 else " ".join(rng.sample(w, len(w)) if rng.random() < 0.2 else w))
        second = [" ".join(line.split()[1:]) for line in refs]
        for streams in ([refs], [refs, second]):
            ours = tokenized_bleu(hyps, streams)
            score, c, r = _multi_bleu_perl(hyps, streams)
            assert ours.score == pytest.approx(score, rel=1e-12) and (ours.sys_len, ours.ref_len) == (c, r)
            assert 40 < score < 90


def test_tokenized_bleu_splits_and_lowercases_as_fairseq_score_not_multi_bleu_perl():
    """The two places multi-bleu.perl (bytes) and fairseq-score (Unicode text) part: ours is fairseq-score's."""
    nbsp = ["a\xa0b c d e f"]  # French typography: "Pourquoi\xa0?"
    assert tokenized_bleu(["a b c d e f"], nbsp).score == pytest.approx(100.0)
    assert _multi_bleu_perl(["a b c d e f"], [nbsp])[0] < 60
    cased = ["Über die Brücke geht er heute"]
    assert tokenized_bleu(["über die brücke geht er heute"], cased, lowercase=True).score == pytest.approx(100.0)
    assert _multi_bleu_perl(["über die brücke geht er heute"], [cased], lc=True)[0] < 80


def test_sacrebleu_tokenizes_a_chinese_target_as_sacrebleu_l_does(tmp_path, capsys):
    """`sacrebleu -l en-zh` scores with its zh tokenizer (a token per Chinese character): so does --lang zh.
    Hypothesis 我今天很高兴。 against 我今天非常高兴。: 6/7, 4/6, 2/5 and no 4-gram of 4,
    which exp smoothing makes 1/(2*4); BP exp(1 - 8/7). With 13a each is one word and nothing matches."""
    hyp, ref = ["我今天很高兴。"], ["我今天非常高兴。"]
    gold = 100 * math.exp(1 - 8 / 7) * (6 / 7 * 4 / 6 * 2 / 5 * 1 / 8) ** 0.25
    zh = sacre_bleu(hyp, ref, lang="zh")
    assert zh.score == pytest.approx(gold, rel=1e-12) and "tok:zh" in zh.signature
    assert sacre_bleu(hyp, ref).score == 0.0
    assert sacre_bleu(hyp, ref, lang="de").signature == sacre_bleu(hyp, ref).signature
    assert "tok:zh" in score_all(hyp, ref, lang="zh", lowercase=True)[1].signature  # -lc too
    (tmp_path / "ref").write_text(ref[0] + "\n", encoding="utf-8")
    (tmp_path / "hyp").write_text(hyp[0] + "\n", encoding="utf-8")
    args = ["score", "--ref", str(tmp_path / "ref"), "--hyp", str(tmp_path / "hyp"), "--lang", "zh"]
    assert main(args + ["--compare", str(tmp_path / "ref"), "--samples", "10"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"sacreBLEU: {gold:.2f}") and "tok:zh" in lines[0]
    assert lines[-1].startswith("paired bootstrap (10 sets, zh tokens, no smoothing)")
    import importlib.util
    if importlib.util.find_spec("MeCab") is None:  # sacreBLEU's ja-mecab not installed
        assert main(args[:-1] + ["ja"]) == 2
        err = capsys.readouterr().err
        assert "target language ja: sacreBLEU's tokenizer for it needs `pip install sacrebleu[ja]`" in err
        # evaluate says so before it loads a model or translates anything
        assert main(["evaluate", "--checkpoint", str(tmp_path / "none.pt"), "--src", str(tmp_path / "ref"),
                     "--ref", str(tmp_path / "ref"), "--lang", "ja"]) == 2
        assert "target language ja" in capsys.readouterr().err


@pytest.mark.parametrize("lang, ref, chosen", [
    (None, "newstest2014-fren.fr.gz", "fr"), ("de", "ref.fr", "de"), (None, "ref.txt", "de"), (None, "ref", "de"),
    (None, "dev.pt-BR", "pt"), (None, "test.FR", "fr"), (None, None, "de")])
def test_the_target_language_is_the_references_suffix_unless_given(lang, ref, chosen):
    from aiayn.evaluate.bleu import target_language
    assert target_language(lang, ref) == chosen


def test_score_tokenizes_for_the_language_the_reference_names(shared_data, tmp_path, capsys):
    """French references scored without --lang: Moses' French tokenizer (l' homme), as --lang fr,
    where the German one (the fallback) splits the apostrophe from both words (l ' homme)."""
    import gzip
    with gzip.open(shared_data / "wmt14-newstest" / "newstest2014-fren.fr.gz", "rt", encoding="utf-8") as f:
        refs = [next(f).strip() for _ in range(40)]
    assert any("'" in r for r in refs)
    hyps = [" ".join(r.split()[1:]) for r in refs]
    (tmp_path / "ref.fr").write_text("\n".join(refs) + "\n")
    (tmp_path / "ref").write_text("\n".join(refs) + "\n")
    (tmp_path / "hyp").write_text("\n".join(hyps) + "\n")

    def paper(*argv):
        assert main(["score", "--hyp", str(tmp_path / "hyp"), "--json", *argv]) == 0
        return json.loads(capsys.readouterr().out)[-1]

    named, given, german = paper("--ref", str(tmp_path / "ref.fr")), paper("--ref", str(tmp_path / "ref"), "--lang", "fr"), \
        paper("--ref", str(tmp_path / "ref"))
    assert named == given and named["signature"].startswith("pre:moses-fr+") and german["signature"].startswith("pre:moses-de+")
    assert named["ref_len"] < german["ref_len"]  # l' homme: 2 tokens; l ' homme: 3
