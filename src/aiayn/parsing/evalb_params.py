"""EVALB parameter files (Sekine & Collins 1997), e.g. the COLLINS.prm used to score WSJ parsing
(§6.3, Table 4 reports its F1).

A parameter file has one ``KEYWORD value`` per line; lines starting with ``#`` and lines shorter
than three characters are ignored, as EVALB does. Unlike EVALB, which warns and carries on, an
unknown keyword or a malformed value is an error here: a typo such as ``LABELLED 0`` would
otherwise change every number silently.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from aiayn.config import param
from aiayn.data.textio import decode_text, read_bytes, text_mode
from aiayn.errors import InputError, UserError

_INT_KEYS = {"DEBUG": "debug", "MAX_ERROR": "max_error", "CUTOFF_LEN": "cutoff_len", "LABELED": "labeled"}
_LIST_KEYS = {"DELETE_LABEL": "delete_labels", "DELETE_LABEL_FOR_LENGTH": "delete_labels_for_length",
              "QUOTE_LABEL": "quote_labels"}
_PAIR_KEYS = {"EQ_LABEL": "eq_labels", "EQ_WORD": "eq_words"}


@dataclasses.dataclass(frozen=True)
class EvalbParams:
    """The settings of one parameter file; the defaults are EVALB's own (no file given)."""

    debug: int = param(0, "DEBUG: 0 summary only; 1 or more also prints the per-sentence table")
    max_error: int = param(10, "MAX_ERROR: EVALB gives up when errors exceed this count by 2 (its `count++ > max`)")
    cutoff_len: int = param(40, "CUTOFF_LEN: the second summary block covers sentences this long or shorter")
    labeled: int = param(1, "LABELED: 1 a bracket must match in span and label, 0 in span only")
    delete_labels: tuple[str, ...] = param(
        (), "DELETE_LABEL: preterminals with these tags are removed with their words (punctuation); "
            "brackets with these labels (after function-tag trimming) are not scored")
    delete_labels_for_length: tuple[str, ...] = param(
        (), "DELETE_LABEL_FOR_LENGTH: preterminals not counted in the sentence length (for the cutoff)")
    quote_labels: tuple[str, ...] = param(
        (), "QUOTE_LABEL: tags of quote-like words (' \" /) that the bug-fixed EVALB re-inserts when "
            "gold and test disagree on whether they are deleted punctuation")
    eq_labels: tuple[tuple[str, str], ...] = param((), "EQ_LABEL: label pairs counted as equal (ADVP PRT)")
    eq_words: tuple[tuple[str, str], ...] = param((), "EQ_WORD: word pairs counted as equal")

    def is_deleted(self, label: str) -> bool:
        return label in self.delete_labels

    def labels_equal(self, a: str, b: str) -> bool:
        return a == b or (a, b) in self.eq_labels or (b, a) in self.eq_labels

    def words_equal(self, a: str, b: str) -> bool:
        return a == b or (a, b) in self.eq_words or (b, a) in self.eq_words


def parse_params(text: str, path: str | Path = "<params>") -> EvalbParams:
    """Parameters from the text of a ``.prm`` file (later lines add to lists, override numbers)."""
    ints: dict[str, int] = {}
    lists: dict[str, list] = {name: [] for name in (*_LIST_KEYS.values(), *_PAIR_KEYS.values())}
    for line_no, line in enumerate(text.split("\n"), start=1):
        line = line.rstrip()
        if line.startswith("#") or len(line) < 3:
            continue
        fields = line.split(None, 1)
        key, value = fields[0], (fields[1].strip() if len(fields) > 1 else "")
        if not value:
            raise InputError(path, line_no, f"{key} has no value")
        if key in _INT_KEYS:
            try:
                ints[_INT_KEYS[key]] = int(value)
            except ValueError:
                raise InputError(path, line_no, f"{key} needs an integer, got {value!r}") from None
        elif key in _LIST_KEYS:
            if len(value.split()) != 1:
                raise InputError(path, line_no, f"{key} takes one label per line, got {value!r}")
            lists[_LIST_KEYS[key]].append(value)
        elif key in _PAIR_KEYS:
            pair = value.split()
            if len(pair) != 2:
                raise InputError(path, line_no, f"{key} requires two values, got {value!r}")
            lists[_PAIR_KEYS[key]].append(tuple(pair))
        else:
            known = ", ".join([*_INT_KEYS, *_LIST_KEYS, *_PAIR_KEYS])
            raise InputError(path, line_no, f"unknown keyword {key!r} (known: {known})")
    return EvalbParams(**ints, **{k: tuple(v) for k, v in lists.items()})


def read_params(path: str | Path) -> EvalbParams:
    path = Path(path)
    try:
        data = read_bytes(path)
    except UserError as exc:
        raise UserError(f"{exc} (EVALB parameter file)") from None
    return parse_params(text_mode(decode_text(data, path)), path)


# The settings of COLLINS.prm, the standard for WSJ (used when no parameter file is given).
COLLINS = EvalbParams(
    debug=0, max_error=10, cutoff_len=40, labeled=1,
    delete_labels=("TOP", "-NONE-", ",", ":", "``", "''", "."),
    delete_labels_for_length=("-NONE-",),
    eq_labels=(("ADVP", "PRT"),),
)
