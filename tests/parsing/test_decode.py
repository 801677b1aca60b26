"""Parsing with a model: the delinearize-and-count step with a stub, then train -> decode end to end."""
import json
import re
import zipfile

from aiayn.cli import main
from aiayn.parsing.decode import PARSE_DECODE, parse_trees
from aiayn.parsing.evalb import evalb, read_lines
from aiayn.parsing.evalb_params import COLLINS
from aiayn.parsing.linearize import linearize
from aiayn.parsing.trees import parse_tree


class StubTranslator:
    def __init__(self, outputs):
        self.outputs = outputs
        self.seen = None

    def translate(self, lines):
        self.seen = list(lines)
        return self.outputs


def test_parse_trees_repairs_and_counts():
    gold = [parse_tree("(S (NP (DT the) (NN dog)) (VP (VBZ barks)) (. .))"),
            parse_tree("(S (NP (PRP it)) (VP (VBZ rains)))")]
    stub = StubTranslator([" ".join(linearize(gold[0])), "(S (NP XX )NP (VP"])
    trees, stats = parse_trees(stub, gold)
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


def test_prepare_train_decode_end_to_end(treebank_zip, tmp_path, capsys):
    mrg = tmp_path / "mrg"
    mrg.mkdir()
    with zipfile.ZipFile(treebank_zip) as zf:
        for n in ("0001", "0002", "0160", "0180"):          # train, train, dev, test
            (mrg / f"wsj_{n}.mrg").write_bytes(zf.read(f"treebank/combined/wsj_{n}.mrg"))
    out = tmp_path / "ptb"
    assert main(["parse", "prepare", "--treebank", str(mrg), "--out", str(out), "--vocab-size", "150",
                 "--num-workers", "1"]) == 0
    run = tmp_path / "run"
    assert main(["parse", "train", "--data", str(out / "data"), "--out", str(run), "--preset", "tiny",
                 "--max-steps", "4", "--no-progress", *FAST]) == 0
    cfg = json.loads((run / "config.json").read_text())
    assert (cfg["model"]["n_layers"], cfg["model"]["vocab_size"]) == (2, 150)       # tiny, sized to the data
    assert (cfg["train"]["warmup_steps"], cfg["train"]["max_steps"]) == (10, 4)    # ours after parse defaults
    capsys.readouterr()
    pred = tmp_path / "test.pred"
    assert main(["parse", "decode", "--checkpoint", str(run / "last.pt"), "--gold", str(out / "test.gold"),
                 "--out", str(pred), "--beam-size", "2", "--max-len-b", "8"]) == 0
    printed = capsys.readouterr().out
    gold_lines = read_lines(out / "test.gold")
    pred_lines = read_lines(pred)
    assert len(pred_lines) == len(gold_lines) == 8       # wsj_0180 holds 8 trees
    for g, p in zip(gold_lines, pred_lines):
        assert parse_tree(p).words() == parse_tree(g).words()
    result = evalb(gold_lines, pred_lines, COLLINS)
    assert result.errors == [] and result.all.valid == 8
    assert "Bracketing FMeasure" in printed
    assert re.search(r"^repaired \d/8 trees", printed, re.M)


def test_train_rejects_unknown_field(tmp_path, capsys):
    assert main(["parse", "train", "--data", str(tmp_path), "--out", str(tmp_path / "r"),
                 "--set", "train.learning_rate=1"]) == 2
    assert "unknown field 'learning_rate'" in capsys.readouterr().err
