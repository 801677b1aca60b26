"""``aiayn parse demo`` end to end on four WSJ files: the words linearization, a tiny model, resume."""
import json

import pytest

from aiayn.cli import main
from aiayn.parsing.evalb import evalb, read_lines
from aiayn.parsing.evalb_params import COLLINS
from aiayn.parsing.trees import parse_tree
from tests.parsing.conftest import four_wsj_files

TINY = ["--set", "model.n_layers=1", "--set", "model.d_model=32", "--set", "model.d_ff=64", "--set", "model.n_heads=2",
        "--set", "model.d_k=16", "--set", "model.d_v=16", "--set", "train.precision=fp32", "--set", "train.threads=1",
        "--set", "train.save_every_min=0", "--set", "train.save_every_steps=2", "--set", "train.validate_at_save=false",
        "--set", "train.warmup_steps=10"]


@pytest.fixture
def four_files(treebank_zip, tmp_path):
    return four_wsj_files(treebank_zip, tmp_path / "mrg")


def test_parse_demo_end_to_end_and_resumes(four_files, tmp_path, capsys):
    out = tmp_path / "demo"
    argv = ["parse", "demo", "--treebank", str(four_files), "--out", str(out), "--vocab-size", "200",
            "--processes", "1", "--max-steps", "4", "--average-last", "2", "--beam-size", "2", *TINY]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert {"aiayn", "torch", "cpu", "source"} <= set(results["environment"])  # what repeats it
    assert results["train"]["steps"] == 4 and results["averaged"] == ["ckpt_step00000002.pt", "ckpt_step00000004.pt"]
    for split, n in (("dev", 5), ("test", 8)):                  # wsj_0160 and wsj_0180
        gold, pred = read_lines(out / "ptb" / f"{split}.gold"), read_lines(out / f"{split}.pred")
        assert len(pred) == len(gold) == n and results[f"{split}_repaired"] == 0
        assert [parse_tree(p).words() for p in pred] == [parse_tree(g).words() for g in gold]
        score = evalb(gold, pred, COLLINS).all  # the figures are of the written trees (EVALB's nan at no match: 0)
        assert results[split]["aiayn"]["labeled_f1"] == (round(score.fmeasure, 2) if score.match else 0.0)
        assert results[split]["aiayn"]["recall"] == round(score.recall, 2)
        assert results[split]["right-branching"]["sentences"] == n
    assert "(S (NP" in (out / "ptb" / "train.linear").read_text().split("\n")[0]   # words, not XX
    assert " XX " not in (out / "ptb" / "train.linear").read_text()
    assert "right-branching" in printed and printed.rstrip().endswith(f"trees: {out / 'test.pred'}")
    # a re-run resumes: nothing is trained or parsed again, the same scores come back
    (out / "test.pred").write_text((out / "test.pred").read_text())
    mtime = (out / "model.pt").stat().st_mtime_ns
    assert main(argv) == 0
    again = json.loads((out / "results.json").read_text())
    assert again["test"] == results["test"] and (out / "model.pt").stat().st_mtime_ns == mtime
    assert "test_parse_seconds" not in again                   # not parsed again
    # another search on the same folder is refused: its trees are the earlier search's
    capsys.readouterr()
    assert main([*argv, "--beam-size", "3"]) == 2
    assert "made with beam_size 2; this run asks for beam_size 3" in capsys.readouterr().err


def test_parse_demo_refuses_other_options_on_a_prepared_folder(four_files, tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["parse", "demo", "--treebank", str(four_files), "--out", str(out), "--vocab-size", "200",
                 "--processes", "1", "--max-steps", "2", "--splits", "dev", "--beam-size", "1", *TINY]) == 0
    assert not (out / "test.pred").exists()                    # dev alone, as while choosing a recipe
    capsys.readouterr()
    assert main(["parse", "demo", "--treebank", str(four_files), "--out", str(out), "--vocab-size", "200",
                 "--linearization", "slots"]) == 2
    assert "prepared with linearization words" in capsys.readouterr().err
