"""Parsing data options: the tree tokens become SentencePiece user symbols."""
import pytest

from aiayn.config import replace
from aiayn.errors import UserError
from aiayn.parsing.prepare import PARSE_DATA_DEFAULTS, tree_symbols, with_tree_symbols
from aiayn.parsing.ptb import TreebankTree
from aiayn.parsing.trees import parse_tree

TREES = [TreebankTree("wsj_0001", 0, parse_tree("(S (NP (NNP John)) (VP (VBZ runs)) (. .))")),
         TreebankTree("wsj_0002", 0, parse_tree("(S (NP (DT a) (NN dog)) (VP (VBZ barks)))"))]


def test_tree_symbols_are_the_distinct_target_tokens():
    assert tree_symbols(TREES) == ("(NP", "(S", "(VP", ")NP", ")S", ")VP", "XX")


def test_tree_symbols_join_the_given_ones():
    cfg = with_tree_symbols(replace(PARSE_DATA_DEFAULTS, user_symbols=("(WHADJP", "(S")), TREES)
    assert cfg.user_symbols == ("(NP", "(S", "(VP", "(WHADJP", ")NP", ")S", ")VP", "XX")
    assert with_tree_symbols(PARSE_DATA_DEFAULTS, TREES).vocab_size == 4000


def test_vocabulary_too_small_for_the_symbols():
    with pytest.raises(UserError, match="vocab_size must exceed 4 special ids \\+ 7 user symbols.*7 distinct"):
        with_tree_symbols(replace(PARSE_DATA_DEFAULTS, vocab_size=11), TREES)
