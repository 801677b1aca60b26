"""Paired significance tests for corpus BLEU: bootstrap resampling (Koehn, EMNLP 2004) and approximate
randomization (Riezler and Maxwell, 2005), as sacreBLEU's ``--paired-bs`` and ``--paired-ar``.

Two systems translate the same test set; is A's BLEU higher than B's by more than the choice of
sentences explains? Draw ``n_samples`` test sets of the same size from the sentences with
replacement, the same draws for every system, and compute each system's corpus BLEU on each. The
p-value of "A is better than B" is the share of draws on which A does not beat B (Koehn's, one-sided).

With the same seed (12345, sacreBLEU's default) and sample count the draws are sacreBLEU
``--paired-bs``'s, so each system's mean over them is its "mean"; its p-value is another test:
two-sided, (#{|Δ_s| - mean |Δ| > |Δ|} + 1) / (n_samples + 1) over the per-set differences Δ_s, and
its interval is mean ± half the 2.5-97.5% spread, where ours is the 2.5 and 97.5 percentiles.

Approximate randomization asks instead how often chance alone makes a difference as large: each trial
swaps each sentence's two translations with probability 1/2 and rescores both shuffled systems. With
the same seed and trial count (10,000 by default) the coin flips are sacreBLEU ``--paired-ar``'s, and
so is the p-value: two-sided, (#{trials with |Δ| > the observed |Δ|} + 1) / (n_trials + 1).

BLEU is computed from per-sentence sufficient statistics (clipped n-gram matches and hypothesis
n-gram counts for n = 1..4, hypothesis and reference lengths) over whitespace tokens, with no
smoothing: ``tokenized_bleu`` (multi-bleu / fairseq-score), the Multi30k metric, on the full set.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Hashable, Mapping, Sequence

import numpy as np

from aiayn.errors import UserError

MAX_ORDER = 4


def sentence_stats(hyp: str, ref: str) -> np.ndarray:
    """[m_1..m_4, t_1..t_4, |hyp|, |ref|]: clipped matches and hypothesis n-grams of each order (§ BLEU, Papineni
    et al. 2002), then the lengths, over whitespace tokens."""
    h, r = hyp.split(), ref.split()
    out = np.zeros(2 * MAX_ORDER + 2)
    for n in range(1, MAX_ORDER + 1):
        hn = Counter(tuple(h[i:i + n]) for i in range(len(h) - n + 1))
        rn = Counter(tuple(r[i:i + n]) for i in range(len(r) - n + 1))
        out[n - 1] = sum(min(c, rn[g]) for g, c in hn.items())
        out[MAX_ORDER + n - 1] = max(len(h) - n + 1, 0)
    out[-2], out[-1] = len(h), len(r)
    return out


def corpus_stats(hyps: Sequence[str], refs: Sequence[str]) -> np.ndarray:
    """(N, 10) sentence statistics; one reference per hypothesis."""
    if len(hyps) != len(refs):
        raise UserError(f"{len(hyps)} hypotheses but {len(refs)} references")
    return np.stack([sentence_stats(h, r) for h, r in zip(hyps, refs)]) if hyps else np.zeros((0, 2 * MAX_ORDER + 2))


def bleu_from_stats(stats: np.ndarray) -> np.ndarray:
    """Corpus BLEU (0-100) from summed statistics (..., 10): brevity penalty exp(min(0, 1 - r/c)) times the
    geometric mean of the 4 precisions; 0 where any order has no match (no smoothing)."""
    m, t = stats[..., :MAX_ORDER], stats[..., MAX_ORDER:2 * MAX_ORDER]
    c, r = stats[..., -2], stats[..., -1]
    with np.errstate(divide="ignore", invalid="ignore"):
        log_p = np.where(m > 0, np.log(np.where(m > 0, m, 1.0) / np.where(t > 0, t, 1.0)), -np.inf).mean(axis=-1)
        log_bp = np.where(c > 0, np.minimum(0.0, 1.0 - r / np.where(c > 0, c, 1.0)), -np.inf)
    return 100.0 * np.exp(log_bp + log_p)


@dataclass(frozen=True)
class PairedBootstrap:
    """Each system's BLEU on the full set and on every resampled set (same draws for all)."""

    full: dict[Hashable, float]
    samples: dict[Hashable, np.ndarray]  # (n_samples,) per system

    def p_value(self, a: Hashable, b: Hashable) -> float:
        """Share of resampled sets on which ``a`` does not score above ``b`` (one-sided: small = a is better)."""
        return float(np.mean(self.samples[a] <= self.samples[b]))


SAMPLES = 1000  # resampled sets, unless a caller asks for others (``aiayn score --samples``)


def format_p(p: float, n_samples: int) -> str:
    """A bootstrap p-value as printed: where no resampled set of ``n_samples`` reversed the order, p is
    below what they resolve, not 0: "< 1/n_samples"; else three decimals."""
    return f"< {1 / n_samples:.3g}" if p == 0 else f"{p:.3f}"


