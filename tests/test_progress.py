"""Progress bars of translate, evaluate, prepare and average: drawn on stderr with a rate when it
is a terminal, never with --quiet, never into a pipe; the output itself is unchanged."""
from __future__ import annotations

import io
import sys

import pytest

from aiayn import progress
from aiayn.cli import main
from tests.decode.test_translator import make_checkpoint, spm_bytes  # noqa: F401 (a fixture)

LINES = ["the house is small", "", "a cat sat on the mat today", "small"]
FAST = ["--max-len-b", "2", "--beam-size", "1", "--c-kernels", "false"]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _terminal(monkeypatch) -> Terminal:
    """stderr a terminal, from here to the end of the test (set in the test: pytest's capture sets
    sys.stderr again between a fixture and the test)."""
    tty = Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    monkeypatch.setattr(progress, "QUIET", False)
    return tty


def _drained(tty: Terminal) -> str:
    text = tty.getvalue()
    tty.seek(0)
    tty.truncate()
    return text


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, spm_bytes) -> str:  # noqa: F811
    return make_checkpoint(tmp_path_factory.mktemp("progress") / "tiny.pt", spm_bytes)


def test_bar_only_on_a_terminal_without_quiet(monkeypatch):
    terminal = _terminal(monkeypatch)
    with progress.progress_bar(3, unit=" lines", desc="x") as bar:
        bar.update(3)
    assert " lines/s" in _drained(terminal)
    with progress.progress_bar(3, unit=" lines", quiet=True) as bar:
        bar.update(3)
    monkeypatch.setattr(progress, "QUIET", True)
    with progress.progress_bar(3, unit=" lines") as bar:
        bar.update(3)
    assert _drained(terminal) == ""
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a pipe
    monkeypatch.setattr(progress, "QUIET", False)
    assert not progress.progress_shown()


def test_translate_and_evaluate(ckpt, tmp_path, capsys, monkeypatch):
    terminal = _terminal(monkeypatch)
    (tmp_path / "in.txt").write_text("\n".join(LINES) + "\n")
    args = ["translate", "--checkpoint", ckpt, "--input", str(tmp_path / "in.txt"), *FAST]
    assert main(args) == 0
    bar = _drained(terminal)
    assert "translate:" in bar and " lines/s" in bar and "/4 " in bar  # the file's lines counted first
    assert len(capsys.readouterr().out.split("\n")) == 5
    assert main(args + ["--quiet"]) == 0
    assert _drained(terminal) == ""
    ev = ["evaluate", "--checkpoint", ckpt, "--src", str(tmp_path / "in.txt"), "--ref", str(tmp_path / "in.txt"), *FAST]
    assert main(ev) == 0
    assert "evaluate:" in _drained(terminal)
    assert main(ev + ["--quiet"]) == 0
    assert _drained(terminal) == ""


def test_prepare_and_average(ckpt, tmp_path, spm_bytes, monkeypatch):  # noqa: F811
    terminal = _terminal(monkeypatch)
    (tmp_path / "t.txt").write_text("\n".join(x for x in LINES if x) * 20 + "\n")
    args = ["prepare", "--train-src", str(tmp_path / "t.txt"), "--train-tgt", str(tmp_path / "t.txt"),
            "--vocab-size", "40", "--num-workers", "1", "--out", str(tmp_path / "data")]
    assert main(args) == 0
    assert "train: encode" in _drained(terminal)
    other = make_checkpoint(tmp_path / "b.pt", spm_bytes)
    assert main(["average", ckpt, other, "--out", str(tmp_path / "avg.pt")]) == 0
    assert "average:" in _drained(terminal)
    assert main(["average", ckpt, other, "--out", str(tmp_path / "avg2.pt"), "--quiet"]) == 0
    assert "average:" not in _drained(terminal)
