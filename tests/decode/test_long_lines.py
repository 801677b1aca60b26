"""Lines over max_input_tokens: an error naming the line (the library's default), or truncated or
skipped with a warning naming it (``translate`` and ``evaluate`` default to truncate); the output
keeps one line per input line."""
from __future__ import annotations

import json
import logging

import pytest

from aiayn.cli import main
from aiayn.config import ConfigError
from aiayn.decode.config import DecodeConfig
from aiayn.decode.translator import Translator
from aiayn.errors import InputError
from tests.decode.test_translator import make_checkpoint, spm_bytes  # noqa: F401 (a fixture)

LONG = "the cat is in the small house today the dog is in the red garden"
LINES = ["small house", LONG, "", "the cat"]
FAST = ["--max-len-b", "3", "--beam-size", "1", "--c-kernels", "false"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, spm_bytes) -> str:  # noqa: F811
    return make_checkpoint(tmp_path_factory.mktemp("long") / "tiny.pt", spm_bytes)


def _translator(ckpt, policy: str) -> Translator:
    return Translator.from_checkpoint(ckpt, DecodeConfig(max_input_tokens=6, long_lines=policy, max_len_b=3,
                                                         beam_size=1, c_kernels=False))


def test_policies(ckpt, caplog):
    with pytest.raises(InputError, match=r"in.txt:12: .*exceed the limit of 6.*--long-lines truncate or skip"):
        _translator(ckpt, "error").encode(LINES, "in.txt", 11)
    tr = _translator(ckpt, "truncate")
    with caplog.at_level(logging.WARNING):
        ids = tr.encode(LINES, "in.txt", 11)
    assert len(ids[1]) == 6 and ids[1][:5] == tr.src_tok.encode(LONG)[:5] and ids[1][-1] == tr.ids.eos
    assert [r.getMessage().split(": ")[0] for r in caplog.records] == ["in.txt:12"]
    assert "translated its first 5 tokens" in caplog.text
    assert tr.translate(LINES)[1] == tr.translate([tr.src_tok.decode(ids[1][:5])])[0]
    caplog.clear()
    skip = _translator(ckpt, "skip")
    with caplog.at_level(logging.WARNING):
        out = skip.translate(LINES, "in.txt", 11)
    assert len(out) == 4 and out[1] == "" and out[0] != "" and "in.txt:12" in caplog.text and "skipped" in caplog.text
    with pytest.raises(ConfigError, match="long_lines must be truncate, skip, error"):
        DecodeConfig(long_lines="drop")


def test_cli_translate_defaults_to_truncate(ckpt, tmp_path, capsys, caplog):
    (tmp_path / "in.txt").write_text("\n".join(LINES) + "\n")
    args = ["translate", "--checkpoint", ckpt, "--input", str(tmp_path / "in.txt"), "--max-input-tokens", "6", *FAST]
    with caplog.at_level(logging.WARNING):
        assert main(args) == 0
    assert len(capsys.readouterr().out.split("\n")[:-1]) == 4 and "in.txt:2: " in caplog.text
    assert main(args + ["--long-lines", "skip"]) == 0
    assert capsys.readouterr().out.split("\n")[1] == ""
    assert main(args + ["--long-lines", "error"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_cli_evaluate_long_lines(ckpt, tmp_path, capsys):
    (tmp_path / "src.txt").write_text("\n".join(LINES) + "\n")
    (tmp_path / "ref.txt").write_text("\n".join(LINES) + "\n")
    args = ["evaluate", "--checkpoint", ckpt, "--src", str(tmp_path / "src.txt"), "--ref", str(tmp_path / "ref.txt"),
            "--max-input-tokens", "6", "--json", "--out", str(tmp_path / "hyp.txt"), *FAST]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["sentences"] == 4
    assert len((tmp_path / "hyp.txt").read_text().split("\n")[:-1]) == 4
    assert main(args + ["--long-lines", "error"]) == 2
    assert "src.txt:2: " in capsys.readouterr().err
    (tmp_path / "tok.txt").write_text("one\ntwo\n")  # a reference of another length: said before translating
    assert main(args + ["--tok-ref", str(tmp_path / "tok.txt")]) == 2
    assert f"tok.txt:3: line counts differ: {tmp_path / 'tok.txt'} has 2 lines, {tmp_path / 'src.txt'} has 4" \
        in capsys.readouterr().err
    (tmp_path / "empty.txt").write_text("")  # empty source and reference: said before the model is loaded
    assert main(["evaluate", "--checkpoint", str(tmp_path / "no-such.pt"), "--src", str(tmp_path / "empty.txt"),
                 "--ref", str(tmp_path / "empty.txt")]) == 2
    assert "empty.txt have no lines: nothing to score" in capsys.readouterr().err


def test_a_limit_that_keeps_no_token_is_refused(ckpt, tmp_path, capsys):
    """max_input_tokens counts EOS: 1 would leave truncate nothing to keep (every line skipped
    instead), so it is refused at configuration; 2 keeps one token of a long line."""
    with pytest.raises(ConfigError, match="max_input_tokens must be >= 2"):
        DecodeConfig(max_input_tokens=1)
    (tmp_path / "in.txt").write_text("\n".join(LINES) + "\n")
    args = ["translate", "--checkpoint", ckpt, "--input", str(tmp_path / "in.txt"), *FAST]
    assert main(args + ["--max-input-tokens", "1", "--long-lines", "truncate"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "--max-input-tokens must be >= 2" in captured.err and captured.err.count("\n") == 1
    tr = Translator.from_checkpoint(ckpt, DecodeConfig(max_input_tokens=2, long_lines="truncate", c_kernels=False))
    assert [len(x) for x in tr.encode(LINES)] == [2, 2, 0, 2]
