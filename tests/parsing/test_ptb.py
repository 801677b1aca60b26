import builtins
import gzip
import os
import threading
import zipfile

import pytest

from aiayn.errors import InputError, UserError
from aiayn.parsing.ptb import normalize, read_mrg_text, read_treebank, strip_function_tags
from aiayn.parsing.trees import parse_tree

RAW = """
( (S
    (NP-SBJ-1 (NNP Mr.) (NNP Vinken) )
    (VP (VBZ is)
      (VP (VBN expected)
        (S (NP-SBJ (-NONE- *-1) )
          (VP (TO to) (VP (VB resign) )))))
    (. .) ))
( (SINV (S-TPC-2 (NP-SBJ (-LRB- -LRB-) (NN fee) (-RRB- -RRB-) ) (VP (VBD rose) ))
    (VP (VBD said) (SBAR (-NONE- 0) (S (-NONE- *T*-2) )))
    (NP-SBJ=3 (PRP he) ) (. .) ))
"""


def test_outer_bracket_none_and_function_tags():
    trees = read_mrg_text(RAW, "wsj_0042", "x.mrg")
    assert [(t.file_id, t.index) for t in trees] == [("wsj_0042", 0), ("wsj_0042", 1)]
    # The unlabeled outer bracket is gone; NP-SBJ (all -NONE-) is removed, S keeps its VP.
    assert trees[0].tree == parse_tree(
        "(S (NP (NNP Mr.) (NNP Vinken)) (VP (VBZ is) (VP (VBN expected) (S (VP (TO to) (VP (VB resign)))))) (. .))")
    # SBAR held only empty elements (its S too): both go, VP keeps its verb. -LRB- tags stay.
    assert trees[1].tree == parse_tree(
        "(SINV (S (NP (-LRB- -LRB-) (NN fee) (-RRB- -RRB-)) (VP (VBD rose))) (VP (VBD said)) (NP (PRP he)) (. .))")


@pytest.mark.parametrize("label,expected", [
    ("NP-SBJ-1", "NP"), ("NP-SBJ", "NP"), ("PP-LOC=2", "PP"), ("NP=3", "NP"), ("S", "S"),
    ("-NONE-", "-NONE-"), ("-LRB-", "-LRB-"), ("ADVP|PRT", "ADVP|PRT"),
])
def test_strip_function_tags(label, expected):
    assert strip_function_tags(label) == expected


def test_outer_bracket_with_several_children_becomes_top():
    tree = normalize(parse_tree("( (NP (NN a)) (. .))"))
    assert tree.to_bracketed() == "(TOP (NP (NN a)) (. .))"


def test_tree_of_only_empty_elements_is_an_error():
    with pytest.raises(InputError, match=r"x\.mrg:2: .*no words"):
        read_mrg_text("\n( (S (-NONE- *)))\n", "wsj_0001", "x.mrg")


def test_malformed_file_names_file_and_line():
    with pytest.raises(InputError, match=r"x\.mrg:3:"):
        read_mrg_text("( (S (NN a)))\n\n( (S (NN a b)))\n", "wsj_0001", "x.mrg")


def test_sample_zip_counts_and_cleanliness(sample_trees):
    assert len(sample_trees) == 3914                      # PROVENANCE.md
    assert len({t.file_id for t in sample_trees}) == 199
    assert sample_trees[0].file_id == "wsj_0001" and sample_trees[-1].file_id == "wsj_0199"
    first = sample_trees[0].tree
    assert first.words()[:3] == ["Pierre", "Vinken", ","] and first.label == "S"
    for t in sample_trees:
        assert "-NONE-" not in t.tree.tags()
        stack = [t.tree]
        while stack:
            node = stack.pop()
            if not node.is_preterminal:
                assert node.children and "=" not in node.label and "-" not in node.label
                stack.extend(node.children)


def test_combined_file_and_directory_match_the_zip(shared_data, sample_trees, treebank_zip, tmp_path):
    combined = read_treebank(shared_data / "ptb-wsj-nltk-sample" / "wsj_0001-0199.combined.mrg.gz")
    assert [t.tree for t in combined] == [t.tree for t in sample_trees]
    assert {t.file_id for t in combined} == {"wsj_0001-0199.combined"}
    with zipfile.ZipFile(treebank_zip) as zf:
        for name in ("treebank/combined/wsj_0003.mrg", "treebank/combined/wsj_0002.mrg"):
            (tmp_path / name.rsplit("/", 1)[1]).write_bytes(zf.read(name))
    from_dir = read_treebank(tmp_path)
    assert [t.file_id for t in from_dir][:1] == ["wsj_0002"]
    assert [t.tree for t in from_dir] == [t.tree for t in sample_trees if t.file_id in ("wsj_0002", "wsj_0003")]


