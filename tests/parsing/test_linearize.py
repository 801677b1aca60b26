import random

import pytest

from aiayn.parsing.evalb import evalb
from aiayn.parsing.evalb_params import COLLINS
from aiayn.parsing.linearize import RepairStats, delinearize, linearize
from aiayn.parsing.trees import parse_tree

TREE = parse_tree("(S (NP (NNP John)) (VP (VBZ has) (NP (DT a) (NN dog))) (. .))")
WORDS = ["John", "has", "a", "dog", "."]


def test_linearize_vinyals_style():
    assert " ".join(linearize(TREE)) == "(S (NP XX )NP (VP XX (NP XX XX )NP )VP XX )S"


def test_round_trip_is_exact_and_unrepaired():
    out = delinearize(linearize(TREE), WORDS, TREE.tags())
    assert out.tree == TREE and out.repairs == () and not out.repaired


def test_round_trip_every_sample_tree(sample_trees):
    stats = RepairStats()
    for t in sample_trees:
        out = delinearize(linearize(t.tree), t.tree.words(), t.tree.tags())
        assert out.tree == t.tree, (t.file_id, t.index)
        stats.add(out)
    assert (stats.sentences, stats.repaired) == (3914, 0)


def test_default_tags_are_placeholders():
    out = delinearize("(S (NP XX )NP XX )S".split(), ["a", "b"])
    assert out.tree.to_bracketed() == "(S (NP (XX a)) (XX b))"


W3 = ["a", "b", "c"]
T3 = ["DT", "NN", "."]


@pytest.mark.parametrize("target,expected,repairs", [
    ("(S (NP XX XX", "(S (NP (DT a) (NN b)) (. c))",               # unclosed; missing word
     ["unclosed bracket closed", "missing words attached at the end"]),
    (")NP (S XX XX XX )S )S", "(S (DT a) (NN b) (. c))",
     ["unopened bracket dropped", "unopened bracket dropped"]),
    ("(S XX XX XX XX XX )S", "(S (DT a) (NN b) (. c))",
     ["extra word slot dropped", "extra word slot dropped"]),
    ("(S (NP XX XX )VP XX )S", "(S (NP (DT a) (NN b)) (. c))", ["closing label mismatch"]),
    ("(S (NP )NP XX XX XX )S", "(S (DT a) (NN b) (. c))", ["empty constituent dropped"]),
    ("(S XX <unk> ( XX ((NP XX )S", "(S (DT a) (NN b) (. c))",
     ["unknown token dropped", "unknown token dropped", "unknown token dropped"]),
    ("(NP XX )NP (VP XX XX )VP", "(TOP (NP (DT a)) (VP (NN b) (. c)))", ["top level wrapped in TOP"]),
    ("", "(TOP (DT a) (NN b) (. c))", ["missing words attached at the end", "top level wrapped in TOP"]),
    ("XX (S XX XX )S", "(TOP (DT a) (S (NN b) (. c)))", ["top level wrapped in TOP"]),
])
def test_repair(target, expected, repairs):
    out = delinearize(target.split(), W3, T3)
    assert out.tree.to_bracketed() == expected
    assert list(out.repairs) == repairs
    assert out.tree.words() == W3 and out.tree.tags() == T3


def test_repair_stats_counts():
    stats = RepairStats()
    for target in ["(S XX XX XX )S", "(S XX XX", "(S XX XX XX XX )S )S"]:
        stats.add(delinearize(target.split(), W3, T3))
    assert (stats.sentences, stats.repaired) == (3, 2)
    assert stats.kinds == {"unclosed bracket closed": 1, "missing words attached at the end": 1,
                           "extra word slot dropped": 1, "unopened bracket dropped": 1}
    assert stats.summary().startswith("repaired 2/3 trees (")


def test_random_garbage_always_scores_without_error():
    """Whatever the model emits, the repaired tree has the source words, so EVALB never errs."""
    rng = random.Random(0)
    vocab = ["(S", ")S", "(NP", ")NP", "(VP", ")VP", "XX", "XX", "XX", "<unk>", "(", ")"]
    gold_lines, test_lines = [], []
    for _ in range(200):
        words = [f"w{i}" for i in range(rng.randint(1, 8))]
        tags = ["NN"] * len(words)
        target = [rng.choice(vocab) for _ in range(rng.randint(0, 25))]
        tree = delinearize(target, words, tags).tree
        assert tree.words() == words and not tree.is_preterminal
        gold_lines.append(f"(S {' '.join(f'(NN {w})' for w in words)})")
        test_lines.append(tree.to_bracketed())
    result = evalb(gold_lines, test_lines, COLLINS)
    assert result.errors == [] and result.all.valid == 200


def test_bad_arguments():
    with pytest.raises(ValueError):
        delinearize(["XX"], [])
    with pytest.raises(ValueError):
        delinearize(["XX"], ["a"], ["NN", "NN"])
