"""The Multi30k convention for BLEU: lowercased, punctuation-normalized, Moses-tokenized text
scored with tokenized BLEU (fairseq-score / multi-bleu), as the published baselines report it
(e.g. Wu et al. 2021, 41.02 on test_2016 En->De).

The data set ships that form of the references (``tok/*.lc.norm.tok.*``, made by its
``task1-tokenize.sh``: normalize-punctuation.perl, tokenizer.perl, lowercase.perl). A model
that outputs ordinary cased text is brought to the same form by ``lc_norm_tok`` (sacremoses:
normalize, tokenize with escaping, lowercase), which reproduces 999 of the 1,000 test_2016
German references exactly from the raw ones (tests/evaluate/test_multi30k.py).
"""
from __future__ import annotations

from typing import Sequence

from aiayn.evaluate.bleu import BleuResult, tokenized_bleu


def lc_norm_tok(lines: Sequence[str], lang: str) -> list[str]:
    """Moses normalize-punctuation + tokenizer (escaped, no aggressive dash splits) + lowercase."""
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    norm, tok = MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)
    return [tok.tokenize(norm.normalize(line), return_str=True, escape=True).lower() for line in lines]


def multi30k_bleu(hyps: Sequence[str], tok_refs: Sequence[str], lang: str) -> BleuResult:
    """Tokenized BLEU of detokenized hypotheses against the lowercased, tokenized references."""
    return tokenized_bleu(lc_norm_tok(hyps, lang), list(tok_refs),
                          label="Multi30k tokenized BLEU (lc.norm.tok, fairseq-score style)",
                          prefix=f"pre:moses-lc-norm-tok-{lang}|")