def test_single_gz_file(tmp_path):
    path = tmp_path / "wsj_0007.mrg.gz"
    with gzip.open(path, "wt") as f:
        f.write(RAW)
    trees = read_treebank(path)
    assert [t.file_id for t in trees] == ["wsj_0007", "wsj_0007"]


def _read_through_fifo(fifo, data: bytes, monkeypatch):
    """``read_treebank(fifo)`` with ``data`` written into the FIFO by another thread, once, as by
    ``<(zcat ...)``, and how many times it opened the FIFO. A second open finds no writer and would
    wait for ever: every 2 s the thread gives such a reader an empty pipe (and a writer still waiting
    at the end is given a reader), so a failing test fails, not hangs."""
    os.mkfifo(fifo)
    opens, real_open = [], builtins.open
    done = threading.Event()

    def counting_open(file, *args, **kwargs):
        if str(file) == str(fifo):
            opens.append(file)
        return real_open(file, *args, **kwargs)

    def write():
        try:
            with real_open(fifo, "wb") as f:
                f.write(data)
        except BrokenPipeError:  # the reader closed it unread
            pass
        while not done.wait(2):
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # no reader waiting
                pass

    monkeypatch.setattr(builtins, "open", counting_open)
    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        return read_treebank(fifo), len(opens)
    finally:
        done.set()
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        writer.join(10)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
def test_a_pipe_is_read_once(tmp_path, compress, monkeypatch):
    """A single file given as a pipe (``<(zcat wsj.mrg.gz)``, a FIFO) is opened once: a second open
    would find nothing there. Plain or gzip, its trees are those of the same bytes in a file."""
    data = gzip.compress(RAW.encode()) if compress else RAW.encode()
    (tmp_path / "file").mkdir()
    (tmp_path / "file" / "wsj_0007.mrg").write_bytes(data)
    from_file = read_treebank(tmp_path / "file" / "wsj_0007.mrg")
    from_pipe, opens = _read_through_fifo(tmp_path / "wsj_0007.mrg", data, monkeypatch)
    assert [(t.file_id, t.index, t.tree) for t in from_pipe] == [(t.file_id, t.index, t.tree) for t in from_file]
    assert len(from_file) == 2 and opens == 1


def test_missing_path(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        read_treebank(tmp_path / "nope.zip")


def test_files_are_read_as_text_files_are_everywhere(tmp_path, caplog):
    """gzip by content whatever the name, a BOM dropped, invalid UTF-8 named by file (zip member) and
    line; a folder whose name ends in .mrg is not a file; an empty file is said, not skipped silently."""
    folder = tmp_path / "wsj"
    folder.mkdir()
    (folder / "wsj_0001.mrg").write_bytes(b"\xef\xbb\xbf" + RAW.encode())
    (folder / "wsj_0002.mrg").write_bytes(gzip.compress(RAW.encode()))  # gzip, named as plain text
    (folder / "wsj_0003.mrg").mkdir()
    (folder / "wsj_0004.mrg").write_text("")
    with caplog.at_level("WARNING"):
        trees = read_treebank(folder)
    assert [t.file_id for t in trees] == ["wsj_0001"] * 2 + ["wsj_0002"] * 2
    assert [t.tree for t in trees[:2]] == [t.tree for t in read_mrg_text(RAW, "wsj_0001", "x")]
    assert [r.getMessage() for r in caplog.records] == [f"{folder / 'wsj_0004.mrg'}: no trees in this file"]
    bad = RAW.encode().replace(b"(NN", b"(NN \xe9", 1)
    line = RAW.encode()[:RAW.encode().index(b"(NN")].count(b"\n") + 1
    (folder / "wsj_0005.mrg").write_bytes(bad)
    with pytest.raises(InputError, match=rf"wsj_0005\.mrg:{line}: invalid UTF-8"):
        read_treebank(folder)
    with zipfile.ZipFile(tmp_path / "t.zip", "w") as zf:
        zf.writestr("treebank/combined/wsj_0005.mrg", bad)
    with pytest.raises(InputError, match=rf"t\.zip:treebank/combined/wsj_0005\.mrg:{line}: invalid UTF-8"):
        read_treebank(tmp_path / "t.zip")
