"""BLEU and chrF, each labelled with exactly how it was computed (§6.1, Table 2).

Three BLEU flavours, never to be mixed up in a report:

- ``sacre_bleu``: sacreBLEU's corpus BLEU on detokenized text (its own 13a tokenization; for a
  Chinese, Japanese or Korean target its zh, ja-mecab or ko-mecab, as ``sacrebleu -l xx-zh`` picks),
  with its signature. The number to compare across papers today.
- ``compound_split_bleu``: the paper's metric, as tensor2tensor's ``get_ende_bleu.sh`` computes
  it: Moses ``replace-unicode-punctuation`` and ``tokenizer.perl -l LANG`` on both sides (here
  via sacremoses), hyphenated compounds split as ``s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g``, then
  multi-bleu.perl (case-sensitive, no smoothing).
- ``tokenized_bleu``: multi-bleu / ``fairseq-score`` style BLEU on text that is already tokenized
  (e.g. lowercased Moses-tokenized Multi30k): whitespace tokens, no smoothing. Equal to sacreBLEU
  with ``tokenize='none', smooth_method='none', force=True``. Where multi-bleu.perl and fairseq-score
  disagree, it is fairseq-score: tokens end at any Unicode space (multi-bleu.perl reads bytes, so a
  no-break space, as in newstest2014's French references, joins two words there), and ``-lc``
  lowercases every letter (multi-bleu.perl's only ASCII ones: "Über" stays, which cost a lowercased
  system 0.36 BLEU on Moses-tokenized newstest2014 En-De). Both rules are written out and compared
  in tests/evaluate/test_bleu.py.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from aiayn.errors import UserError

_COMPOUND = re.compile(r"(\S)-(\S)")


@dataclass(frozen=True)
class BleuResult:
    """Corpus BLEU (0-100) with its n-gram precisions, brevity penalty and lengths."""

    label: str
    score: float
    signature: str
    precisions: tuple[float, ...]
    bp: float
    sys_len: int
    ref_len: int

    @property
    def length_ratio(self) -> float:
        """Hypothesis tokens / reference tokens: below 1 the brevity penalty applies."""
        return self.sys_len / self.ref_len if self.ref_len else 0.0

    def format(self) -> str:
        p = "/".join(f"{x:.1f}" for x in self.precisions)
        return (f"{self.label}: {self.score:.2f}  ({p}, BP={self.bp:.3f}, "
                f"hyp_len={self.sys_len}, ref_len={self.ref_len})  {self.signature}")


@dataclass(frozen=True)
class ChrfResult:
    label: str
    score: float
    signature: str

    def format(self) -> str:
        return f"{self.label}: {self.score:.2f}  {self.signature}"


def _ref_streams(hyps: Sequence[str], refs: Sequence[str] | Sequence[Sequence[str]]) -> list[list[str]]:
    """One or several reference streams, each as long as the hypotheses."""
    streams = [list(refs)] if refs and isinstance(refs[0], str) else [list(r) for r in refs]
    if not streams:
        raise UserError("no reference given")
    for i, stream in enumerate(streams):
        if len(stream) != len(hyps):
            raise UserError(f"{len(hyps)} hypotheses but reference {i + 1} has {len(stream)} lines")
    return streams


def sacre_metric(lang: str = "", **kw):
    """sacreBLEU's BLEU for target language ``lang``: its default tokenizer for it (13a, or zh, ja-mecab,
    ko-mecab), as its command line chooses with ``-l``; a tokenizer whose package is missing is a
    ``UserError`` naming the language."""
    from sacrebleu.metrics import BLEU

    try:
        return BLEU(trg_lang=lang, **kw)
    except RuntimeError as exc:  # sacreBLEU's "pip install sacrebleu[ja]" for the MeCab tokenizers
        raise UserError(f"target language {lang}: sacreBLEU's tokenizer for it needs `pip install "
                        f"sacrebleu[{lang}]` ({str(exc).strip().splitlines()[0]})") from None


def _bleu(label: str, hyps: Sequence[str], refs, prefix: str = "", lang: str = "", **kw) -> BleuResult:
    metric = sacre_metric(lang, **kw)
    res = metric.corpus_score(list(hyps), _ref_streams(hyps, refs))
    return BleuResult(label, res.score, prefix + str(metric.get_signature()), tuple(res.precisions),
                      res.bp, res.sys_len, res.ref_len)


def sacre_bleu(hyps: Sequence[str], refs, lowercase: bool = False, lang: str = "") -> BleuResult:
    """sacreBLEU corpus BLEU on detokenized text (defaults: 13a tokenization, exp smoothing; the
    tokenizer for a ``lang`` of zh, ja or ko as ``sacrebleu -l``); ``lowercase`` is its -lc."""
    return _bleu("sacreBLEU -lc" if lowercase else "sacreBLEU", hyps, refs, lang=lang, lowercase=lowercase)


def chrf(hyps: Sequence[str], refs) -> ChrfResult:
    """sacreBLEU chrF2 (character 6-grams, β = 2) on detokenized text."""
    from sacrebleu.metrics import CHRF

    metric = CHRF()
    res = metric.corpus_score(list(hyps), _ref_streams(hyps, refs))
    return ChrfResult("chrF2", res.score, str(metric.get_signature()))


def tokenized_bleu(hyps: Sequence[str], refs, lowercase: bool = False,
                   label: str = "tokenized BLEU (multi-bleu/fairseq-score style, given tokens)",
                   prefix: str = "") -> BleuResult:
    """BLEU over whitespace tokens of already tokenized text, no smoothing (multi-bleu.perl;
    ``lowercase`` is its -lc)."""
    return _bleu(label, hyps, refs, prefix=prefix, tokenize="none", smooth_method="none",
                 force=True, lowercase=lowercase)


def split_compounds(line: str) -> str:
    """tensor2tensor's compound splitting: ``perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'``.

    Matches do not overlap, exactly as in Perl: "a-b-c" -> "a ##AT##-##AT## b-c".
    """
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", line)


def moses_tokenize(lines: Sequence[str], lang: str) -> list[str]:
    """Moses replace-unicode-punctuation.perl then tokenizer.perl -l LANG (default escaping)."""
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    norm, tok = MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)
    return [tok.tokenize(norm.replace_unicode_punct(line), return_str=True) for line in lines]


def compound_split_bleu(hyps: Sequence[str], refs, lang: str = "de",
                        tokenized: bool = False, lowercase: bool = False) -> BleuResult:
    """The paper's BLEU (tensor2tensor get_ende_bleu.sh): Moses-tokenize (unless ``tokenized``),
    split hyphenated compounds, case-sensitive multi-bleu (``lowercase``: multi-bleu -lc)."""
    streams = _ref_streams(hyps, refs)
    if not tokenized:
        hyps = moses_tokenize(hyps, lang)
        streams = [moses_tokenize(s, lang) for s in streams]
    hyps = [split_compounds(h) for h in hyps]
    streams = [[split_compounds(r) for r in s] for s in streams]
    tok = "given" if tokenized else f"moses-{lang}"
    return tokenized_bleu(hyps, streams, label="tokenized BLEU with compound splitting (paper's metric)",
                          prefix=f"pre:{tok}+compound-split|", lowercase=lowercase)


def score_all(hyps: Sequence[str], refs, lang: str = "de", tokenized: bool = False,
              lowercase: bool = False) -> list[BleuResult | ChrfResult]:
    """Every metric that fits the input: detokenized text -> sacreBLEU, chrF2 and the paper's
    compound-split BLEU; already tokenized text -> tokenized BLEU and its compound-split form.
    ``lowercase`` scores BLEU case-insensitively (-lc); for detokenized text, case-sensitive
    sacreBLEU stays first and sacreBLEU -lc is added (e.g. for a model trained lowercased)."""
    if tokenized:
        return [tokenized_bleu(hyps, refs, lowercase=lowercase),
                compound_split_bleu(hyps, refs, lang, tokenized=True, lowercase=lowercase)]
    lc = [sacre_bleu(hyps, refs, lowercase=True, lang=lang)] if lowercase else []
    return [sacre_bleu(hyps, refs, lang=lang), *lc, chrf(hyps, refs), compound_split_bleu(hyps, refs, lang)]
