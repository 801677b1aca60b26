"""Paired approximate randomization (``aiayn score --compare --paired-ar``) against sacreBLEU ``--paired-ar``'s
own numbers on Multi30k test_2016 lines."""
from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from aiayn.cli import main
from aiayn.evaluate.significance import approximate_randomization, bleu_from_stats, corpus_stats


def _systems(shared_data, n=300):
    """300 references and two systems that each drop a different seventh of the words on one line in five,
    and are the same elsewhere: close enough that chance explains part of the difference."""
    with gzip.open(shared_data / "multi30k/raw/test_2016_flickr.de.gz", "rt", encoding="utf-8") as f:
        refs = [line.rstrip("\n") for line, _ in zip(f, range(n))]
    a = [" ".join(w for j, w in enumerate(r.split()) if (i + j) % 7) for i, r in enumerate(refs)]
    b = [" ".join(w for j, w in enumerate(r.split()) if (i + 2 * j + 1) % 7) if i % 5 == 0 else a[i]
         for i, r in enumerate(refs)]
    return refs, a, b


def _sacrebleu_ar(refs, a, b, n_trials, **bleu):
    """sacreBLEU's paired AR of ``a`` against baseline ``b``: (BLEU of b, BLEU of a, p)."""
    from sacrebleu.metrics import BLEU
    from sacrebleu.significance import PairedTest

    _, scores = PairedTest([("b", b), ("a", a)], {"BLEU": BLEU(references=[refs], **bleu)}, None, test_type="ar",
                           n_samples=n_trials)()
    base, system = scores["BLEU"]
    return base.score, system.score, system.p_value


def _near_ties(a_tok, b_tok, ref_tok, n_trials, observed) -> int:
    """Trials whose |ΔBLEU| lies within rounding of the observed one, recomputed one trial at a time on
    sacreBLEU's coin flips: only these may fall on the other side of ">" in two float64 implementations
    (every count is an exact integer on both sides; each BLEU is a few logs and an exp, within 1e-12 of
    100 relative to the other's, so a gap of 1e-9 cannot close)."""
    s_a, s_b = corpus_stats(a_tok, ref_tok), corpus_stats(b_tok, ref_tok)
    swap = np.random.default_rng(12345).integers(2, size=(n_trials, len(ref_tok)), dtype=bool).astype(np.float64)
    first, second = swap @ s_b + (1 - swap) @ s_a, (1 - swap) @ s_b + swap @ s_a  # (n_trials, 10) each
    assert (first[:, :4] > 0).all() and (second[:, :4] > 0).all()  # every order matched: smoothing changes nothing
    return int(np.sum(np.abs(np.abs(bleu_from_stats(first) - bleu_from_stats(second)) - observed) < 1e-9))


@pytest.mark.parametrize("tokenize,lowercase", [("13a", False), ("char", True)])
def test_approximate_randomization_is_sacrebleu_paired_ar(tokenize, lowercase, shared_data):
    """The same coin flips (seed 12345), scores and two-sided, +1 corrected p as sacreBLEU's; either order."""
    from aiayn.evaluate.bleu import bleu_tokens

    refs, a, b = _systems(shared_data)
    n = 1000
    base, system, p = _sacrebleu_ar(refs, a, b, n, tokenize=tokenize, lowercase=lowercase)
    tok, _ = bleu_tokens(False, lowercase, tokenize=tokenize)
    a_tok, b_tok, ref_tok = [tok(x) for x in a], [tok(x) for x in b], [tok(x) for x in refs]
    bleu_a, bleu_b, ours = approximate_randomization(a_tok, b_tok, ref_tok, n)
    assert bleu_a == pytest.approx(system, rel=1e-12) and bleu_b == pytest.approx(base, rel=1e-12)
    near = _near_ties(a_tok, b_tok, ref_tok, n, abs(bleu_a - bleu_b))
    assert ours == pytest.approx(p, abs=near / (n + 1) + 1e-15)  # + 1e-15: two ways of dividing the same integers
    assert approximate_randomization(b_tok, a_tok, ref_tok, n)[2] == ours
    assert 0.003 < p < 0.2  # a test that can go either way, not a foregone conclusion


def test_cli_score_compare_paired_ar(tmp_path, capsys, shared_data):
    """`aiayn score --compare B --paired-ar`: sacreBLEU --paired-ar's p, 10,000 trials unless --samples says."""
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    refs, a, b = _systems(shared_data)
    for name, lines in (("ref", refs), ("a", a), ("b", b)):
        (tmp_path / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    args = ["score", "--ref", str(tmp_path / "ref"), "--hyp", str(tmp_path / "a"), "--compare", str(tmp_path / "b"),
            "--paired-ar"]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "paired_bootstrap" not in out
    (row,) = out["paired_ar"]
    base, system, p = _sacrebleu_ar(refs, a, b, 10000)
    tok = [[Tokenizer13a()(x) for x in lines] for lines in (a, b, refs)]
    near = _near_ties(*tok, 10000, abs(system - base))
    assert row["system"] == str(tmp_path / "b") and row["p_value"] == pytest.approx(p, abs=near / 10001 + 1e-15)
    assert (row["hyp_bleu"], row["bleu"]) == (round(system, 2), round(base, 2))
    assert row["difference"] == round(system - base, 2)
    assert main(args + ["--samples", "500"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    _, _, p500 = _sacrebleu_ar(refs, a, b, 500)
    assert _near_ties(*tok, 500, abs(system - base)) == 0
    assert line == (f"paired approximate randomization (500 trials, 13a tokens, no smoothing): {tmp_path / 'a'} "
                    f"{system:.2f} vs {tmp_path / 'b'} {base:.2f}: difference {system - base:+.2f}, "
                    f"two-sided p = {p500:.4f}")
    assert main(args[:-3] + ["--paired-ar"]) == 2
    assert "--paired-ar tests --hyp against the --compare files: give --compare" in capsys.readouterr().err
