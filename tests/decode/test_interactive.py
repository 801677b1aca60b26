"""aiayn translate --interactive / --buffer: a line's translation comes before the input ends."""
from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from aiayn.data.textio import input_chunks
from aiayn.decode.config import DecodeConfig
from aiayn.decode.translator import Translator

REPO = Path(__file__).resolve().parents[2]


def _reader(stream, q: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        q.put(line)
    q.put(None)


@pytest.mark.slow
def test_each_line_is_translated_before_stdin_closes(copy_checkpoint):
    lines = ["a b c", "", "l k j i"]
    with Translator.from_checkpoint(copy_checkpoint, DecodeConfig(beam_size=2)) as tr:
        want = tr.translate(lines)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "aiayn.cli", "translate", "--checkpoint", str(copy_checkpoint),
                             "--beam-size", "2", "--interactive"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    q: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, q), daemon=True).start()
    try:
        for line, translation in zip(lines, want):
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
            got = q.get(timeout=60)  # stdin is still open: the translation came line by line
            assert got is not None and got.rstrip("\n") == translation
        proc.stdin.close()
        assert q.get(timeout=60) is None and proc.wait(timeout=60) == 0
    finally:
        proc.kill()


def test_buffer_must_be_positive(copy_checkpoint, capsys):
    from aiayn.cli import main
    assert main(["translate", "--checkpoint", str(copy_checkpoint), "--buffer", "0"]) == 2
    assert "--buffer must be at least 1" in capsys.readouterr().err


def test_buffer_cuts_stdin_into_chunks_of_n_lines(monkeypatch):
    import io
    monkeypatch.setattr(sys, "stdin", io.StringIO("a\nb\n c \nd\ne\n"))
    assert list(input_chunks(None, 2)) == [(1, ["a", "b"]), (3, ["c", "d"]), (5, ["e"])]


@pytest.mark.parametrize("buffer,when,trims", [(None, "grown", 3), ("1", "grown", 3), ("3", "grown", 2),
                                               ("3", "always", 2), (None, "never", 0)])
def test_a_long_stream_gives_the_heaps_holes_back_every_chunk_lines(copy_checkpoint, monkeypatch, capsys, buffer,
                                                                    when, trims):
    """The aiayn command keeps freed memory in its heap (aiayn/host/allocator.py), where batches of many
    shapes leave holes of many sizes: a long stream's translator gives them back after each chunk
    that passes a multiple of CHUNK_LINES lines (each chunk of the default --buffer). 7 lines with
    CHUNK_LINES 2: chunks of 2 or 1 lines pass 2, 4 and 6; chunks of 3 (3, 6, 7) pass them in two.
    AIAYN_HEAP_TRIM=never: no trim at all."""
    import io

    import aiayn.commands.translate as translate
    from aiayn.cli import main
    from aiayn.host import allocator
    calls = []
    monkeypatch.setenv(allocator.TRIM_ENV, when)
    monkeypatch.setattr(translate, "CHUNK_LINES", 2)
    glibc = allocator._glibc  # malloc_trim counted, however the caller reaches it
    monkeypatch.setattr(allocator, "_glibc", lambda name: calls.append if name == "malloc_trim" else glibc(name))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"a b\nc\n\nd e f\ng\nh i\nj\n")))
    args = ["translate", "--checkpoint", str(copy_checkpoint), "--beam-size", "1"]
    assert main(args + (["--buffer", buffer] if buffer else [])) == 0
    assert len(capsys.readouterr().out.splitlines()) == 7
    assert len(calls) == trims
