"""Forced target prefixes: search's Constraints.prefix, Translator, translate --prefix (aiayn/decode/search.py)."""
from __future__ import annotations

import io

import pytest
import torch

from aiayn.cli import main
from aiayn.decode.config import DecodeConfig
from aiayn.decode.search import Constraints, search
from aiayn.decode.loading import load_models_for_inference
from aiayn.decode.translator import Translator
from tests.rounding import same_float_search

from .stub import TableDecoder

LINES = ["a b c d e", "l k j i", "a a b b c c d", "g h"]


@pytest.fixture(scope="module")
def greedy(copy_checkpoint):
    with Translator.from_checkpoint(copy_checkpoint, DecodeConfig(beam_size=1)) as tr:
        yield tr


def test_greedy_with_its_own_first_k_tokens_as_prefix_is_unchanged(greedy, copy_checkpoint):
    ids = greedy.encode(LINES)
    free = greedy.translate_ids(ids)
    [model], _, _ = load_models_for_inference(copy_checkpoint)
    src = [torch.tensor(i) for i in ids]
    for k in range(0, 4):
        prefixes = [list(hs[0].tokens[:k]) for hs in free]
        forced = greedy.translate_ids(ids, prefixes)  # the same tokens, scores up to float32's roundings
        same_float_search(model, src, forced, free, greedy.cfg, greedy.ids)


@pytest.mark.parametrize("beam", [1, 4])
def test_output_starts_with_the_prefix_and_continues_it(copy_checkpoint, beam):
    with Translator.from_checkpoint(copy_checkpoint, DecodeConfig(beam_size=beam, nbest=min(beam, 2))) as tr:
        prefixes = ["l k", "", "f", "h g f e d c b a"]
        out = tr.translate_nbest(LINES, prefixes=prefixes)
        free = tr.translate(LINES)
    for ts, p, line, f in zip(out, prefixes, LINES, free):
        assert all(t.text.startswith(p) for t in ts), (p, [t.text for t in ts])
        assert ts[0].eos  # it went on to an end of sentence
        if not p:
            assert ts[0].text == f == line  # no prefix: the free translation (a copy)


def test_prefix_in_the_search_forces_tokens_of_the_stub():
    """A hand-written table whose best path is 5 5 EOS; prefix 6 gives 6 then that table's best."""
    tables = {4: {(): {5: 0.6, 6: 0.4}, (5,): {5: 0.9, 3: 0.1}, (5, 5): {3: 1.0},
                  (6,): {7: 0.7, 3: 0.3}, (6, 7): {3: 1.0}}}
    src = torch.tensor([[4, 3], [4, 3]])
    for beam in (1, 3):
        cfg = DecodeConfig(beam_size=beam, alpha=0.0)
        hyps = search(TableDecoder(tables), src, cfg, constraints=Constraints(prefix=torch.tensor([[6], [-1]])))
        assert hyps[0][0].tokens == (6, 7) and hyps[0][0].log_prob == pytest.approx(torch.tensor(0.4 * 0.7).log().item())
        assert hyps[1][0].tokens == (5, 5)
    # a prefix longer than the maximum output length still fits (max length raised to |prefix| + 1)
    cfg = DecodeConfig(beam_size=1, max_len_a=0.0, max_len_b=1)
    hyps = search(TableDecoder(tables), src[:1], cfg, constraints=Constraints(prefix=torch.tensor([[6, 7]])))
    assert hyps[0][0].tokens == (6, 7) and hyps[0][0].eos


def test_translate_prefix_file(copy_checkpoint, tmp_path, capsys):
    src, pre = tmp_path / "src.txt", tmp_path / "prefix.txt"
    src.write_text("a b c\nl k j i\n")
    pre.write_text("c\n\n")
    assert main(["translate", "--checkpoint", str(copy_checkpoint), "--input", str(src), "--prefix", str(pre)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("c") and out[1] == "l k j i"
    pre.write_text("c\n")
    assert main(["translate", "--checkpoint", str(copy_checkpoint), "--input", str(src), "--prefix", str(pre)]) == 2
    assert f"prefix.txt:2: line counts differ: {pre} has 1 line, {src} has 2" in capsys.readouterr().err


def test_translate_prefix_count_is_checked_before_decoding(copy_checkpoint, tmp_path, capsys, monkeypatch):
    """A --prefix file of more (or fewer) lines than an --input file: one error line before any
    translation is written. From stdin the count is known as lines arrive: a short file stops at
    the first line it lacks, a long one after the translations."""
    src, pre = tmp_path / "src.txt", tmp_path / "prefix.txt"
    src.write_text("a b c\nl k j i\n")
    pre.write_text("c\n\nk\n")
    args = ["translate", "--checkpoint", str(copy_checkpoint), "--prefix", str(pre)]
    assert main(args + ["--input", str(src)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert f"src.txt:3: line counts differ: {pre} has 3 lines, {src} has 2" in captured.err
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(src.read_bytes())))
    assert main(args) == 2
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 2 and "3 lines for 2 input lines" in captured.err
    pre.write_text("c\n")
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(src.read_bytes())))
    assert main(args + ["--buffer", "1"]) == 2
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 1 and "1 lines, fewer than the input's" in captured.err


def test_translate_reads_the_prefix_file_as_the_input_arrives(copy_checkpoint, tmp_path, capsys, monkeypatch):
    """A stream's prefixes are read chunk by chunk with its lines, not the whole file first (its memory
    stays that of a chunk): with --buffer 1, the k-th chunk is decoded with k prefix lines read."""
    import aiayn.data.textio as textio

    pre = tmp_path / "prefix.txt"
    pre.write_text("c\n\nk\n")
    read, real = [], textio.read_lines

    def counted(path):
        for line in real(path):
            read.append(line)
            yield line

    at_chunk = []
    translate_ids = Translator.translate_ids
    monkeypatch.setattr(textio, "read_lines", counted)
    monkeypatch.setattr(Translator, "translate_ids", lambda self, *a, **k: at_chunk.append(len(read)) or
                        translate_ids(self, *a, **k))
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"a b c\nl k j i\nk j\n")))
    assert main(["translate", "--checkpoint", str(copy_checkpoint), "--prefix", str(pre), "--buffer", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert at_chunk == [1, 2, 3]
    assert out[0].startswith("c") and out[2].startswith("k") and len(out) == 3


def test_translate_prefix_from_a_pipe(copy_checkpoint, tmp_path, capsys):
    """--prefix is read once, as --input is: a pipe (``--prefix <(cut -f2 pairs.tsv)``) will do, and its
    line count is checked as its lines arrive (counting them first would empty the pipe)."""
    import os
    src = tmp_path / "src.txt"
    src.write_text("a b c\nl k j i\n")
    for prefixes, status in ((b"c\n\n", 0), (b"c\n\nk\n", 2)):
        r, w = os.pipe()
        os.write(w, prefixes)
        os.close(w)
        try:
            assert main(["translate", "--checkpoint", str(copy_checkpoint), "--input", str(src),
                         "--prefix", f"/dev/fd/{r}"]) == status
        finally:
            os.close(r)
        captured = capsys.readouterr()
        out = captured.out.splitlines()
        assert len(out) == 2 and out[0].startswith("c") and out[1] == "l k j i"
        assert ("3 lines for 2 input lines" in captured.err) == (status == 2)
