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
