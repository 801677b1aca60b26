"""Reading text as every command does (``aiayn.data.textio``): lines end at \\n only, whole files
decoded with the line of bad UTF-8, line counts compared naming the shorter file."""
from __future__ import annotations

import pytest

from aiayn.data.textio import check_line_counts, decode_text, read_lines
from aiayn.errors import InputError, UserError


def test_a_carriage_return_inside_a_line_is_kept_and_warned_of_once(tmp_path, caplog):
    """A stray \\r in a corpus line does not split it (its pair stays aligned); a file with old Mac line
    ends reads as one line, which the warning names."""
    path = tmp_path / "mac.txt"
    path.write_bytes(b"a b\r\nc\rd\ne\rf\n")  # CRLF, then two lines with a \r inside
    with caplog.at_level("WARNING"):
        assert list(read_lines(path)) == ["a b", "c\rd", "e\rf"]
        assert list(read_lines(path)) == ["a b", "c\rd", "e\rf"]  # read again (prepare reads twice): no second warning
    assert [r.getMessage()[:len(str(path)) + 3] for r in caplog.records] == [f"{path}:2:"]


def test_decode_text_names_the_line_and_byte_and_drops_a_bom():
    assert decode_text("\ufeffa\nb\n".encode(), "f") == "a\nb\n"
    with pytest.raises(InputError, match=r"^f:3: invalid UTF-8 \(byte 3 of the line: b'\\xff'\)"):
        decode_text(b"a\nbc\nde\xff", "f")


def test_line_counts_name_the_shorter_file_at_the_first_line_it_lacks():
    check_line_counts("a", 3, "b", 3)
    with pytest.raises(InputError, match=r"^b:3: line counts differ: a has 3 lines, b has 2$"):
        check_line_counts("a", 3, "b", 2)
    with pytest.raises(InputError, match=r"^a:1: line counts differ: a has 0 lines, b has 2$"):
        check_line_counts("a", 0, "b", 2)
    with pytest.raises(UserError, match=r"^a and b have no lines: nothing to score$"):
        check_line_counts("a", 0, "b", 0)


def _pipe(tmp_path, name: str, data: bytes):
    """A named pipe that a thread fills with ``data`` once a reader opens it (as ``<(command)`` does)."""
    import os
    import threading
    path = tmp_path / name
    os.mkfifo(path)

    def write():
        with open(path, "wb") as f:
            f.write(data)
    threading.Thread(target=write, daemon=True).start()
    return path


@pytest.mark.parametrize("gz", [False, True])
def test_a_pipe_is_read_once_plain_or_gzip(tmp_path, gz):
    """What is read once (translate's and parse's --input, score's and evaluate's files) takes a pipe,
    opened once: gzip is told by the first bytes without opening it again."""
    import gzip

    from aiayn.data.textio import check_readable
    data = "a b\nc d\n".encode()
    path = _pipe(tmp_path, "p", gzip.compress(data) if gz else data)
    with pytest.raises(UserError, match=r"p: not a regular file \(--input\)"):
        check_readable(path, "--input")  # read more than once (prepare): a file
    check_readable(path, "--input", stream=True)
    assert list(read_lines(path)) == ["a b", "c d"]


def test_score_reads_its_hypotheses_from_a_pipe(tmp_path, capsys):
    from aiayn.cli import main
    (tmp_path / "ref").write_text("a b c d\ne f g h\n")
    hyp = _pipe(tmp_path, "hyp", b"a b c d\ne f g h\n")
    assert main(["score", "--ref", str(tmp_path / "ref"), "--hyp", str(hyp), "--tokenized", "--json"]) == 0
    assert '"score": 100.0' in capsys.readouterr().out


@pytest.mark.parametrize("gz", [False, True])
def test_a_line_longer_than_the_limit_is_refused_once_that_much_is_read(tmp_path, monkeypatch, gz):
    """A file with \\r line ends (or none) is one line: it was read whole into memory, then tokenized
    as one sentence. Line 2 here holds 3 sentences ended by \\r, 30 bytes in all; a line of exactly
    the limit's 20 bytes, its \\n after, is read."""
    import gzip

    from aiayn.data import textio
    assert textio.MAX_LINE_BYTES == 16 * 2 ** 20  # as docs/commands.md ("Inputs") says
    monkeypatch.setattr(textio, "MAX_LINE_BYTES", 20)
    data = b"a" * 20 + b"\n" + b"one two\rthree four\rfive six\r" + b"\n"
    path = tmp_path / ("in.gz" if gz else "in.txt")
    path.write_bytes(gzip.compress(data) if gz else data)
    lines = read_lines(path)
    assert next(lines) == "a" * 20
    with pytest.raises(InputError, match=r"in\.(gz|txt):2: a line longer than 20 bytes \(a file with \\r line ends"):
        next(lines)
    path.write_bytes(b"x" * 21)  # no line end at all
    with pytest.raises(InputError, match=r":1: a line longer than 20 bytes \(a file of text, one sentence a line\?\)"):
        list(read_lines(path))


def test_stdin_lines_longer_than_the_limit_are_refused(monkeypatch):
    import io

    from aiayn.data import textio
    monkeypatch.setattr(textio, "MAX_LINE_BYTES", 8)
    assert list(textio.decode_lines(io.BytesIO(b"12345678\nok\n"), "<stdin>")) == ["12345678", "ok"]
    with pytest.raises(InputError, match="<stdin>:2: a line longer than 8 bytes"):
        list(textio.decode_lines(io.BytesIO(b"ok\n123456789"), "<stdin>"))


@pytest.mark.parametrize("gz", [False, True])
def test_stdin_is_plain_or_gzip(gz):
    """`zcat` left out: `aiayn score --ref r < hyp.gz` and `cat x.gz | aiayn translate` read gzip on
    standard input as a file's, told by its first bytes; a truncated stream names <stdin> and its line."""
    import gzip
    import subprocess
    import sys
    code = "from aiayn.data.textio import stdin_lines\nfor line in stdin_lines(): print(repr(line))\n"
    data = "a b\n\nc d\n".encode()
    done = subprocess.run([sys.executable, "-c", code], input=gzip.compress(data) if gz else data,
                          capture_output=True, check=True)
    assert done.stdout.decode().splitlines() == ["'a b'", "''", "'c d'"]
    if gz:
        cut = subprocess.run([sys.executable, "-m", "aiayn.cli", "score", "--ref", "/dev/null"],
                             input=gzip.compress(data * 1000)[:-30], capture_output=True)
        assert cut.returncode == 2 and b"<stdin>:" in cut.stderr and b"cannot read" in cut.stderr
        assert b"Traceback" not in cut.stderr
