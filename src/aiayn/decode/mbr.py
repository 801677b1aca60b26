"""Minimum Bayes risk (MBR) choice among the beam's hypotheses (not in the paper; ``DecodeConfig.mbr``).

The paper outputs the hypothesis with the best length-normalized score (§6.1): the mode of the
model's distribution, as far as beam search finds it. MBR (Kumar and Byrne, 2004; Eikema and
Aziz, 2020; Freitag et al., 2022) outputs instead the candidate that agrees most, in expectation,
with what the model would write, the expectation taken over the candidates themselves:

    ŷ = argmax_{h ∈ C} Σ_{r ∈ C} w_r · BLEU(h, r)        w_r = p(r | x) / Σ_{c ∈ C} p(c | x)

C is the list of K hypotheses beam search finished (K = beam size), p(r | x) = exp(Σ log p) of
each (the model's probability, not length-normalized), and BLEU(h, r) sentence-level BLEU of h
against r as sacreBLEU computes it (13a tokens, n-grams 1-4, ``exp`` smoothing, effective order;
``sentence_bleu`` here reproduces it from n-gram counts made once per candidate, tested against
sacreBLEU). A candidate is its own reference too, as in Kumar and Byrne's formulation.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Sequence

from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

MAX_ORDER = 4
_tokenize = Tokenizer13a()


def ngram_counts(text: str) -> tuple[int, list[Counter]]:
    """(number of 13a tokens, [Counter of n-grams for n = 1..4]) of a detokenized sentence."""
    words = _tokenize(text.rstrip()).split()
    counts = [Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1)) for n in range(1, MAX_ORDER + 1)]
    return len(words), counts


def sentence_bleu(hyp: tuple[int, list[Counter]], ref: tuple[int, list[Counter]]) -> float:
    """sacreBLEU's sentence BLEU (exp smoothing, effective order) from ``ngram_counts`` of both sides."""
    hyp_len, hyp_counts = hyp
    ref_len, ref_counts = ref
    correct = [sum(min(c, r[g]) for g, c in h.items()) for h, r in zip(hyp_counts, ref_counts)]
    total = [max(hyp_len - n, 0) for n in range(MAX_ORDER)]
    if not any(correct):
        return 0.0
    bp = 1.0 if hyp_len >= ref_len else (math.exp(1 - ref_len / hyp_len) if hyp_len > 0 else 0.0)
    log_sum, smooth, order = 0.0, 1.0, MAX_ORDER
    for n in range(MAX_ORDER):
        if total[n] == 0:
            break
        order = n + 1
        if correct[n] == 0:
            smooth *= 2
            p = 100.0 / (smooth * total[n])
        else:
            p = 100.0 * correct[n] / total[n]
        log_sum += math.log(p)
    return bp * math.exp(log_sum / order)


def expected_utilities(texts: Sequence[str], log_probs: Sequence[float]) -> list[float]:
    """Σ_r w_r · BLEU(h, r) for each candidate h (module docstring); w from the log-probabilities."""
    top = max(log_probs)
    w = [math.exp(lp - top) for lp in log_probs]  # the softmax, shifted for stability
    z = sum(w)
    stats = [ngram_counts(t) for t in texts]
    return [sum(wr / z * sentence_bleu(h, r) for wr, r in zip(w, stats)) for h in stats]


def mbr_order(texts: Sequence[str], log_probs: Sequence[float]) -> list[int]:
    """Indices of the candidates, highest expected utility first (ties keep the beam's order)."""
    u = expected_utilities(texts, log_probs)
    return sorted(range(len(texts)), key=lambda i: -u[i])
