"""EVALB's printed report, character for character: the per-sentence table and the summary.

Rounding is C's ``printf("%6.2f")``, which Python's ``format`` reproduces (both round the exact
binary value to nearest, ties to even). Where EVALB versions differ, we print what the outputs
shipped with EVALB show (``sample.rsl``, ``bug.rsl-new``): error and skip rows give the gold word
count, and the Cross column of the totals row gives the number of sentences *without* crossing
brackets (the summary's "Average crossing" is the real average). The summary includes the
``Bracketing FMeasure`` line of EVALB versions after 1997.
"""
from __future__ import annotations

from aiayn.parsing.evalb import EvalbResult, SentenceResult, Totals

HEADER = (
    "  Sent.                        Matched  Bracket   Cross        Correct Tag\n"
    " ID  Len.  Stat. Recal  Prec.  Bracket gold test Bracket Words  Tags Accracy\n"
)
RULE = "=" * 76


def format_row(r: SentenceResult) -> str:
    return (f"{r.line:4d}  {r.length:3d}    {r.status:d}  "
            f"{r.recall:6.2f} {r.precision:6.2f}   {r.match:3d}    {r.gold:3d}  {r.test:3d}    {r.crossing:3d}"
            f"   {r.words:4d}  {r.correct_tags:4d}   {r.tag_accuracy:6.2f}")


def format_totals_row(t: Totals) -> str:
    head = ""
    if t.gold > 0 and t.test > 0:
        head = (f"                {t.recall:6.2f} {t.precision:6.2f} {t.match:6d} {t.gold:6d} {t.test:4d}"
                f"  {t.no_crossing:5d}")
    return head + f"  {t.words:5d} {t.correct_tags:5d}   {t.tag_accuracy:6.2f}"


def format_table(result: EvalbResult) -> str:
    rows = [format_row(r) for r in result.sentences]
    return HEADER + RULE + "\n" + "".join(row + "\n" for row in rows) + RULE + "\n" + format_totals_row(result.all) + "\n"


def format_block(title: str, t: Totals) -> str:
    lines = [
        f"-- {title} --",
        f"Number of sentence        = {t.sentences:6d}",
        f"Number of Error sentence  = {t.error_sentences:6d}",
        f"Number of Skip  sentence  = {t.skip_sentences:6d}",
        f"Number of Valid sentence  = {t.valid:6d}",
        f"Bracketing Recall         = {t.recall:6.2f}",
        f"Bracketing Precision      = {t.precision:6.2f}",
        f"Bracketing FMeasure       = {t.fmeasure:6.2f}",
        f"Complete match            = {t.per_valid(t.complete):6.2f}",
        f"Average crossing          = {t.per_valid(t.crossing, scale=1.0):6.2f}",
        f"No crossing               = {t.per_valid(t.no_crossing):6.2f}",
        f"2 or less crossing        = {t.per_valid(t.two_or_less_crossing):6.2f}",
        f"Tagging accuracy          = {t.tag_accuracy:6.2f}",
    ]
    return "\n".join(lines) + "\n"


def format_summary(result: EvalbResult) -> str:
    return ("=== Summary ===\n\n" + format_block("All", result.all) + "\n"
            + format_block(f"len<={result.cutoff_len}", result.cut))


def format_report(result: EvalbResult) -> str:
    """The table followed by the summary, as EVALB prints them."""
    return format_table(result) + format_summary(result)
