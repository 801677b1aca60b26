"""Constituency trees for the parsing experiment of §6.3: a small immutable node type and a reader
and writer for the bracketed (s-expression) notation of the Penn Treebank.

A ``Tree`` is either a *preterminal* (a POS tag over one word: ``(NN dog)``) or a *phrase*
(a label over one or more child trees: ``(NP (DT the) (NN dog))``). Words never appear directly
under a phrase; that is the shape every PTB tree has and the one EVALB reads.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Iterator

_TOKEN = re.compile(r"[()]|[^\s()]+")


class BracketError(ValueError):
    """Malformed bracketed text; ``line`` is the 1-based line (within the text) where it was found."""

    def __init__(self, line: int, message: str):
        self.line = line
        super().__init__(message)


@dataclasses.dataclass(frozen=True)
class Tree:
    """One node. A preterminal has ``word`` set and no children; a phrase has children and no word."""

    label: str
    children: tuple["Tree", ...] = ()
    word: str | None = None

    @property
    def is_preterminal(self) -> bool:
        return self.word is not None

    def preterminals(self) -> Iterator["Tree"]:
        """The preterminal nodes, left to right."""
        if self.is_preterminal:
            yield self
            return
        for child in self.children:
            yield from child.preterminals()

    def words(self) -> list[str]:
        return [p.word for p in self.preterminals()]  # type: ignore[misc]

    def tags(self) -> list[str]:
        return [p.label for p in self.preterminals()]

    def to_bracketed(self) -> str:
        """One-line PTB notation, e.g. ``(S (NP (DT the) (NN dog)) (VP (VBZ barks)))``."""
        if self.is_preterminal:
            return f"({self.label} {self.word})"
        return f"({self.label} " + " ".join(c.to_bracketed() for c in self.children) + ")"


def _tokens(text: str) -> Iterator[tuple[str, int]]:
    """(token, 1-based line) for every bracket and atom of ``text``."""
    for line_no, line in enumerate(text.split("\n"), start=1):
        for match in _TOKEN.finditer(line):
            yield match.group(0), line_no


def parse_bracketed(text: str) -> list[tuple[Tree, int]]:
    """Every top-level tree in ``text`` with the line it starts on.

    A bracket whose first element is another bracket has the empty label, as the PTB's outer
    bracket ``( (S ...) )`` does. Raises ``BracketError`` on unbalanced brackets, a bracket
    with no content, or a word beside other children.
    """
    trees: list[tuple[Tree, int]] = []
    # Each open bracket: [label, children, word, start line]
    stack: list[list] = []
    pending_label = False
    for tok, line in _tokens(text):
        if pending_label:
            pending_label = False
            if tok not in "()":
                stack[-1][0] = tok
                continue
        if tok == "(":
            stack.append(["", [], None, line])
            pending_label = True
        elif tok == ")":
            if not stack:
                raise BracketError(line, "')' without a matching '('")
            label, children, word, start = stack.pop()
            if word is None and not children:
                raise BracketError(line, f"empty bracket ({label})")
            node = Tree(label, word=word) if word is not None else Tree(label, tuple(children))
            if stack:
                if stack[-1][2] is not None:
                    raise BracketError(line, f"a subtree beside the word {stack[-1][2]!r}")
                stack[-1][1].append(node)
            else:
                trees.append((node, start))
        else:
            if not stack:
                raise BracketError(line, f"word {tok!r} outside any bracket")
            top = stack[-1]
            if top[2] is not None or top[1]:
                raise BracketError(line, f"word {tok!r} beside other children in ({top[0]} ...)")
            top[2] = tok
    if stack:
        raise BracketError(stack[-1][3], f"({stack[-1][0]} ... is never closed")
    return trees


def parse_tree(text: str) -> Tree:
    """Exactly one tree from ``text`` (e.g. one line of a gold file)."""
    trees = parse_bracketed(text)
    if len(trees) != 1:
        raise BracketError(1, f"expected one tree, found {len(trees)}")
    return trees[0][0]
