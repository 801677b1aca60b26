"""sacreBLEU's TER and its choice of BLEU tokenizer (``--ter``, ``--tokenize``) in ``aiayn score`` and
``aiayn evaluate``: golden TER values worked by hand, and sacreBLEU's own numbers on Multi30k lines."""
from __future__ import annotations

import gzip
import importlib.util
import json

import pytest

from aiayn.cli import main
from aiayn.errors import UserError
from aiayn.evaluate.bleu import sacre_bleu, score_all, ter


def _read(path, n):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line, _ in zip(f, range(n))]


def _perturbed(refs: list[str]) -> list[str]:
    """Each line changed a different way: a word dropped, two words swapped, upper case, a word added, or kept."""
    out = []
    for i, r in enumerate(refs):
        w = r.split()
        if i % 5 == 0:
            w = w[:-2] + w[-1:]
        elif i % 5 == 1 and len(w) > 3:
            w[1], w[3] = w[3], w[1]
        elif i % 5 == 2:
            w = [x.upper() for x in w]
        elif i % 5 == 3:
            w = w[:2] + ["Hund"] + w[2:]
        out.append(" ".join(w))
    return out


def _files(tmp_path, **streams) -> dict[str, str]:
    for name, lines in streams.items():
        (tmp_path / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {name: str(tmp_path / name) for name in streams}


@pytest.mark.parametrize("hyp,ref,edits", [
    ("a b c d", "a b x d", 1),  # one substitution
    ("a b c", "a b c d", 1),  # one insertion
    ("a b c d e f", "a b c d", 2),  # two deletions
    ("c d a b", "a b c d", 1),  # one shift of the block "c d" (without shifts: 4 edits)
    ("A B C D", "a b c d", 0),  # case-insensitive, as tercom
])
def test_ter_by_hand(hyp, ref, edits):
    """TER = edits / reference words: 4 words here, so each edit is 25 points."""
    res = ter([hyp], [ref])
    assert res.num_edits == edits and res.ref_length == 4.0
    assert res.score == pytest.approx(100 * edits / 4, abs=1e-12)


def test_ter_corpus_and_references_by_hand():
    # the corpus: (1 + 3) edits over (4 + 6) reference words; "x y z" lacks three of "x y z w v u"
    res = ter(["a b c d", "x y z"], ["a b x d", "x y z w v u"])
    assert (res.num_edits, res.ref_length, res.score) == (4, 10.0, pytest.approx(40.0))
    # two references: the closer one's edits (1, not 2) over the references' average length (4 + 6) / 2
    res = ter(["a b c d"], [["a b x d"], ["a b c d e f"]])
    assert (res.num_edits, res.ref_length, res.score) == (1, 5.0, pytest.approx(20.0))
    assert res.signature.startswith("nrefs:2|case:lc|tok:tercom|")
    assert res.format().startswith("TER: 20.00  (edits=1, ref_len=5)  nrefs:2|")


def test_ter_is_sacrebleu_ter_on_multi30k(tmp_path, capsys, shared_data):
    """300 test_2016 references against a perturbed copy: `aiayn score --ter` prints sacreBLEU's TER and
    signature (`sacrebleu -m ter`), after chrF2 as sacreBLEU orders them; --json carries its edits."""
    from sacrebleu.metrics import TER

    refs = _read(shared_data / "multi30k/raw/test_2016_flickr.de.gz", 300)
    hyps = _perturbed(refs)
    metric = TER()
    theirs = metric.corpus_score(hyps, [refs])
    assert 5 < theirs.score < 30
    f = _files(tmp_path, ref=refs, hyp=hyps)
    args = ["score", "--ref", f["ref"], "--hyp", f["hyp"], "--ter"]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["label"] for r in out] == ["sacreBLEU", "chrF2", "TER", out[3]["label"]]
    assert out[2] == {"label": "TER", "score": theirs.score, "signature": str(metric.get_signature()),
                      "num_edits": theirs.num_edits, "ref_length": theirs.ref_length}
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == (f"TER: {theirs.score:.2f}  (edits={theirs.num_edits}, ref_len={theirs.ref_length:.10g})  "
                        f"{metric.get_signature()}")
    assert main(args + ["--tokenized", "--json"]) == 0  # given tokens: TER beside tokenized BLEU
    assert [r["label"] for r in json.loads(capsys.readouterr().out)][1] == "TER"
    assert main(args[:-1]) == 0  # opt-in
    assert "TER" not in capsys.readouterr().out


@pytest.mark.parametrize("tokenize", ["13a", "intl", "char", "none", "zh"])
def test_tokenize_is_sacrebleu_tokenize_on_multi30k(tokenize, shared_data):
    """`--tokenize NAME` scores as `sacrebleu --tokenize NAME`, cased and -lc, signature included."""
    from sacrebleu.metrics import BLEU

    refs = _read(shared_data / "multi30k/raw/test_2016_flickr.de.gz", 300)
    hyps = _perturbed(refs)
    for lc in (False, True):
        metric = BLEU(tokenize=tokenize, lowercase=lc)
        theirs = metric.corpus_score(hyps, [refs])
        ours = sacre_bleu(hyps, refs, lowercase=lc, tokenize=tokenize)
        assert ours.score == theirs.score and ours.signature == str(metric.get_signature())
        assert f"tok:{tokenize}|" in ours.signature


