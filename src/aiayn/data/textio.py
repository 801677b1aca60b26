"""Reading parallel text: plain or gzip (detected by content), UTF-8, one sentence per line.

Every problem is an ``InputError`` naming the file and the 1-based line: invalid UTF-8, a
source and target of different lengths (both counts given), an unreadable or corrupt file.
``input_chunks`` reads the input of a command (a file or stdin) a chunk of lines at a time.
"""
from __future__ import annotations

import functools
import gzip
import logging
import re
import sys
import zlib
from itertools import zip_longest
from pathlib import Path
from typing import IO, Iterator

from aiayn.errors import InputError, UserError

log = logging.getLogger(__name__)

_GZIP_MAGIC = b"\x1f\x8b"
_CR_WARNED: set[str] = set()  # files whose carriage return was warned of (read_lines): once a file
CHUNK_LINES = 10_000  # lines of input_chunks' chunks: translated and written at a time (bounds memory)
MAX_LINE_BYTES = 1 << 24  # a longer line is not one sentence: refused before it fills the memory
_SUFFIX_LANG = re.compile(r"[A-Za-z]{2,3}(?:[-_][A-Za-z0-9]{2,8})?")  # en, deu, pt-BR, zh_Hant
NOT_LANGS = {"src", "tgt", "trg", "txt", "tok", "raw", "out", "hyp", "ref"}  # suffixes that name no language


def file_suffix(path: str | Path) -> str:
    """A file name's last suffix but .gz, without its dot (train.en.gz -> en)."""
    name = Path(path).name
    return Path(name[:-3] if name.endswith(".gz") else name).suffix[1:]


def suffix_language(path: str | Path) -> str | None:
    """The language a file's suffix names (train.en, newstest2014.fr.gz, dev.pt-BR), or None."""
    suffix = file_suffix(path)
    return suffix if _SUFFIX_LANG.fullmatch(suffix) and suffix.lower() not in NOT_LANGS else None


def check_readable(path: Path, what: str, stream: bool = False) -> None:
    """A clear error for a missing input before any work starts. ``stream``: the input is read once,
    so a pipe (``<(command)``, ``/dev/stdin``) will do as well as a file."""
    if not path.exists():
        raise UserError(f"{path}: no such file ({what})")
    if path.is_file() or stream and (path.is_fifo() or path.is_char_device()):
        return
    raise UserError(f"{path}: not a regular file ({what})")


def _open_binary(path: Path) -> IO[bytes]:
    """``path`` opened once for reading (a pipe cannot be opened twice): gzip by its first bytes."""
    f = open(path, "rb")
    try:
        if f.peek(2)[:2] != _GZIP_MAGIC:
            return f
        g = gzip.GzipFile(fileobj=f, mode="rb")
        g.myfileobj = f  # closed with it, as gzip.open(filename) does
        return g
    except BaseException:
        f.close()
        raise


def count_lines(path: Path) -> int:
    """The lines of a plain or gzip file (a last line without its newline counted); 0 when it
    cannot be read (``read_lines`` then says why)."""
    n, last = 0, b"\n"
    try:
        with _open_binary(path) as f:
            while block := f.read(1 << 20):
                n += block.count(b"\n")
                last = block[-1:]
    except (OSError, EOFError, zlib.error):
        return 0
    return n + (last != b"\n")


def read_lines(path: Path) -> Iterator[str]:
    """Lines of ``path`` decoded as UTF-8 (a leading BOM dropped), surrounding whitespace stripped.
    Lines end at ``\\n`` only (a stray carriage return in a corpus line does not split the pair); the
    first carriage return inside a line is warned of (once a file, however often it is read), as a
    file with old Mac line ends reads as one line."""
    n, warned = 0, str(path) in _CR_WARNED
    try:
        with _open_binary(path) as f:
            for n, raw in _raw_lines(f, path):
                line = decode_line(raw, path, n)
                if not warned and "\r" in line:
                    warned = True
                    _CR_WARNED.add(str(path))
                    log.warning("%s:%d: a carriage return inside the line; lines end at \\n only (a file with "
                                "\\r line ends: tr '\\r' '\\n')", path, n)
                yield line
    except (OSError, EOFError, zlib.error) as exc:
        raise InputError(path, n + 1, f"cannot read ({exc})") from exc


def read_input(path: str | Path, what: str) -> list[str]:
    """All of ``read_lines`` of an input read once (a pipe will do), ``what`` (the option that named it)
    in the error for a missing one."""
    check_readable(Path(path), what, stream=True)
    return list(read_lines(Path(path)))


def read_bytes(path: Path) -> bytes:
    """The bytes of a plain or gzip file (by content); an unreadable or corrupt file is a
    ``UserError`` naming it."""
    return read_unpacked(path)[0]


def read_unpacked(path: Path, gzip_limit: int | None = None) -> tuple[bytes, bool]:
    """``read_bytes`` and whether the file was gzip, from one open (a pipe cannot be opened twice):
    of gzip data at most ``gzip_limit`` bytes (all with None), as an unpack bound allows; plain
    bytes whole."""
    try:
        with _open_binary(path) as f:
            gzipped = isinstance(f, gzip.GzipFile)
            return f.read(gzip_limit if gzipped and gzip_limit is not None else -1), gzipped
    except IsADirectoryError:
        raise UserError(f"{path}: not a regular file") from None
    except (OSError, EOFError, zlib.error) as exc:
        raise UserError(f"{path}: cannot read ({getattr(exc, 'strerror', None) or exc})") from exc


