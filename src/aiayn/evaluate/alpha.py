"""The length penalty α chosen on a validation set (§6.1 uses α = 0.6; the choice is made on
validation, never on test): translate once per α, then keep the paper's α unless another beats it
in Koehn's (2004) paired bootstrap."""
from __future__ import annotations

import time
from dataclasses import dataclass

from aiayn.evaluate.significance import SAMPLES, format_p
from aiayn.progress import progress_bar


@dataclass(frozen=True)
class ValidationSet:
    """The held-out sentences α is chosen on (§6.1: on validation, never on test): the source
    lines to translate, the references they are scored against (tokenized as the scorer expects,
    Multi30k's ``lc_norm_tok`` by default) and the target language code."""
    src_lines: list[str]
    tok_refs: list[str]
    tgt: str


def tune_alpha(translator, valid: ValidationSet, alphas: str, beam_size: int,
               report=lambda alpha, result: None, score=None,
               key: str = "valid_multi30k_bleu") -> tuple[dict[float, dict], dict[float, list[str]]]:
    """Translate ``valid.src_lines`` once per length penalty in ``alphas`` ("0.6,1.0,..."). Returns,
    per α, the Multi30k tokenized BLEU against ``valid.tok_refs`` (or ``score(hyps)``, a BleuResult,
    under ``key``), the length ratio (hypothesis / reference tokens, the brevity penalty's input)
    and the seconds taken; and, per α, the translations. Leaves ``translator.cfg`` at the last α."""
    from aiayn.decode.config import DecodeConfig
    from aiayn.evaluate.multi30k import multi30k_bleu
    score = score or (lambda hyps: multi30k_bleu(hyps, valid.tok_refs, valid.tgt))
    tuning, translations = {}, {}
    for alpha in [float(a) for a in alphas.split(",")]:
        translator.cfg = DecodeConfig(beam_size=beam_size, alpha=alpha)
        t0 = time.monotonic()
        with progress_bar(len(valid.src_lines), unit=" lines", desc=f"valid α={alpha}") as bar:
            translations[alpha] = hyps = translator.translate(valid.src_lines, progress=bar.update)
        bleu = score(hyps)
        tuning[alpha] = {key: round(bleu.score, 2), "length_ratio": round(bleu.length_ratio, 3),
                         "seconds": round(time.monotonic() - t0, 1)}
        report(alpha, tuning[alpha])
    return tuning, translations


def choose_alpha(translations: dict[float, list[str]], tok_refs: list[str], tgt: str, p_level: float,
                 n_samples: int = SAMPLES, tokenize=None) -> tuple[float, dict[float, float]]:
    """The length penalty to use on test, from validation translations at each α (insertion order; the first is
    the reference, §6.1's 0.6). "Keep the paper's decoding settings unless the validation set says otherwise":
    an α other than the reference is eligible only if its Multi30k BLEU beats the reference's with paired
    bootstrap p < ``p_level`` (Koehn 2004); of the eligible ones (and the reference) the highest-scoring one is
    chosen. ``p_level`` 0 chooses the highest-scoring α outright. ``tokenize`` (lines -> lines) brings the
    translations to the form of ``tok_refs``; by default Multi30k's ``lc_norm_tok``. Returns the α and, per α,
    its p-value against the reference (the others; none when ``p_level`` is 0)."""
    from aiayn.evaluate.multi30k import lc_norm_tok
    from aiayn.evaluate.significance import paired_bootstrap
    alphas = list(translations)
    ref_alpha = alphas[0]
    tokenize = tokenize or (lambda lines: lc_norm_tok(lines, tgt))
    bs = paired_bootstrap({a: tokenize(h) for a, h in translations.items()}, tok_refs,
                          n_samples=n_samples if p_level > 0 else 0)  # p-level 0 needs only the full-set scores
    if p_level <= 0:
        return max(alphas, key=lambda a: bs.full[a]), {}
    p = {a: bs.p_value(a, ref_alpha) for a in alphas[1:]}
    eligible = [ref_alpha] + [a for a in alphas[1:] if p[a] < p_level and bs.full[a] > bs.full[ref_alpha]]
    return max(eligible, key=lambda a: bs.full[a]), p


def p_values_text(p_values: dict[float, float], n_samples: int = SAMPLES) -> str:
    """``choose_alpha``'s p-values (of ``n_samples`` resampled sets, its default) as the demos print
    them: "1.0 0.281, 1.4 < 0.001"."""
    return ", ".join(f"{a} {format_p(p, n_samples)}" for a, p in p_values.items())
