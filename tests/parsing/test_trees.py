import pytest

from aiayn.parsing.trees import BracketError, Tree, parse_bracketed, parse_tree


def test_parse_and_write_back():
    text = "(S (NP (DT the) (NN dog)) (VP (VBZ barks)))"
    tree = parse_tree(text)
    assert tree.label == "S"
    assert tree.words() == ["the", "dog", "barks"]
    assert tree.tags() == ["DT", "NN", "VBZ"]
    assert tree.children[0] == Tree("NP", (Tree("DT", word="the"), Tree("NN", word="dog")))
    assert tree.to_bracketed() == text


def test_multiline_trees_with_start_lines():
    text = "\n( (S\n  (NP (NN a) )))\n( (X (NN b)))\n"
    trees = parse_bracketed(text)
    assert [line for _, line in trees] == [2, 4]
    assert trees[0][0].label == "" and trees[0][0].children[0].label == "S"


@pytest.mark.parametrize("text,line", [
    ("(S (NN a)", 1),                 # never closed
    ("(S (NN a)))", 1),               # extra ')'
    ("(S\n (NN a b))", 2),            # two words in one bracket
    ("(S (NP ) (NN a))", 1),          # empty bracket
    ("(S a (NN b))", 1),              # word beside a subtree
    ("(S (NN b) a)", 1),
    ("a (S (NN b))", 1),              # word outside brackets
])
def test_malformed_text_names_the_line(text, line):
    with pytest.raises(BracketError) as info:
        parse_bracketed(text)
    assert info.value.line == line


def test_parse_tree_wants_exactly_one():
    with pytest.raises(BracketError):
        parse_tree("(NN a) (NN b)")
