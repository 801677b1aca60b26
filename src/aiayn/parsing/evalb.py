"""EVALB (Sekine & Collins 1997), the bracket scorer behind the WSJ F1 of §6.3 / Table 4,
re-implemented to give the same numbers, sentence by sentence.

Semantics (those of evalb.c, bug-fixed 2006 version, learned from its source and checked against
the outputs it ships, ``sample.rsl`` and ``bug.rsl-new``):

* Each line of the gold and test files is one bracketing; lines are paired by number.
* Reading: ``(TAG word)`` is a terminal; a terminal whose tag is a DELETE_LABEL (punctuation,
  ``-NONE-``) is dropped with its word. Every other bracket is a constituent spanning the kept
  words inside it. The gold *length* counts every terminal except DELETE_LABEL_FOR_LENGTH ones.
* A test line with no words is *skipped* (status 2). Different word counts (after the
  QUOTE_LABEL re-insertion of the bug fix) or different words (modulo EQ_WORD) make an *error*
  sentence (status 1), as does a reading error; neither enters the totals.
* Constituents spanning no words are dropped, labels are cut at the first ``-`` or ``=``
  (``NP-SBJ`` -> ``NP``), and DELETE_LABEL constituents (``TOP``) are dropped (EQ_LABEL applies).
* A gold constituent matches the first unmatched test constituent with the same span (and,
  if LABELED, a label equal modulo EQ_LABEL); each is matched at most once. A test constituent
  *crosses* if some gold constituent overlaps it without nesting. Tags are compared position by
  position (EQ_LABEL applies).
* Totals: recall = matched / gold, precision = matched / test, F = 2PR/(P+R), complete match
  when gold = test = matched, over valid sentences; again for gold length <= CUTOFF_LEN.
* EVALB stops when errors exceed MAX_ERROR (its test is ``count++ > MAX_ERROR``): here
  ``EvalbAborted``. A word standing outside ``(TAG word)`` makes EVALB loop on errors until
  then, so it aborts at once here.

Deliberate differences: no fixed limits (EVALB has 200 words and 200 brackets per sentence and
5000 characters per line; WSJ has a 249-word sentence); an unmatched ``)`` is an error here
(EVALB's behaviour there is undefined).
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Sequence

from aiayn.data.textio import decode_text, read_bytes
from aiayn.errors import UserError
from aiayn.parsing.evalb_params import EvalbParams

log = logging.getLogger(__name__)

OK, ERROR, SKIP = 0, 1, 2
_QUOTE_WORDS = ("'", '"', "/")


class EvalbAborted(UserError):
    """Too many error sentences (or unreadable input): EVALB would exit without a summary."""


@dataclasses.dataclass
class _Bracket:
    start: int
    end: int            # exclusive; -1 while open (and if never closed, as in EVALB)
    label: str
    deleted: bool = False
    matched: bool = False


@dataclasses.dataclass
class _QuoteTerm:
    word: str
    label: str
    index: int          # word position it has (or would have, if deleted)
    bracket: int        # number of brackets opened before it
    open_brackets: tuple[int, ...]


@dataclasses.dataclass
class _Bracketing:
    """One line as EVALB holds it: kept terminals, brackets, quote-like terminals, gold length."""

    words: list[str]
    tags: list[str]
    brackets: list[_Bracket]
    quotes: list[_QuoteTerm]
    length: int
    errors: list[str]


def _read_atom(text: str, i: int) -> tuple[str, int]:
    j = i
    while j < len(text) and not (text[j].isspace() or text[j] in "()"):
        j += 1
    return text[i:j], j


def _stray_word(text: str, i: int) -> str:
    return f"Reading sentence: {_read_atom(text, i)[0]!r} outside (LABEL word)"


def read_bracketing(text: str, params: EvalbParams) -> _Bracketing:
    """Parse one line the way EVALB's ``read_line`` does (module docstring)."""
    out = _Bracketing([], [], [], [], 0, [])
    stack: list[int] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
        elif c == "(":
            label, i = _read_atom(text, i + 1)
            if i < n and text[i].isspace():
                q = i
                while q < n and text[q].isspace():
                    q += 1
                word, q = _read_atom(text, q)
                if q < n and text[q] == ")":
                    _add_terminal(out, label, word, stack, params)
                    i = q + 1
                    continue
                if q >= n or text[q] != "(":
                    out.errors.append("More than two elements in a bracket")
            stack.append(len(out.brackets))
            out.brackets.append(_Bracket(len(out.words), -1, label))
        elif c == ")":
            if not stack:
                out.errors.append("Bracketing unbalance (too many close bracket)")
            else:
                out.brackets[stack.pop()].end = len(out.words)
            i += 1
        else:
            raise EvalbAborted(_stray_word(text, i))
    if stack:
        out.errors.append("Bracketing is unbalanced (too many open bracket)")
    return out


