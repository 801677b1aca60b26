"""Parsing with a model: the delinearize-and-count step with a stub, then train -> decode end to end."""
import io
import json
import re
import types

import pytest

from aiayn.cli import main
from aiayn.config import replace
from aiayn.parsing.decode import PARSE_DECODE, ParseOptions, parse_trees
from aiayn.parsing.evalb import evalb, read_lines
from aiayn.parsing.evalb_params import COLLINS
from aiayn.parsing.linearize import linearize
from aiayn.parsing.trees import parse_tree
from tests.parsing.conftest import four_wsj_files


class StubTranslator:
    tgt_tok = types.SimpleNamespace(user_symbols=frozenset({"▁XX", "▁(S", "▁)S"}))
    cfg = types.SimpleNamespace(long_lines="error")  # (a Translator's DecodeConfig: no line skipped)

    def __init__(self, outputs):
        self.outputs = outputs
        self.seen = None

    def translate(self, lines, source="<input>", first_line=1):
        self.seen = list(lines)
        return self.outputs


def test_parse_trees_repairs_and_counts():
    gold = [parse_tree("(S (NP (DT the) (NN dog)) (VP (VBZ barks)) (. .))"),
            parse_tree("(S (NP (PRP it)) (VP (VBZ rains)))")]
    stub = StubTranslator([" ".join(linearize(gold[0])), "(S (NP XX )NP (VP"])
    trees, stats = parse_trees(stub, gold, ParseOptions(constrained=False))
    assert stub.seen == ["the dog barks .", "it rains"]
    assert trees[0] == gold[0]
    assert trees[1].to_bracketed() == "(S (NP (PRP it)) (VBZ rains))"   # empty VP dropped, word appended
    assert (stats.sentences, stats.repaired) == (2, 1)


def test_paper_decoding_settings():
    assert (PARSE_DECODE.beam_size, PARSE_DECODE.alpha, PARSE_DECODE.max_len_a, PARSE_DECODE.max_len_b) == \
        (21, 0.3, 1.0, 300)


FAST = ["--set", "train.save_every_min=0", "--set", "train.validate_every_steps=0", "--set", "train.precision=fp32",
        "--set", "train.threads=1", "--set", "train.max_src_tokens=600", "--set", "train.max_tgt_tokens=600",
        "--set", "train.warmup_steps=10"]


@pytest.fixture(scope="module")
def tiny_parser(treebank_zip, tmp_path_factory):
    """A parser trained for 4 steps on four WSJ files (so all but untrained): (prepared dir, run dir)."""
    tmp_path = tmp_path_factory.mktemp("parser")
    mrg = four_wsj_files(treebank_zip, tmp_path / "mrg")
    out = tmp_path / "ptb"
    assert main(["parse", "prepare", "--treebank", str(mrg), "--out", str(out), "--vocab-size", "150",
                 "--num-workers", "1"]) == 0
    run = tmp_path / "run"
    assert main(["parse", "train", "--data", str(out / "data"), "--out", str(run), "--preset", "tiny",
                 "--max-steps", "4", "--no-progress", *FAST]) == 0
    return out, run


def test_prepare_train_decode_end_to_end(tiny_parser, tmp_path, capsys):
    out, run = tiny_parser
    cfg = json.loads((run / "config.json").read_text())
    assert (cfg["model"]["n_layers"], cfg["model"]["vocab_size"]) == (2, 150)       # tiny, sized to the data
    assert (cfg["train"]["warmup_steps"], cfg["train"]["max_steps"]) == (10, 4)    # ours after parse defaults
    gold_lines = read_lines(out / "test.gold")
    for constrained in ("true", "false"):
        capsys.readouterr()
        pred = tmp_path / f"test.{constrained}"
        assert main(["parse", "decode", "--checkpoint", str(run / "last.pt"), "--gold", str(out / "test.gold"),
                     "--out", str(pred), "--beam-size", "2", "--max-len-b", "8", "--constrained", constrained]) == 0
        printed = capsys.readouterr().out
        pred_lines = read_lines(pred)
        assert len(pred_lines) == len(gold_lines) == 8       # wsj_0180 holds 8 trees
        for g, p in zip(gold_lines, pred_lines):
            assert parse_tree(p).words() == parse_tree(g).words()
        result = evalb(gold_lines, pred_lines, COLLINS)
        assert result.errors == [] and result.all.valid == 8
        assert "Bracketing FMeasure" in printed
        assert re.search(r"^repaired \d/8 trees", printed, re.M)
        if constrained == "true":                           # an untrained model, and still no repair
            assert re.search(r"^repaired 0/8 trees$", printed, re.M)


