"""Trees as token sequences, for parsing as sequence-to-sequence translation (§6.3, following
Vinyals et al. 2015, "Grammar as a Foreign Language").

Source: the sentence's words, space-separated. Target: a depth-first walk of the tree where a
phrase opens with ``(LABEL`` and closes with ``)LABEL``. Two linearizations (``LINEARIZATIONS``):

    words   Pierre Vinken will join the board .
    tree    (S (NP (NNP Pierre) (NNP Vinken)) (VP (MD will) (VP (VB join) (NP (DT the) (NN board)))) (. .))
    slots   (S (NP XX XX )NP (VP XX (VP XX (NP XX XX )NP )VP )VP XX )S                  (Vinyals et al.)
    words   (S (NP Pierre Vinken )NP (VP will (VP join (NP the board )NP )VP )VP . )S

``slots`` is Vinyals et al.'s: every word is the placeholder ``XX``, so the decoder must count
slots to know where it is in the sentence. ``words`` (our option) writes the words themselves;
constrained decoding forces each copy (``aiayn.parsing.constrain``), so the model only chooses
where brackets go, and its decoder always sees which word comes next. On the NLTK sample it
trains to a far higher F1 (docs/history.md, the parsing recipe).

Our choice, documented: POS tags are normalized to ``XX`` (as Vinyals et al. do) rather than
predicted, so the model spends its capacity on brackets, which are all that EVALB's F1 scores.
Delinearizing puts the source words back in the ``XX`` slots, in order, with caller-supplied POS
tags (the scoring pipeline passes the gold tags, so EVALB removes the same punctuation on both
sides; EVALB's tagging accuracy is then 100% by construction and says nothing).

Model output need not be well formed. ``delinearize`` always returns a tree over exactly the
source words and reports every repair it made; ``RepairStats`` counts them over a test set.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Iterable, Sequence

from aiayn.parsing.ptb import TOP
from aiayn.parsing.trees import Tree

WORD = "XX"
DEFAULT_TAG = "XX"
SLOTS, WORDS = "slots", "words"
LINEARIZATIONS = (SLOTS, WORDS)


def linearize(tree: Tree, linearization: str = SLOTS) -> list[str]:
    """The target token sequence of ``tree`` (module docstring): ``XX`` for each word (``slots``)
    or the word itself (``words``)."""
    if tree.is_preterminal:
        return [WORD if linearization == SLOTS else tree.word]
    out = [f"({tree.label}"]
    for child in tree.children:
        out += linearize(child, linearization)
    out.append(f"){tree.label}")
    return out


@dataclasses.dataclass(frozen=True)
class Delinearized:
    """A tree rebuilt from a target sequence; ``repairs`` names each fix (empty if well formed)."""

    tree: Tree
    repairs: tuple[str, ...]

    @property
    def repaired(self) -> bool:
        return bool(self.repairs)


def is_bracket(tok: str, side: str) -> bool:
    """``(LABEL`` or ``)LABEL`` with a label EVALB can read (no brackets, no spaces)."""
    return len(tok) > 1 and tok[0] == side and not any(c in "()" or c.isspace() for c in tok[1:])


class _Builder:
    """Rebuilds a tree token by token, recording each repair (``delinearize``)."""

    def __init__(self, words: Sequence[str], tags: Sequence[str], linearization: str = SLOTS):
        self.words, self.tags, self.slots = words, tags, linearization == SLOTS
        self.next_word = 0
        self.stack: list[tuple[str, list[Tree]]] = [(TOP, [])]   # [0] is the virtual root
        self.repairs: list[str] = []

    def feed(self, tok: str) -> None:
        if tok == WORD if self.slots else not (is_bracket(tok, "(") or is_bracket(tok, ")")):
            if self.next_word == len(self.words):
                self.repairs.append("extra word slot dropped")
                return
            i = self.next_word
            self.stack[-1][1].append(Tree(self.tags[i], word=self.words[i]))
            self.next_word += 1
        elif is_bracket(tok, "("):
            self.stack.append((tok[1:], []))
        elif is_bracket(tok, ")"):
            if len(self.stack) == 1:
                self.repairs.append("unopened bracket dropped")
                return
            if tok[1:] != self.stack[-1][0]:
                self.repairs.append("closing label mismatch")
            self.close()
        else:
            self.repairs.append("unknown token dropped")

    def close(self) -> None:
        label, children = self.stack.pop()
        if children:
            self.stack[-1][1].append(Tree(label, tuple(children)))
        else:
            self.repairs.append("empty constituent dropped")

    def finish(self) -> Tree:
        if len(self.stack) > 1:
            self.repairs.append("unclosed bracket closed")
            while len(self.stack) > 1:
                self.close()
        top = self.stack[0][1]
        if self.next_word < len(self.words):
            self.repairs.append("missing words attached at the end")
            rest = [Tree(self.tags[i], word=self.words[i]) for i in range(self.next_word, len(self.words))]
            if len(top) == 1 and not top[0].is_preterminal:
                top[0] = Tree(top[0].label, top[0].children + tuple(rest))
            else:
                top.extend(rest)
        if len(top) == 1 and not top[0].is_preterminal:
            return top[0]
        self.repairs.append(f"top level wrapped in {TOP}")
        return Tree(TOP, tuple(top))


def delinearize(tokens: Iterable[str], words: Sequence[str],
                tags: Sequence[str] | None = None, linearization: str = SLOTS) -> Delinearized:
    """A tree over exactly ``words`` from a (possibly ill-formed) target sequence.

    Well-formed input (``linearize`` output with ``len(words)`` slots) comes back unchanged with
    no repairs. Otherwise, in order: unknown tokens, surplus ``XX`` and unmatched ``)X`` are
    dropped; a ``)X`` closes the innermost open phrase even if its label differs; phrases still
    open at the end are closed; constituents without words are dropped; words without a slot
    become the last children of the root phrase; a top level that is not one phrase is wrapped
    in ``TOP`` (which COLLINS.prm deletes before scoring). ``tags`` default to ``XX``. With the
    ``words`` linearization every token that is not a bracket is a word's slot (the tree takes
    ``words`` in order whatever the token says; constrained decoding makes them equal).
    """
    if not words:
        raise ValueError("cannot build a tree over an empty sentence")
    tags = tags if tags is not None else [DEFAULT_TAG] * len(words)
    if len(tags) != len(words):
        raise ValueError(f"{len(tags)} tags for {len(words)} words")
    if linearization not in LINEARIZATIONS:
        raise ValueError(f"linearization must be one of {LINEARIZATIONS}, got {linearization!r}")
    builder = _Builder(words, tags, linearization)
    for tok in tokens:
        builder.feed(tok)
    tree = builder.finish()
    return Delinearized(tree, tuple(builder.repairs))


@dataclasses.dataclass
class RepairStats:
    """How often decoding output had to be repaired: sentences, repaired sentences, repair kinds."""

    sentences: int = 0
    repaired: int = 0
    kinds: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def add(self, result: Delinearized) -> None:
        self.sentences += 1
        self.repaired += result.repaired
        self.kinds.update(result.repairs)

    def summary(self) -> str:
        kinds = ", ".join(f"{k}: {n}" for k, n in sorted(self.kinds.items()))
        return f"repaired {self.repaired}/{self.sentences} trees" + (f" ({kinds})" if kinds else "")
