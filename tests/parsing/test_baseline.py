import pytest

from aiayn.parsing.baseline import right_branching
from aiayn.parsing.evalb import score_sentence
from aiayn.parsing.evalb_params import COLLINS


def test_shape():
    tree = right_branching(["a", "b", "c", "d"], ["DT", "NN", "VBZ", "."])
    assert tree.to_bracketed() == "(S (DT a) (S (NN b) (S (VBZ c) (. d))))"
    assert right_branching(["a"], ["NN"]).to_bracketed() == "(S (NN a))"


def test_scored_by_hand():
    # Gold S[0,3] NP[0,2] VP[2,3]; baseline (after '.' deletion) S[0,3] S[1,3] S[2,3]: only the root matches.
    gold = "(S (NP (DT the) (NN dog)) (VP (VBZ barks)) (. .))"
    test = right_branching(["the", "dog", "barks", "."], ["DT", "NN", "VBZ", "."]).to_bracketed()
    r = score_sentence(gold, test, COLLINS)
    assert (r.gold, r.test, r.match, r.crossing) == (3, 3, 1, 1)


def test_needs_tags_for_every_word():
    with pytest.raises(ValueError):
        right_branching(["a", "b"], ["NN"])
