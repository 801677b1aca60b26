"""BLEU and chrF, each labelled with exactly how it was computed (§6.1, Table 2).

Three BLEU flavours, never to be mixed up in a report:

- ``sacre_bleu``: sacreBLEU's corpus BLEU on detokenized text (its own 13a tokenization; for a
  Chinese, Japanese or Korean target its zh, ja-mecab or ko-mecab, as ``sacrebleu -l xx-zh`` picks;
  any of its tokenizers when asked, as ``sacrebleu --tokenize``), with its signature. The number to
  compare across papers today.
- ``compound_split_bleu``: the paper's metric, as tensor2tensor's ``get_ende_bleu.sh`` computes
  it: Moses ``replace-unicode-punctuation`` and ``tokenizer.perl -l LANG`` on both sides (here
  via sacremoses), hyphenated compounds split as ``s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g``, then
  multi-bleu.perl (case-sensitive, no smoothing). sacremoses tokenizes as tokenizer.perl did in 2017, the
  paper's: a sentence-final "Bart." whose "Bart" is a non-breaking prefix keeps its period; tokenizer.perl
  splits it since November 2018 (mosesdecoder pull request 204), a token more on 8 of newstest2014's 3,003
  German references.
- ``tokenized_bleu``: multi-bleu / ``fairseq-score`` style BLEU on text that is already tokenized
  (e.g. lowercased Moses-tokenized Multi30k): whitespace tokens, no smoothing. Equal to sacreBLEU
  with ``tokenize='none', smooth_method='none', force=True``. Where multi-bleu.perl and fairseq-score
  disagree, it is fairseq-score: tokens end at any Unicode space (multi-bleu.perl reads bytes, so a
  no-break space, as in newstest2014's French references, joins two words there), and ``-lc``
  lowercases every letter (multi-bleu.perl's only ASCII ones: "Über" stays, which cost a lowercased
  system 0.36 BLEU on Moses-tokenized newstest2014 En-De). Both rules are written out and compared
  in tests/evaluate/test_bleu.py.

Beside them, sacreBLEU's chrF2 (``chrf``) and, when asked, its TER (``ter``: Snover et al. 2006's
translation edit rate, edits including block shifts over reference words; lower is better).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from aiayn.data.textio import suffix_language
from aiayn.errors import UserError

log = logging.getLogger(__name__)

_COMPOUND = re.compile(rb"(\S)-(\S)")  # on UTF-8 bytes, as perl -ple reads them: \s is ASCII whitespace


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


@dataclass(frozen=True)
class TerResult:
    """TER (0-100, lower is better): the fewest edits (insertions, deletions, substitutions and shifts of
    a block of words) that turn each hypothesis into its closest reference, over the reference words."""

    label: str
    score: float
    signature: str
    num_edits: int
    ref_length: float  # summed over sentences; with several references, each sentence's average

    def format(self) -> str:
        return (f"{self.label}: {self.score:.2f}  (edits={self.num_edits}, ref_len={self.ref_length:.10g})  "
                f"{self.signature}")


def _ref_streams(hyps: Sequence[str], refs: Sequence[str] | Sequence[Sequence[str]]) -> list[list[str]]:
    """One or several reference streams, each as long as the hypotheses."""
    streams = [list(refs)] if refs and isinstance(refs[0], str) else [list(r) for r in refs]
    if not streams:
        raise UserError("no reference given")
    for i, stream in enumerate(streams):
        if len(stream) != len(hyps):
            raise UserError(f"{len(hyps)} hypotheses but reference {i + 1} has {len(stream)} lines")
    return streams


# what each of sacreBLEU's tokenizers imports beyond sacreBLEU's own requirements (``pip install ...``)
_TOKENIZER_PACKAGES = {"ja-mecab": "sacrebleu[ja]", "ko-mecab": "sacrebleu[ko]", "intl": "regex",
                       "spm": "sentencepiece", "flores101": "sentencepiece", "flores200": "sentencepiece",
                       "spBLEU-1K": "sentencepiece"}


def target_language(lang: str | None, ref: str | Path | None, fallback: str = "de") -> str:
    """The target language scoring tokenizes for (Moses' tokenizer; sacreBLEU's for zh, ja, ko):
    ``lang`` (--lang), else the one the reference file's suffix names (newstest2014.fr: fr; its first
    subtag, lowercased), said in the log, else ``fallback``."""
    if lang:
        return lang
    named = suffix_language(ref) if ref is not None else None
    if named is None:
        return fallback
    named = re.split(r"[-_]", named)[0].lower()
    log.info("--lang %s: the suffix of %s (give --lang for another)", named, ref)
    return named


def sacre_metric(lang: str = "", tokenize: str | None = None, **kw):
    """sacreBLEU's BLEU with tokenizer ``tokenize``, else its default for target language ``lang`` (13a, or
    zh, ja-mecab, ko-mecab), as its command line chooses with ``--tokenize`` and ``-l``. A tokenizer whose
    package is missing, or whose SentencePiece model cannot be downloaded, is a ``UserError`` naming it."""
    from sacrebleu.metrics import BLEU

    if tokenize is not None and tokenize not in BLEU.TOKENIZERS:
        raise UserError(f"--tokenize {tokenize}: not a sacreBLEU tokenizer (one of {', '.join(BLEU.TOKENIZERS)})")
    name = tokenize or BLEU._TOKENIZER_MAP.get(lang, BLEU.TOKENIZER_DEFAULT)
    which = f"target language {lang}: sacreBLEU's tokenizer for it" if tokenize is None else f"--tokenize {name}"
    try:
        return BLEU(trg_lang=lang, tokenize=tokenize, **kw)
    except (RuntimeError, ImportError) as exc:  # "pip install sacrebleu[ja]", "... sentencepiece"
        why = str(exc).strip().splitlines()[0]
        raise UserError(f"{which} needs `pip install {_TOKENIZER_PACKAGES.get(name, 'sacrebleu')}` ({why})") from None
    except (OSError, SystemExit) as exc:  # the SentencePiece model, fetched into sacreBLEU's cache on first use
        from sacrebleu.utils import SACREBLEU_DIR
        raise UserError(f"{which}: sacreBLEU could not download its SentencePiece model into "
                        f"{SACREBLEU_DIR}/models ({exc!r}); check the network") from None


def _given_tokens(tokenize: str | None) -> None:
    """Text already tokenized is scored by its whitespace tokens: no tokenizer to choose."""
    if tokenize is not None:
        raise UserError(f"--tokenize {tokenize} tokenizes detokenized text; --tokenized scores the given tokens")


def bleu_tokens(tokenized: bool, lowercase: bool, lang: str = "", tokenize: str | None = None):
    """The tokens BLEU counts, as a function of a line, and their name for a report ("13a tokens, lowercased"):
    the given whitespace tokens of tokenized text; else sacreBLEU's, after its -lc and right strip (``sacre_metric``
    picks the tokenizer)."""
    if tokenized:
        _given_tokens(tokenize)
        tok, name = (lambda line: line), "given"
    else:
        sacre_tok = sacre_metric(lang, tokenize).tokenizer
        tok, name = (lambda line: sacre_tok(line.rstrip())), sacre_tok.signature()

    def prep(line: str) -> str:
        return tok(line.lower() if lowercase else line)
    return prep, f"{name} tokens" + (", lowercased" if lowercase else "")


def _bleu(label: str, hyps: Sequence[str], refs, prefix: str = "", lang: str = "", **kw) -> BleuResult:
    metric = sacre_metric(lang, **kw)
    res = metric.corpus_score(list(hyps), _ref_streams(hyps, refs))
    return BleuResult(label, res.score, prefix + str(metric.get_signature()), tuple(res.precisions),
                      res.bp, res.sys_len, res.ref_len)


def sacre_bleu(hyps: Sequence[str], refs, lowercase: bool = False, lang: str = "",
               tokenize: str | None = None) -> BleuResult:
    """sacreBLEU corpus BLEU on detokenized text (defaults: 13a tokenization, exp smoothing; the
    tokenizer for a ``lang`` of zh, ja or ko as ``sacrebleu -l``, or ``tokenize`` as its --tokenize);
    ``lowercase`` is its -lc."""
    return _bleu("sacreBLEU -lc" if lowercase else "sacreBLEU", hyps, refs, lang=lang, tokenize=tokenize,
                 lowercase=lowercase)


def chrf(hyps: Sequence[str], refs) -> ChrfResult:
    """sacreBLEU chrF2 (character 6-grams, β = 2) on detokenized text."""
    from sacrebleu.metrics import CHRF

    metric = CHRF()
    res = metric.corpus_score(list(hyps), _ref_streams(hyps, refs))
    return ChrfResult("chrF2", res.score, str(metric.get_signature()))


def ter(hyps: Sequence[str], refs) -> TerResult:
    """sacreBLEU's TER with its defaults (``sacrebleu -m ter``: tercom's rules, case-insensitive, no
    normalization, so whitespace tokens): total edits / total reference words."""
    from sacrebleu.metrics import TER

    metric = TER()
    res = metric.corpus_score(list(hyps), _ref_streams(hyps, refs))
    return TerResult("TER", res.score, str(metric.get_signature()), res.num_edits, res.ref_length)


def tokenized_bleu(hyps: Sequence[str], refs, lowercase: bool = False,
                   label: str = "tokenized BLEU (multi-bleu/fairseq-score style, given tokens)",
                   prefix: str = "") -> BleuResult:
    """BLEU over whitespace tokens of already tokenized text, no smoothing (multi-bleu.perl;
    ``lowercase`` is its -lc)."""
    return _bleu(label, hyps, refs, prefix=prefix, tokenize="none", smooth_method="none",
                 force=True, lowercase=lowercase)


def split_compounds(line: str) -> str:
    """tensor2tensor's compound splitting: ``perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'``.

    Matches do not overlap, exactly as in Perl: "a-b-c" -> "a ##AT##-##AT## b-c". Perl matches bytes, not
    letters: a match ends at the first byte of a two-byte "à", the next starts at its second, so "vis-à-vis"
    -> "vis ##AT##-##AT## à ##AT##-##AT## vis"; and a no-break space is not a space to it. The hyphen is one
    byte, so what is inserted beside it always leaves valid UTF-8.
    """
    return _COMPOUND.sub(rb"\1 ##AT##-##AT## \2", line.encode("utf-8")).decode("utf-8")


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
              lowercase: bool = False, *, tokenize: str | None = None,
              with_ter: bool = False) -> list[BleuResult | ChrfResult | TerResult]:
    """Every metric that fits the input: detokenized text -> sacreBLEU (with ``tokenize``, else the tokenizer
    for ``lang``), chrF2 and the paper's compound-split BLEU; already tokenized text -> tokenized BLEU and its
    compound-split form. ``lowercase`` scores BLEU case-insensitively (-lc); for detokenized text,
    case-sensitive sacreBLEU stays first and sacreBLEU -lc is added (e.g. for a model trained lowercased).
    ``with_ter`` adds sacreBLEU's TER after the sacreBLEU scores, as ``sacrebleu -m bleu chrf ter`` orders them."""
    extra = [ter(hyps, refs)] if with_ter else []
    if tokenized:
        _given_tokens(tokenize)
        return [tokenized_bleu(hyps, refs, lowercase=lowercase), *extra,
                compound_split_bleu(hyps, refs, lang, tokenized=True, lowercase=lowercase)]
    lc = [sacre_bleu(hyps, refs, lowercase=True, lang=lang, tokenize=tokenize)] if lowercase else []
    return [sacre_bleu(hyps, refs, lang=lang, tokenize=tokenize), *lc, chrf(hyps, refs), *extra,
            compound_split_bleu(hyps, refs, lang)]