def _add_terminal(out: _Bracketing, label: str, word: str, stack: list[int], params: EvalbParams) -> None:
    if label not in params.delete_labels_for_length:
        out.length += 1
    if label in params.quote_labels and word in _QUOTE_WORDS:
        out.quotes.append(_QuoteTerm(word, label, len(out.words), len(out.brackets), tuple(stack)))
    if not params.is_deleted(label):
        out.words.append(word)
        out.tags.append(label)


def _reinsert(quote: _QuoteTerm, side: _Bracketing) -> None:
    """Put a deleted quote terminal back, widening the brackets around and after it."""
    side.words.insert(quote.index, quote.word)
    side.tags.insert(quote.index, quote.label)
    for k, b in enumerate(side.brackets):
        if k >= quote.bracket:
            b.start += 1
            b.end += 1
    for k in quote.open_brackets:
        side.brackets[k].end += 1


def _fix_quotes(gold: _Bracketing, test: _Bracketing, params: EvalbParams) -> None:
    """The bug fix: a quote-like word deleted on one side but kept (other tag) on the other is
    re-inserted where it was deleted, in EVALB's order."""
    for i, tq in enumerate(test.quotes):
        ind = tq.index
        for j, gq in enumerate(gold.quotes):
            if gq.index != ind or gq.label == tq.label:
                continue
            if params.is_deleted(gq.label) and not params.is_deleted(tq.label):
                _reinsert(gq, gold)
                for later in gold.quotes[j:]:
                    later.index += 1
            elif params.is_deleted(tq.label) and not params.is_deleted(gq.label):
                _reinsert(tq, test)
                for later in test.quotes[i:]:
                    later.index += 1


def _trim_label(label: str) -> str:
    for k, ch in enumerate(label):
        if ch in "-=":
            return label[:k]
    return label


def _massage(side: _Bracketing, params: EvalbParams) -> int:
    """Mark empty and DELETE_LABEL brackets deleted, trim labels; the number of brackets left."""
    for b in side.brackets:
        if b.start == b.end:
            b.deleted = True
            continue
        b.label = _trim_label(b.label)
        b.deleted = any(params.labels_equal(b.label, d) for d in params.delete_labels)
    return sum(not b.deleted for b in side.brackets)


def _crosses(g: _Bracket, t: _Bracket) -> bool:
    return ((g.start < t.start < g.end < t.end) or (t.start < g.start < t.end < g.end))


@dataclasses.dataclass(frozen=True)
class SentenceResult:
    """One row of EVALB's table."""

    line: int
    length: int           # gold length (for the cutoff)
    status: int           # 0 ok, 1 error, 2 skip
    match: int = 0
    gold: int = 0          # gold brackets scored
    test: int = 0          # test brackets scored
    crossing: int = 0
    words: int = 0
    correct_tags: int = 0
    errors: tuple[str, ...] = ()
    sides: tuple[str, ...] = ()  # each error's file: "gold", "test", or "both" (the pair's words)

    @property
    def recall(self) -> float:
        return 100.0 * self.match / self.gold if self.gold else 0.0

    @property
    def precision(self) -> float:
        return 100.0 * self.match / self.test if self.test else 0.0

    @property
    def tag_accuracy(self) -> float:
        return 100.0 * self.correct_tags / self.words if self.words else 0.0


def score_sentence(gold_text: str, test_text: str, params: EvalbParams, line: int = 1) -> SentenceResult:
    """EVALB's verdict on one gold/test line pair (``calc_result``). A reading error that aborts
    says which file's line it is in (``EvalbAborted.side``)."""
    gold = _read_side(gold_text, params, "gold")
    test = _read_side(test_text, params, "test")
    errors = gold.errors + test.errors
    sides = ["gold"] * len(gold.errors) + ["test"] * len(test.errors)
    status = ERROR if errors else OK
    failed = dict(line=line, length=gold.length, words=len(gold.words))
    if not test.words:
        return SentenceResult(status=SKIP, errors=tuple(errors), sides=tuple(sides), **failed)
    if len(gold.words) != len(test.words):
        _fix_quotes(gold, test, params)
        failed["words"] = len(gold.words)
        if len(gold.words) != len(test.words):
            errors.append(f"Length unmatch ({len(gold.words)}|{len(test.words)})")
            return SentenceResult(status=ERROR, errors=tuple(errors), sides=(*sides, "both"), **failed)
    for g, t in zip(gold.words, test.words):
        if not params.words_equal(g, t):
            errors.append(f"Words unmatch ({g}|{t})")
            return SentenceResult(status=ERROR, errors=tuple(errors), sides=(*sides, "both"), **failed)
    n_gold, n_test = _massage(gold, params), _massage(test, params)
    match = 0
    for g in gold.brackets:
        if g.deleted:
            continue
        for t in test.brackets:
            if (not t.deleted and not t.matched and (g.start, g.end) == (t.start, t.end)
                    and (not params.labeled or params.labels_equal(g.label, t.label))):
                g.matched = t.matched = True
                match += 1
                break
    live_gold = [g for g in gold.brackets if not g.deleted]
    crossing = sum(any(_crosses(g, t) for g in live_gold) for t in test.brackets if not t.deleted)
    correct = sum(params.labels_equal(g, t) for g, t in zip(gold.tags, test.tags))
    return SentenceResult(line, gold.length, status, match, n_gold, n_test, crossing,
                          len(gold.words), correct, tuple(errors), tuple(sides))


