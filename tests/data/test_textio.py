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
