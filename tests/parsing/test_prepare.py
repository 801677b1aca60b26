"""Parsing data options: the tree tokens become SentencePiece user symbols; splits by WSJ file."""
import gzip
import json
import zipfile

import pytest

from aiayn.cli import main
from aiayn.config import ConfigError, replace
from aiayn.errors import UserError
from aiayn.parsing.prepare import (PARSE_DATA_DEFAULTS, SPLIT_SCHEMES, SplitConfig, parse_ranges, split_of,
                                   tree_symbols, with_tree_symbols)
from aiayn.parsing.ptb import TreebankTree, read_treebank
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


def test_file_ranges_and_schemes():
    assert parse_ranges("0200-2199, 2400") == ((200, 2199), (2400, 2400))
    for bad in ("22-", "0300-0200", "a"):
        with pytest.raises(ConfigError, match="bad file range"):
            parse_ranges(bad)
    with pytest.raises(ConfigError, match="train and test share WSJ files"):
        SplitConfig(test_files="0150-0160,0190")
    with pytest.raises(ConfigError, match="^--dev-files: bad file range '5-1'"):   # the option named
        SplitConfig(dev_files="5-1")
    wsj = SPLIT_SCHEMES["wsj"]
    assert [wsj.split_of(n) for n in (199, 200, 2199, 2215, 2300, 2399, 2400)] == \
        [None, "train", "train", "dev", "test", "test", None]
    assert split_of("wsj_0160") == "dev" and split_of("wsj_0001", wsj) is None


def _copy_mrg(zf, number: str, dst) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(zf.read(f"treebank/combined/wsj_{number}.mrg"))


def test_prepare_full_wsj_layout_by_sections(treebank_zip, tmp_path, capsys):
    """An LDC-style tree (parsed/mrg/wsj/SS/wsj_SSNN.mrg) split 02-21 / 22 / 23; sections 00 and 24 unused."""
    wsj = tmp_path / "parsed" / "mrg" / "wsj"
    with zipfile.ZipFile(treebank_zip) as zf:
        for src, dst in (("0001", "00/wsj_0001"), ("0002", "02/wsj_0201"), ("0003", "21/wsj_2199"),
                         ("0004", "22/wsj_2201"), ("0005", "23/wsj_2301"), ("0006", "24/wsj_2401")):
            _copy_mrg(zf, src, wsj / f"{dst}.mrg")
    out = tmp_path / "out"
    assert main(["parse", "prepare", "--treebank", str(tmp_path / "parsed"), "--out", str(out), "--no-data",
                 "--splits", "wsj"]) == 0
    splits = json.loads((out / "splits.json").read_text())["splits"]
    n = {f: len(read_treebank(wsj / f)) for f in ("02", "21", "22", "23")}
    assert [(s["name"], s["files"], s["trees"]) for s in splits] == \
        [("train", "0200-2199", n["02"] + n["21"]), ("dev", "2200-2299", n["22"]), ("test", "2300-2399", n["23"])]
    assert main(["parse", "prepare", "--treebank", str(tmp_path / "parsed"), "--out", str(out), "--no-data",
                 "--splits", "wsj", "--dev-files", "0001", "--overwrite"]) == 0
    dev = json.loads((out / "splits.json").read_text())["splits"][1]
    assert dev == {"name": "dev", "files": "0001", "trees": len(read_treebank(wsj / "00"))}
    capsys.readouterr()
    assert main(["parse", "prepare", "--treebank", str(tmp_path / "parsed"), "--out", str(out), "--no-data",
                 "--splits", "wsj", "--dev-files", "2000-2299", "--overwrite"]) == 2
    assert "train and dev share WSJ files" in capsys.readouterr().err
    (wsj / "23" / "wsj_2301.mrg").write_text("( (S (NP (NN a))\n  (VP (VBZ b)))\n( (S (NN c)))))\n")
    assert main(["parse", "prepare", "--treebank", str(tmp_path / "parsed"), "--out", str(out), "--no-data",
                 "--splits", "wsj", "--overwrite"]) == 2
    assert "wsj_2301.mrg:3:" in capsys.readouterr().err


@pytest.mark.parametrize("argv, vocab", [([], 4000), (["--splits", "wsj"], 16000),
                                         (["--splits", "wsj", "--vocab-size", "8000"], 8000)])
def test_wsj_scheme_takes_the_papers_vocabulary(argv, vocab, tmp_path, monkeypatch):
    seen = {}

    def fake_prepare(treebank, out, cfg, force, splits, linearization):
        seen.update(vocab=cfg.vocab_size, splits=splits)
        raise UserError("stop here")

    monkeypatch.setattr("aiayn.commands.parse.prepare_parsing", fake_prepare)
    assert main(["parse", "prepare", "--treebank", str(tmp_path), "--out", str(tmp_path / "o"), *argv]) == 2
    assert seen["vocab"] == vocab
    assert seen["splits"] == SPLIT_SCHEMES["wsj" if argv else "sample"]


def test_a_zip_bomb_is_refused_before_a_member_is_read(tmp_path, monkeypatch, capsys):
    """A member that unpacks to far more than the zip holds (here 4 MiB of one tree, 0.1% of it
    stored): one line naming the zip and the member; nothing read, nothing written."""
    import aiayn.files
    monkeypatch.setattr(aiayn.files, "UNPACK_SLACK", 0)  # the bound is then 10 times the zip's size
    tree = b"( (S (NP (NNP John)) (VP (VBZ runs)) (. .)) )\n"
    bomb = tmp_path / "treebank.zip"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("treebank/combined/wsj_0001.mrg", tree)
        zf.writestr("treebank/combined/wsj_0002.mrg", tree * ((4 << 20) // len(tree)))
    out = tmp_path / "out"
    assert main(["parse", "prepare", "--treebank", str(bomb), "--no-data", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"aiayn parse: error: {bomb}: treebank/combined/wsj_0002.mrg unpacks to more than the "
                   f"{10 * bomb.stat().st_size - len(tree):,} bytes this archive may still give (10 times its size "
                   f"and 0 MiB in all); is it the archive it should be?"]
    assert not out.exists()
    gz = tmp_path / "wsj_0001.mrg.gz"  # one gzipped file: the same bound
    gz.write_bytes(gzip.compress(tree * ((4 << 20) // len(tree))))
    with pytest.raises(UserError, match=rf"^{gz}: wsj_0001.mrg unpacks to more than the {10 * gz.stat().st_size:,} "):
        read_treebank(gz)