def test_parse_text_stdin_and_files(tiny_parser, tmp_path, capsys, monkeypatch):
    _, run = tiny_parser
    monkeypatch.setattr("sys.stdin", io.StringIO("The cat sat on the mat .\n\n( a ) b\n"))
    # (a bracket inside a word is escaped as well: the tree stays well formed)
    assert main(["parse", "--checkpoint", str(run / "last.pt"), "--beam-size", "3"]) == 0
    lines = capsys.readouterr().out.split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[3] == ""
    assert parse_tree(lines[0]).words() == "The cat sat on the mat .".split()
    assert parse_tree(lines[2]).words() == ["-LRB-", "a", "-RRB-", "b"]
    assert set(parse_tree(lines[0]).tags()) == {"XX"}
    src, dst = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("The cat sat on the mat .\n\n( a ) b\n")
    assert main(["parse", "text", "--checkpoint", str(run / "last.pt"), "--beam-size", "3", "--input", str(src),
                 "--output", str(dst), "--device", "auto"]) == 0
    assert dst.read_text().split("\n") == lines
    src.write_text("ok :-) y\nsaid (NP x\n")
    assert main(["parse", "--checkpoint", str(run / "last.pt"), "--beam-size", "2", "--input", str(src)]) == 0
    trees = capsys.readouterr().out.splitlines()
    assert [parse_tree(t).words() for t in trees] == [["ok", ":--RRB-", "y"], ["said", "-LRB-NP", "x"]]


def test_parse_without_checkpoint_or_subcommand_is_an_error(capsys):
    assert main(["parse"]) == 2
    assert "give --checkpoint" in capsys.readouterr().err


def test_train_rejects_unknown_field(tmp_path, capsys):
    assert main(["parse", "train", "--data", str(tmp_path), "--out", str(tmp_path / "r"),
                 "--set", "train.learning_rate=1"]) == 2
    assert "unknown field 'learning_rate'" in capsys.readouterr().err


def test_bad_paths_and_budgets_are_one_line_naming_the_file(tiny_parser, tmp_path, capsys):
    """Each of these was a traceback, an output written before the inputs were checked, or an error
    naming ``<input>`` for the gold file."""
    out, run = tiny_parser
    ckpt, gold = str(run / "last.pt"), str(out / "test.gold")
    a_file = tmp_path / "a_file"
    a_file.write_text("x\n")
    sentences = tmp_path / "in.txt"
    sentences.write_text("The cat sat .\n")

    def refused(argv) -> str:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        return err

    assert "a folder; name a file" in refused(["parse", "--checkpoint", ckpt, "--input", str(sentences),
                                               "--output", str(tmp_path)])
    assert f"{a_file} is not a folder" in refused(["parse", "--checkpoint", ckpt, "--input", str(sentences),
                                                    "--output", str(a_file / "x")])
    assert "no such file (--input)" in refused(["parse", "--checkpoint", ckpt, "--input", str(tmp_path / "none"),
                                                "--output", str(tmp_path / "o.txt")])
    assert not (tmp_path / "o.txt").exists()  # nothing written by a command that could not start
    assert f"{a_file} is not a folder" in refused(["parse", "decode", "--checkpoint", ckpt, "--gold", gold,
                                                    "--out", str(a_file / "x.pred")])
    # the constrained search's length budget: the line named, not a ValueError
    assert re.search(rf"{re.escape(gold)}:\d+: the maximum output length leaves no room for a tree", refused(
        ["parse", "decode", "--checkpoint", ckpt, "--gold", gold, "--out", str(tmp_path / "p"), "--beam-size", "1",
         "--max-len-a", "0", "--max-len-b", "3"]))
    # a long line: named by the gold file; with --long-lines skip, an empty line out
    assert f"{gold}:1: " in refused(["parse", "decode", "--checkpoint", ckpt, "--gold", gold, "--out",
                                     str(tmp_path / "p"), "--beam-size", "1", "--max-input-tokens", "5"])
    long = tmp_path / "long.txt"
    long.write_text("The cat sat .\n" + " ".join(["word"] * 60) + "\n")
    assert main(["parse", "--checkpoint", ckpt, "--beam-size", "1", "--input", str(long), "--max-input-tokens", "30",
                 "--long-lines", "skip"]) == 0
    lines = capsys.readouterr().out.split("\n")
    assert parse_tree(lines[0]).words() == "The cat sat .".split() and lines[1] == ""


def test_score_refuses_files_of_other_lengths(tiny_parser, tmp_path, capsys):
    """EVALB scores the lines both files have and warns; a truncated prediction file would then score
    as a whole one. ``parse score`` refuses it, naming the shorter file at the first line it lacks."""
    out, _ = tiny_parser
    gold = out / "test.gold"
    short = tmp_path / "short.pred"
    short.write_text("".join(line + "\n" for line in read_lines(gold)[:3]))
    assert main(["parse", "score", "--gold", str(gold), "--test", str(short)]) == 2
    assert f"{short}:4: line counts differ" in capsys.readouterr().err