def decode_text(data: bytes, name) -> str:
    """A whole file's bytes as UTF-8 text, a leading BOM dropped; invalid UTF-8 is an ``InputError``
    naming ``name``, the line and the byte, as ``decode_line`` does for one line."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        start = data.rfind(b"\n", 0, exc.start) + 1
        raise InputError(name, data.count(b"\n", 0, exc.start) + 1,
                         f"invalid UTF-8 (byte {exc.start - start + 1} of the line: "
                         f"{data[exc.start:exc.start + 4]!r})") from None
    return text.removeprefix("\ufeff")


def text_mode(text: str) -> str:
    """Line ends as Python's text mode reads them: ``\\r\\n`` and a lone ``\\r`` become ``\\n`` (for
    files read whole, such as treebanks, not a corpus's lines, which end at ``\\n`` only)."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def decode_lines(stream: IO[bytes], name: str) -> Iterator[str]:
    """``read_lines`` of an open binary stream (stdin) called ``name`` in errors, read a line at a
    time (a line is given as soon as it has arrived)."""
    n = 0
    try:
        for n, raw in _raw_lines(stream, name):
            yield decode_line(raw, name, n)
    except (OSError, EOFError, zlib.error) as exc:  # a truncated or corrupt gzip stream
        raise InputError(name, n + 1, f"cannot read ({exc})") from exc


def stdin_lines() -> Iterator[str]:
    """``decode_lines`` of standard input, plain or gzip (told by its first bytes, as a file is)."""
    raw = getattr(sys.stdin, "buffer", None)  # bytes, decoded here: bad UTF-8 names its line
    if raw is None:  # a text stream put in its place
        return (line.strip() for line in iter(sys.stdin.readline, ""))
    if hasattr(raw, "peek") and raw.peek(2)[:2] == _GZIP_MAGIC:
        raw = gzip.GzipFile(fileobj=raw, mode="rb")
    return decode_lines(raw, "<stdin>")


def _raw_lines(stream: IO[bytes], name) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, the line's bytes) of ``stream``; a line longer than ``MAX_LINE_BYTES``
    is an ``InputError`` once that much of it is read (a file with ``\\r`` line ends, or no line
    ends, is one line: it would be read whole)."""
    for n, raw in enumerate(iter(functools.partial(stream.readline, MAX_LINE_BYTES + 1), b""), 1):
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            hint = "a file with \\r line ends: tr '\\r' '\\n'" if b"\r" in raw else "a file of text, one sentence a line?"
            raise InputError(name, n, f"a line longer than {MAX_LINE_BYTES:,} bytes ({hint})")
        yield n, raw


def decode_line(raw: bytes, path, n: int) -> str:
    """Line ``n`` of ``path`` as UTF-8 text (a BOM on line 1 dropped), stripped; invalid UTF-8 is
    an ``InputError`` naming the file, the line and the byte."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(path, n, f"invalid UTF-8 (byte {exc.start + 1} of the line: "
                                  f"{raw[exc.start:exc.start + 4]!r})") from None
    if n == 1 and text.startswith("\ufeff"):
        text = text[1:]
    return text.strip()


def count_of(n: int, noun: str) -> str:
    """"1 line", "2 lines": ``n`` and ``noun``, plural but for 1."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def unaligned(src, n_src: int, tgt, n_tgt: int) -> InputError:
    """The error for a source and target of ``n_src`` and ``n_tgt`` lines: it names the shorter file
    at the first line it lacks, and both counts."""
    return InputError(src if n_src < n_tgt else tgt, min(n_src, n_tgt) + 1,
                      f"source and target line counts differ: source {src} has {count_of(n_src, 'line')}, "
                      f"target {tgt} has {count_of(n_tgt, 'line')}")


def read_pairs(src: Path, tgt: Path, what: str = "") -> Iterator[tuple[int, str, str]]:
    """(line number, source line, target line); an ``InputError`` if the line counts differ, or if
    there are none (``what``, as "valid", names the corpus in it)."""
    src_lines, tgt_lines = read_lines(src), read_lines(tgt)
    n = 0
    for n, (s, t) in enumerate(zip_longest(src_lines, tgt_lines), 1):
        if s is None or t is None:
            n_src = n - 1 + (s is not None) + sum(1 for _ in src_lines)
            n_tgt = n - 1 + (t is not None) + sum(1 for _ in tgt_lines)
            raise unaligned(src, n_src, tgt, n_tgt)
        yield n, s, t
    if n == 0:
        raise InputError(src, None, f"empty {what + ' ' if what else ''}corpus: no lines (target {tgt})")


def check_line_counts(a, n_a: int, b, n_b: int) -> None:
    """Files ``a`` and ``b`` (names) hold one sentence a line for each other: the same number of lines,
    else an ``InputError`` naming the shorter file at the first line it lacks (as ``read_pairs``);
    and some lines at all."""
    if n_a != n_b:
        raise InputError(a if n_a < n_b else b, min(n_a, n_b) + 1,
                         f"line counts differ: {a} has {count_of(n_a, 'line')}, {b} has {n_b}")
    if n_a == 0:
        raise UserError(f"{a} and {b} have no lines: nothing to score")


def input_chunks(path: str | None, size: int = CHUNK_LINES, what: str = "--input") -> Iterator[tuple[int, list[str]]]:
    """(first line number, lines) chunks of at most ``size`` lines of the input (``what`` in errors);
    stdin is read a line at a time, so a chunk is given as soon as its last line has arrived."""
    if path is None:
        lines = stdin_lines()
    else:
        check_readable(Path(path), what, stream=True)
        lines = read_lines(Path(path))
    chunk, first = [], 1
    for line in lines:
        chunk.append(line)
        if len(chunk) == size:
            yield first, chunk
            first, chunk = first + len(chunk), []
    if chunk:
        yield first, chunk
