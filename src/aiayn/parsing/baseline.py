"""A trivial baseline for §6.3: the right-branching tree over a sentence's words.

``w1 w2 ... wn`` -> ``(S w1 (S w2 ( ... (S wn-1 wn))))``: every constituent runs from one word
to the end of the sentence, all labeled ``S`` (the commonest root label in WSJ). It uses no POS
tags for its structure; the preterminals carry the tags given (the gold ones when scoring), only
so EVALB removes the same punctuation from both trees.
"""
from __future__ import annotations

from typing import Sequence

from aiayn.parsing.trees import Tree


def right_branching(words: Sequence[str], tags: Sequence[str], label: str = "S") -> Tree:
    """The right-branching tree over ``words`` (module docstring); one word gives ``(S (TAG w))``."""
    if not words or len(words) != len(tags):
        raise ValueError(f"need as many tags as words (and at least one): {len(words)} words, {len(tags)} tags")
    leaves = [Tree(t, word=w) for w, t in zip(words, tags)]
    tree = Tree(label, tuple(leaves[-2:]))
    for leaf in reversed(leaves[:-2]):
        tree = Tree(label, (leaf, tree))
    return tree