def test_tokenize_overrides_the_language_and_shows_in_the_signature(tmp_path, capsys):
    """--lang zh picks sacreBLEU's zh tokenizer (a token per Chinese character); --tokenize overrides it,
    in every BLEU that sacreBLEU tokenizes and in the paired test's tokens. 我今天很高兴。 against
    我今天非常高兴。 in characters: 6/7, 4/6, 2/5, 0/4 matched; 13a sees one word each, and no match."""
    import math

    hyp, ref = ["我今天很高兴。"], ["我今天非常高兴。"]
    char_gold = 100 * math.exp(1 - 8 / 7) * (6 / 7 * 4 / 6 * 2 / 5 * 1 / 8) ** 0.25  # exp smoothing: 0/4 -> 1/8
    f = _files(tmp_path, ref=ref, hyp=hyp)
    args = ["score", "--ref", f["ref"], "--hyp", f["hyp"], "--lang", "zh", "--lc", "--compare", f["ref"],
            "--samples", "10"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "tok:zh|" in lines[0] and "tok:zh|" in lines[1]
    assert main(args + ["--tokenize", "char"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"sacreBLEU: {char_gold:.2f}") and "tok:char|" in lines[0] and "tok:char|" in lines[1]
    assert lines[-1].startswith("paired bootstrap (10 sets, char tokens, lowercased, no smoothing)")
    assert main(args + ["--tokenize", "13a", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["scores"][0]["score"] == 0.0 and "tok:13a|" in out["scores"][0]["signature"]
    assert "tok:13a|" in out["scores"][1]["signature"]  # -lc too
    assert [r.signature for r in score_all(hyp, ref, "zh", tokenize="char")][0].count("tok:char") == 1


def test_a_tokenizer_that_cannot_run_is_refused_naming_its_package(tmp_path, capsys, monkeypatch):
    f = _files(tmp_path, ref=["a b c"], hyp=["a b c"])
    args = ["score", "--ref", f["ref"], "--hyp", f["hyp"]]
    assert main(args + ["--tokenize", "13b"]) == 2
    assert "--tokenize 13b: not a sacreBLEU tokenizer (one of " in capsys.readouterr().err
    assert main(args + ["--tokenize", "13a", "--tokenized"]) == 2
    assert "--tokenize 13a tokenizes detokenized text; --tokenized scores the given tokens" in capsys.readouterr().err
    for name, module, package in (("ja-mecab", "MeCab", "sacrebleu[ja]"), ("ko-mecab", "mecab_ko", "sacrebleu[ko]")):
        if importlib.util.find_spec(module) is None:  # not installed here
            assert main(args + ["--tokenize", name]) == 2
            assert f"--tokenize {name} needs `pip install {package}`" in capsys.readouterr().err
            # evaluate says so before it loads a model or translates anything
            assert main(["evaluate", "--checkpoint", str(tmp_path / "none.pt"), "--src", f["ref"], "--ref", f["ref"],
                         "--tokenize", name]) == 2
            assert f"--tokenize {name} needs `pip install {package}`" in capsys.readouterr().err
    # the SentencePiece tokenizers fetch their model on first use: a failed download says where and why
    import urllib.error

    from sacrebleu.tokenizers import tokenizer_spm

    def offline(url, path):
        raise urllib.error.URLError("no network")
    monkeypatch.setattr(tokenizer_spm, "download_file", offline)
    monkeypatch.setattr(tokenizer_spm, "SACREBLEU_DIR", str(tmp_path / "sacrebleu"))
    with pytest.raises(UserError, match=r"--tokenize flores200: sacreBLEU could not download its SentencePiece model "
                                        r".*no network.*check the network"):
        sacre_bleu(["a"], ["a"], tokenize="flores200")


def test_evaluate_passes_tokenize_and_ter_through(untrained_checkpoint, tmp_path, capsys):
    """`aiayn evaluate --tokenize char --ter` scores its translations as `aiayn score` does with the same options."""
    src, ref = ["the house is small", "a cat sat on the mat today", "small"], ["das haus", "eine katze", "klein"]
    f = _files(tmp_path, src=src, ref=ref)
    args = ["evaluate", "--checkpoint", str(untrained_checkpoint), "--src", f["src"], "--ref", f["ref"],
            "--max-len-b", "2", "--beam-size", "1", "--c-kernels", "false", "--device", "cpu",
            "--out", str(tmp_path / "hyp"), "--json", "--tokenize", "char", "--ter"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)["scores"]
    hyps = (tmp_path / "hyp").read_text(encoding="utf-8").splitlines()
    expected = score_all(hyps, ref, "de", tokenize="char", with_ter=True)
    assert [(r["label"], r["score"], r["signature"]) for r in out] == [(r.label, r.score, r.signature) for r in expected]
    assert "tok:char|" in out[0]["signature"] and out[2]["label"] == "TER"


def test_evaluate_tokenizes_for_the_language_the_reference_names(untrained_checkpoint, tmp_path, capsys):
    """--ref ref.fr without --lang: the paper's metric tokenizes as Moses does French."""
    src, ref = ["the house is small", "a cat"], ["l'homme est petit", "c'est un chat"]
    f = _files(tmp_path, src=src, ref=ref)
    (tmp_path / "ref.fr").write_text("\n".join(ref) + "\n")
    assert main(["evaluate", "--checkpoint", str(untrained_checkpoint), "--src", f["src"], "--ref",
                 str(tmp_path / "ref.fr"), "--max-len-b", "2", "--beam-size", "1", "--c-kernels", "false",
                 "--device", "cpu", "--json"]) == 0
    paper = json.loads(capsys.readouterr().out)["scores"][-1]
    assert paper["signature"].startswith("pre:moses-fr+compound-split")