def _read_side(text: str, params: EvalbParams, side: str) -> _Bracketing:
    """``read_bracketing`` of the ``side`` ("gold" or "test") of a pair; an abort carries the side."""
    try:
        return read_bracketing(text, params)
    except EvalbAborted as exc:
        exc.side = side
        raise


@dataclasses.dataclass
class Totals:
    """EVALB's summary block over some sentences (all, or those within the cutoff length)."""

    sentences: int = 0
    error_sentences: int = 0
    skip_sentences: int = 0
    match: int = 0
    gold: int = 0
    test: int = 0
    complete: int = 0
    words: int = 0
    crossing: int = 0
    no_crossing: int = 0
    two_or_less_crossing: int = 0
    correct_tags: int = 0

    def add(self, r: SentenceResult) -> None:
        self.sentences += 1
        if r.status == ERROR:
            self.error_sentences += 1
            return
        if r.status == SKIP:
            self.skip_sentences += 1
            return
        self.match += r.match
        self.gold += r.gold
        self.test += r.test
        self.complete += r.gold == r.test == r.match
        self.words += r.words
        self.crossing += r.crossing
        self.no_crossing += r.crossing == 0
        self.two_or_less_crossing += r.crossing <= 2
        self.correct_tags += r.correct_tags

    @property
    def valid(self) -> int:
        return self.sentences - self.error_sentences - self.skip_sentences

    @property
    def recall(self) -> float:
        return 100.0 * self.match / self.gold if self.gold > 0 else 0.0

    @property
    def precision(self) -> float:
        return 100.0 * self.match / self.test if self.test > 0 else 0.0

    @property
    def fmeasure(self) -> float:
        """2PR/(P+R) from the unrounded percentages; NaN when both are 0, as EVALB prints."""
        p, r = self.precision, self.recall
        return 2 * p * r / (p + r) if p + r else float("nan")

    def per_valid(self, count: int, scale: float = 100.0) -> float:
        return scale * count / self.valid if self.valid > 0 else 0.0

    @property
    def tag_accuracy(self) -> float:
        return 100.0 * self.correct_tags / self.words if self.words > 0 else 0.0


@dataclasses.dataclass
class EvalbResult:
    sentences: list[SentenceResult]
    all: Totals
    cut: Totals
    cutoff_len: int
    errors: list[str]       # every error message, "line : message" as EVALB prints them


def evalb(gold_lines: Sequence[str], test_lines: Sequence[str], params: EvalbParams,
          gold_name: str = "gold", test_name: str = "test") -> EvalbResult:
    """Score ``test_lines`` against ``gold_lines`` (one bracketing per line), as EVALB does. Each
    warning and abort names the file and line it is about (both files for a pair's words)."""
    result = EvalbResult([], Totals(), Totals(), params.cutoff_len, [])

    def where(line: int, side: str) -> str:
        names = {"gold": [gold_name], "test": [test_name], "both": [gold_name, test_name]}[side]
        return " and ".join(f"{name}:{line}" for name in names)

    def error(line: int, message: str, side: str) -> None:
        result.errors.append(f"{line} : {message}")
        log.warning("%s: %s", where(line, side), message)
        if len(result.errors) - 1 > params.max_error:
            raise EvalbAborted(f"{where(line, side)}: {message}; more than MAX_ERROR="
                               f"{params.max_error} errors, EVALB stops here")

    for k, gold_text in enumerate(gold_lines):
        line = k + 1
        if k >= len(test_lines):
            error(line, "Number of lines unmatch (too many lines in gold file)", "gold")
            break
        try:
            r = score_sentence(gold_text, test_lines[k], params, line)
        except EvalbAborted as exc:
            raise EvalbAborted(f"{where(line, getattr(exc, 'side', 'gold'))}: {exc}") from None
        for message, side in zip(r.errors, r.sides):
            error(line, message, side)
        result.sentences.append(r)
        result.all.add(r)
        if r.length <= params.cutoff_len:
            result.cut.add(r)
    if len(test_lines) > len(gold_lines):
        error(len(gold_lines) + 1, "Number of lines unmatch (too many lines in test file)", "test")
    return result


def read_lines(path) -> list[str]:
    """The lines of a bracketing file (plain or gzip) as EVALB reads them (split at ``\\n`` only); a
    BOM dropped, invalid UTF-8 named by line (``aiayn.data.textio``)."""
    lines = decode_text(read_bytes(Path(path)), path).split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines
