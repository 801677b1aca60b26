"""The ``aiayn parse`` commands, run through the real entry point."""
import json
import shutil

from aiayn.cli import main
from aiayn.data.dataset import DataDir
from aiayn.parsing.evalb import evalb, read_lines
from aiayn.parsing.evalb_params import COLLINS
from aiayn.parsing.linearize import delinearize
from aiayn.parsing.trees import parse_tree
from tests.parsing.conftest import four_wsj_files


def test_score_prints_evalb_summary(evalb_dir, capsys):
    rc = main(["parse", "score", "--gold", str(evalb_dir / "bug/bug.gld"),
               "--test", str(evalb_dir / "bug/bug.tst"), "--param", str(evalb_dir / "new.prm")])
    out = capsys.readouterr().out
    assert rc == 0
    summary = [line for line in out.splitlines() if line.strip()]
    expected = (evalb_dir / "bug/bug.rsl-new").read_text().split("=== Summary ===")[1]
    assert summary == ["=== Summary ==="] + [line for line in expected.splitlines() if line.strip()]
    assert "Bracketing FMeasure       =  60.17" in summary
    assert "Sent." not in out                       # the table only on request


def test_score_sentences_table_and_default_params(evalb_dir, capsys, tmp_path):
    gold = evalb_dir / "sample/sample.gld"
    rc = main(["parse", "score", "--gold", str(gold), "--test", str(gold), "--sentences"])
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith("  Sent.")
    assert "Bracketing FMeasure       = 100.00" in out and "Number of Valid sentence  =     24" in out
    prm = tmp_path / "debug.prm"
    prm.write_text((evalb_dir / "COLLINS.prm").read_text().replace("DEBUG 0", "DEBUG 1"))
    main(["parse", "score", "--gold", str(gold), "--test", str(gold), "--param", str(prm)])
    assert capsys.readouterr().out.startswith("  Sent.")


def test_score_user_errors_exit_2(evalb_dir, capsys, tmp_path):
    bad = tmp_path / "bad.prm"
    bad.write_text("LABELLED 0\n")
    gold = str(evalb_dir / "sample/sample.gld")
    assert main(["parse", "score", "--gold", gold, "--test", gold, "--param", str(bad)]) == 2
    assert "bad.prm:1: unknown keyword" in capsys.readouterr().err
    assert main(["parse", "score", "--gold", gold, "--test", str(tmp_path / "none")]) == 2


def test_score_warns_when_the_test_trees_have_no_pos_tags(tmp_path, capsys, caplog):
    """`aiayn parse` writes XX preterminals; scored against gold trees, EVALB deletes the gold's
    punctuation and not the test's, so every line with punctuation is a "Length unmatch" error
    for words that are the same. The score says why, once, and names `aiayn parse decode`."""
    gold, test = tmp_path / "g.gold", tmp_path / "t.txt"
    gold.write_text("(S (NP (DT The) (NN cat)) (VP (VBD sat)) (. .))\n")
    test.write_text("(S (NP (XX The) (XX cat)) (VP (XX sat)) (XX .))\n")
    assert main(["parse", "score", "--gold", str(gold), "--test", str(test)]) == 0
    assert "Number of Error sentence  =      1" in capsys.readouterr().out
    hints = [r.getMessage() for r in caplog.records if "every preterminal is XX" in r.getMessage()]
    assert len(hints) == 1 and str(test) in hints[0] and "aiayn parse decode" in hints[0]
    caplog.clear()
    test.write_text("(S (NP (DT The) (NN cat)) (VP (VBD sat) (. .)))\n")    # tagged: no hint
    assert main(["parse", "score", "--gold", str(gold), "--test", str(test)]) == 0
    assert not [r for r in caplog.records if "every preterminal" in r.getMessage()]


def test_prepare_and_baseline(treebank_zip, tmp_path, capsys):
    out = tmp_path / "ptb"
    assert main(["parse", "prepare", "--treebank", str(treebank_zip), "--out", str(out), "--no-data"]) == 0
    counts = {s["name"]: s["trees"] for s in json.loads((out / "splits.json").read_text())["splits"]}
    assert counts == {"train": 3396, "dev": 273, "test": 245}
    assert not (out / "data").exists()
    for split, n in counts.items():
        words = (out / f"{split}.words").read_text().splitlines()
        linear = (out / f"{split}.linear").read_text().splitlines()
        gold = (out / f"{split}.gold").read_text().splitlines()
        assert len(words) == len(linear) == len(gold) == n
        assert words[0].split() == parse_tree(gold[0]).words()
        assert linear[0].split().count("XX") == len(words[0].split())
    assert (out / "test.words").read_text().startswith("Genetics Institute Inc. , Cambridge")

    capsys.readouterr()
    assert main(["parse", "baseline", "--gold", str(out / "test.gold"), "--out", str(out / "rb")]) == 0
    result = evalb(read_lines(out / "test.gold"), read_lines(out / "rb"), COLLINS)
    assert result.errors == [] and result.all.valid == 245
    assert round(result.all.fmeasure, 2) == 8.97         # labeled; all constituents are S


def test_prepare_builds_data_directory(treebank_zip, tmp_path, capsys):
    out = tmp_path / "ptb"
    rc = main(["parse", "prepare", "--treebank", str(treebank_zip), "--out", str(out), "--num-workers", "1",
               "--vocab-size", "1000"])
    assert rc == 0
    manifest = json.loads((out / "data" / "manifest.json").read_text())
    assert manifest["vocab"]["src"]["vocab_size"] == 1000
    assert {k: v["pairs"] for k, v in manifest["splits"].items()} == {"train": 3396, "valid": 273, "test": 245}
    assert manifest["splits"]["train"]["cleaning"]["kept"] == 3396
    assert manifest["options"]["character_coverage"] == 1.0
    assert len(manifest["options"]["user_symbols"]) == 53            # XX and 26 labels, opened and closed
    train_tokens = len((out / "train.linear").read_text().split())
    assert manifest["splits"]["train"]["tgt"]["tokens"] == train_tokens  # every tree token is one piece
    # the inputs as they are once in place (not the temporary folder they were built in)
    assert manifest["splits"]["valid"]["inputs"]["tgt"] == str((out / "dev.linear").resolve())
    assert DataDir(out / "data").references("valid") == (out / "dev.linear").read_text().splitlines()


def test_prepared_dev_targets_decode_to_the_gold_trees(treebank_zip, tmp_path, capsys):
    """linearize -> encode -> decode -> delinearize is exact on dev, including (WHADJP, a label
    train lacks (so no user symbol): it is spelled out in characters, not lost to <unk>."""
    out = tmp_path / "ptb"
    assert main(["parse", "prepare", "--treebank", str(treebank_zip), "--out", str(out), "--num-workers", "1"]) == 0
    data = DataDir(out / "data")
    valid, tok = data.split("valid"), data.tgt_tokenizer
    assert data.manifest["splits"]["valid"]["tgt"]["unk"] == 0 and data.vocab_size == 4000
    gold = [parse_tree(line) for line in (out / "dev.gold").read_text().splitlines()]
    linear = (out / "dev.linear").read_text().splitlines()
    assert len(gold) == len(valid) == 273
    spelled = 0
    for i, tree in enumerate(gold):
        text = tok.decode(valid.tgt(i))
        assert text == linear[i]
        result = delinearize(text.split(), tree.words(), tree.tags())
        assert result.tree == tree and not result.repaired
        spelled += len(valid.tgt(i)) != len(text.split())
    assert spelled == 1 and "(WHADJP" in tok.decode(valid.tgt(next(
        i for i in range(len(valid)) if len(valid.tgt(i)) != len(linear[i].split()))))


def test_prepare_refuses_concatenated_file(tmp_path, capsys):
    combined = tmp_path / "wsj_0001-0199.combined.mrg"
    combined.write_text("( (S (NN a)))\n( (S (NN b)))\n")
    assert main(["parse", "prepare", "--treebank", str(combined), "--out", str(tmp_path / "x"), "--no-data"]) == 2
    assert "wsj_NNNN file names" in capsys.readouterr().err


def test_prepare_overwrite_keeps_what_it_did_not_write(treebank_zip, tmp_path, capsys):
    """--overwrite replaces an earlier prepared treebank only: a run trained into it (docs/parsing.md
    trains into OUT/run), or the treebank it reads, is refused and kept."""
    mrg = four_wsj_files(treebank_zip, tmp_path / "mrg")
    out = tmp_path / "ptb"
    argv = ["parse", "prepare", "--treebank", str(mrg), "--out", str(out), "--no-data"]
    assert main(argv) == 0
    assert main([*argv, "--overwrite"]) == 0  # its own output: replaced
    (out / "run").mkdir()
    (out / "run" / "last.pt").write_bytes(b"a checkpoint")
    capsys.readouterr()
    assert main([*argv, "--overwrite"]) == 2
    assert "not a prepared treebank" in capsys.readouterr().err
    assert (out / "run" / "last.pt").read_bytes() == b"a checkpoint"
    inside = out / "run" / "mrg"
    shutil.copytree(mrg, inside)
    assert main(["parse", "prepare", "--treebank", str(inside), "--out", str(out), "--no-data", "--overwrite"]) == 2
    assert f"holds the input {inside}" in capsys.readouterr().err and inside.is_dir()


def test_a_damaged_treebank_zip_is_one_line(treebank_zip, tmp_path, capsys):
    data = bytearray(treebank_zip.read_bytes())
    at = data.rfind(b"PK\x01\x02")  # a central directory entry's magic
    data[at:at + 4] = b"XXXX"
    bad = tmp_path / "bad.zip"
    bad.write_bytes(bytes(data))
    assert main(["parse", "prepare", "--treebank", str(bad), "--out", str(tmp_path / "o"), "--no-data"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{bad}" in err and "a damaged zip" in err, err


def test_data_out_below_a_file_is_one_line(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x\n")
    assert main(["data", "ptb-sample", "--out", str(a_file)]) == 2
    err = capsys.readouterr().err  # (after the lines that say what is downloaded, and its terms)
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(
        f"aiayn data: error: {a_file / 'ptb-wsj-nltk-sample'}: cannot make the download's folder"), err