def paired_bootstrap(hyps: Mapping[Hashable, Sequence[str]], refs: Sequence[str], n_samples: int = SAMPLES,
                     seed: int = 12345) -> PairedBootstrap:
    """Koehn (2004)'s paired bootstrap over tokenized hypotheses of several systems against one tokenized
    reference. The draws depend only on ``seed`` and the set's size, so a result is reproducible."""
    if not hyps:
        raise UserError("paired bootstrap needs at least one system")
    stats = {k: corpus_stats(list(h), list(refs)) for k, h in hyps.items()}
    n = len(refs)
    # counts[s, i] = how often sentence i is in resampled set s: (n_samples, N) @ (N, 10) sums each set's statistics
    draws = np.random.default_rng(seed).integers(0, n, size=(n_samples, n))
    counts = np.zeros((n_samples, n))
    np.add.at(counts, (np.arange(n_samples)[:, None], draws), 1.0)
    return PairedBootstrap(full={k: float(bleu_from_stats(s.sum(axis=0))) for k, s in stats.items()},
                           samples={k: bleu_from_stats(counts @ s) for k, s in stats.items()})


AR_TRIALS = 10000  # sacreBLEU --paired-ar-n's default
_AR_CHUNK = 1000  # trials per matrix product: (1000, N) float64, 24 MB for newstest2014's 3,003 sentences


def approximate_randomization(a: Sequence[str], b: Sequence[str], refs: Sequence[str], n_trials: int = AR_TRIALS,
                              seed: int = 12345) -> tuple[float, float, float]:
    """Full-set BLEU of tokenized systems ``a`` and ``b`` against one tokenized reference, and the two-sided
    approximate randomization p-value of their difference: the share of ``n_trials`` shuffles (each sentence's
    pair swapped on a fair coin, sacreBLEU's draws for ``seed``) whose |ΔBLEU| exceeds the observed, +1 corrected.
    Swapping ``a`` and ``b`` gives the same p."""
    s_a, s_b = corpus_stats(list(a), list(refs)), corpus_stats(list(b), list(refs))  # (N, 10) each
    total_a, total_b = s_a.sum(axis=0), s_b.sum(axis=0)
    bleu_a, bleu_b = float(bleu_from_stats(total_a)), float(bleu_from_stats(total_b))
    observed = abs(bleu_a - bleu_b)
    # swap[t, i]: trial t gives sentence i's translation in b to the first shuffled system (sacreBLEU's pos_sel)
    swap = np.random.default_rng(seed).integers(2, size=(n_trials, len(refs)), dtype=bool)
    moved = s_b - s_a  # (N, 10): what a swap moves into the first system's sums (integers: exact in float64)
    larger = 0
    for start in range(0, n_trials, _AR_CHUNK):
        shift = swap[start:start + _AR_CHUNK].astype(np.float64) @ moved  # (C, 10)
        delta = np.abs(bleu_from_stats(total_a + shift) - bleu_from_stats(total_b - shift))  # (C,)
        larger += int(np.sum(delta > observed))
    return bleu_a, bleu_b, (larger + 1) / (n_trials + 1)


def compare_systems(hyps: list[str], others: dict[str, list[str]], refs: list[str], tokens: Callable[[str], str],
                    n_samples: int, test: str = "bs") -> list[dict]:
    """``aiayn score --compare``: ``hyps`` against each of ``others``, all as BLEU's ``tokens`` of each line
    (``aiayn.evaluate.bleu.bleu_tokens``). Per other system, both full-set BLEU scores, the difference and a
    p-value: ``test`` "bs" is the paired bootstrap over ``n_samples`` resampled sets (the one-sided p of "hyps is
    better", and the 95% interval of each score over the sets); "ar" approximate randomization over ``n_samples``
    trials (sacreBLEU's two-sided p)."""
    systems = {"hyp": [tokens(h) for h in hyps], **{name: [tokens(h) for h in other] for name, other in others.items()}}
    ref_tokens = [tokens(r) for r in refs]
    if test == "ar":
        out = []
        for name in others:
            hyp_bleu, bleu, p = approximate_randomization(systems["hyp"], systems[name], ref_tokens, n_samples)
            out.append({"system": name, "bleu": round(bleu, 2), "hyp_bleu": round(hyp_bleu, 2),
                        "difference": round(hyp_bleu - bleu, 2), "p_value": p})
        return out
    bs = paired_bootstrap(systems, ref_tokens, n_samples=n_samples)
    interval = {k: [round(float(np.percentile(v, q)), 2) for q in (2.5, 97.5)] for k, v in bs.samples.items()}
    return [{"system": name, "bleu": round(bs.full[name], 2), "hyp_bleu": round(bs.full["hyp"], 2),
             "difference": round(bs.full["hyp"] - bs.full[name], 2), "p_value": bs.p_value("hyp", name),
             "hyp_interval_95": interval["hyp"], "interval_95": interval[name]} for name in others]