def test_decode_long_lines_skip_writes_an_empty_line_evalb_skips(tiny_parser, tmp_path, capsys):
    """``decode --long-lines skip``: the over-long sentence gets an empty line in --out (EVALB's skip
    sentence), the others their trees; it was an AttributeError traceback."""
    _, run = tiny_parser
    gold = tmp_path / "g.gold"
    short = "(S (NP (DT a)) (VP (VBD b)))"                     # 2 one-letter words: at most 5 pieces with EOS
    long = "(S " + " ".join(["(NN word)"] * 60) + ")"          # 60 words: more than 8 pieces
    gold.write_text(f"{short}\n{long}\n{short}\n")
    pred = tmp_path / "g.pred"
    assert main(["parse", "decode", "--checkpoint", str(run / "last.pt"), "--gold", str(gold), "--out", str(pred),
                 "--beam-size", "1", "--max-input-tokens", "8", "--long-lines", "skip"]) == 0
    printed = capsys.readouterr().out
    lines = read_lines(pred)
    assert len(lines) == 3 and lines[1] == ""
    assert parse_tree(lines[0]).words() == parse_tree(lines[2]).words() == ["a", "b"]
    assert re.search(r"^Number of Skip  sentence  =\s+1$", printed, re.M)
    assert re.search(r"^repaired 0/2 trees$", printed, re.M)


def test_search_options_that_fight_the_tree_constraint_are_refused(tiny_parser, tmp_path, capsys):
    """--min-len forbids the EOS after a finished tree and --no-repeat-ngram the repeats every tree
    has (``XX XX``): under the constraint the search then ended with no tree and a flat one was
    written instead, exit 0. Refused before any output; the plain search still takes them."""
    out, run = tiny_parser
    ckpt = str(run / "last.pt")
    sentences = tmp_path / "in.txt"
    sentences.write_text("The cat sat on the mat .\n")
    trees = tmp_path / "out.txt"
    for option in (["--min-len", "3"], ["--no-repeat-ngram", "2"]):
        assert main(["parse", "--checkpoint", ckpt, "--beam-size", "2", "--input", str(sentences),
                     "--output", str(trees), *option]) == 2
        err = capsys.readouterr().err
        assert f"{option[0]} {option[1]}: not with --constrained true" in err and err.count("\n") == 1
        assert not trees.exists()
        assert main(["parse", "decode", "--checkpoint", ckpt, "--gold", str(out / "test.gold"),
                     "--out", str(tmp_path / "p"), "--beam-size", "2", *option]) == 2
        assert "not with --constrained true" in capsys.readouterr().err
    assert main(["parse", "--checkpoint", ckpt, "--beam-size", "2", "--input", str(sentences), "--output", str(trees),
                 "--min-len", "3", "--max-len-b", "8", "--constrained", "false"]) == 0
    assert parse_tree(read_lines(trees)[0]).words() == "The cat sat on the mat .".split()


@pytest.fixture(scope="module")
def tiny_words_parser(treebank_zip, tmp_path_factory):
    """A parser of the ``words`` linearization, 2 steps on ``tiny_parser``'s four WSJ files: its run dir."""
    tmp_path = tmp_path_factory.mktemp("words_parser")
    mrg = four_wsj_files(treebank_zip, tmp_path / "mrg")
    out = tmp_path / "ptb"
    assert main(["parse", "prepare", "--treebank", str(mrg), "--out", str(out), "--vocab-size", "150",
                 "--num-workers", "1", "--linearization", "words"]) == 0
    run = tmp_path / "run"
    assert main(["parse", "train", "--data", str(out / "data"), "--out", str(run), "--preset", "tiny",
                 "--max-steps", "2", "--no-progress", *FAST]) == 0
    return run


@pytest.mark.parametrize("linearization", ["slots", "words"])
def test_words_spelled_with_no_piece_are_still_placed_by_the_constraint(tiny_parser, tiny_words_parser,
                                                                         linearization):
    """A word SentencePiece spells with no piece at all (a zero-width space, a BOM, a control
    character, its own word mark ``▁``) still gets its place from the constrained search: under
    ``words`` the word after it was left out and appended at the end ("missing words attached"),
    and a sentence of such words alone was never decoded (a flat ``TOP`` tree), both repairs."""
    from aiayn.decode.translator import Translator
    from aiayn.parsing.decode import parse_words

    run = tiny_parser[1] if linearization == "slots" else tiny_words_parser
    sentences = [["the", "\u200b", "cat", "\ufeff", "sat", "."], ["\u2581"], ["a", "\u2581", "\x01", "b"]]
    with Translator.from_checkpoint(run / "last.pt", replace(PARSE_DECODE, beam_size=2)) as translator:
        assert translator.tgt_tok.encode("\u200b") == translator.tgt_tok.encode("\u2581") == []
        results = parse_words(translator, sentences)
    for sentence, result in zip(sentences, results):
        assert result.repairs == () and result.tree.words() == sentence
