"""Docstrings give reasons, not timings: no module, class or function docstring under src/aiayn
states a measured speed or duration. Measurements live in BENCHMARKS.md and docs/, where they
carry their machine and date; a docstring says why and may point there.

What counts as a timing here:
- a speed: a number of tokens, sentences, lines or steps per second, bytes or FLOPs per second;
- a relative speed: "1.25x faster", "12.6x slower", "2-3x as long", "+5.5%", "15% of the peak";
- a duration: a number with a unit of time ("12 ms", "about 1 s", "20 minutes"). A setting's
  value is no exception: it lives in its field or constant (with its help text), and the
  docstring names that instead of repeating the number;
- a measured memory comparison ("2,351 MB against 2,444 MB").
Not timings: units without a number ("minutes between checkpoints"), sizes in an argument
("2 MB pages", "over 100 MB at 4,096 tokens"), counts ("3x the forward FLOPs").
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "aiayn"

_NUM = r"\d(?:[\d,]*\d)?(?:\.\d+)?"
_RANGE = rf"{_NUM}(?:\s?[-–]\s?{_NUM})?"
TIMING = re.compile("|".join([
    # speeds
    rf"{_NUM}\s?k?\s(?:\w+\s)?(?:tok(?:ens)?|sentences|sents|lines|words|steps|it)/s\b",
    rf"{_NUM}\s?(?:[KMGT]i?B|[GTP]FLOP)/s\b",
    rf"{_NUM}\s?[GTP]FLOPS\b",
    # relative speeds
    rf"{_RANGE}\s?(?:x|×|%|-fold|times)\s(?:\w+\s){{0,2}}?(?:faster|slower|quicker|as long|as fast|speed-?up)\b",
    rf"(?<![\w.])[+−]{_RANGE}%",
    rf"{_RANGE}\s?%\sof\s(?:the\s|its\s)?peak\b",
    # durations
    rf"{_RANGE}\s?-?(?:ms|µs|μs|us|ns|s|secs?|seconds?|mins?|minutes?|h|hours?|days?)\b(?!/)",
    # measured memory, compared
    rf"{_NUM}\s?[KMGT]i?B\s(?:\w+\s)?against\s{_NUM}",
]))

# Docstrings in model/, train/ and checkpoint.py that still state timings: their owners rewrite
# these files in the same change and clean them there; each entry is (file, docstring's owner).
# Remove an entry once its docstring is clean (test_exceptions_still_needed says which).
EXCEPTIONS: set[tuple[str, str]] = set()  # (file under src/aiayn, owner): a docstring the rule must let be


def _docstrings(path: Path):
    """(owner's qualified name, first line, docstring) of the module and of every class and function."""
    tree = ast.parse(path.read_text(encoding="utf-8"))

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                doc = ast.get_docstring(child, clean=False)
                if doc:
                    yield name, child.body[0].lineno, doc
                yield from walk(child, f"{name}.")

    doc = ast.get_docstring(tree, clean=False)
    if doc:
        yield "<module>", 1, doc
    yield from walk(tree, "")


def timings(src: Path = SRC) -> list[tuple[str, str, int, str]]:
    """Every timing in a docstring under ``src``: (file relative to src, owner, line, the text)."""
    found = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        for owner, line, doc in _docstrings(path):
            flat = " ".join(doc.split())  # a measurement may break across lines
            for m in TIMING.finditer(flat):
                found.append((rel, owner, line, m.group(0)))
    return found


def test_no_timings_in_docstrings():
    caught = [t for t in timings() if (t[0], t[1]) not in EXCEPTIONS]
    assert not caught, "timings in docstrings (move them to BENCHMARKS.md or docs/, keep the reason):\n" + \
        "\n".join(f"  src/aiayn/{f}:{line} {owner}: {text!r}" for f, owner, line, text in caught)


def test_exceptions_still_needed():
    caught = {(t[0], t[1]) for t in timings()}
    assert EXCEPTIONS <= caught, f"clean now, remove from EXCEPTIONS: {sorted(EXCEPTIONS - caught)}"


def test_what_counts_as_a_timing():
    def caught(text):
        return [m.group(0) for m in TIMING.finditer(text)]

    for timing in ("12 ms per step", "ran 1.25x faster than fp32", "12.6x slower", "took 2-3x as long",
                   "11,957 target tokens/s", "10,344 tok/s", "152.8 TFLOP/s", "(+5.5%)", "15.4% of the peak",
                   "takes about 1 s", "a whole 30-minute run", "in 20 minutes", "3.5 days on 8 P100",
                   "2,351 MB against 2,444 MB", "40 GB/s"):
        assert caught(timing), timing
    for reason in ("save_every_min: minutes between checkpoints", "max_time_min", "3x the forward FLOPs",
                   "2 MB instead of 4 kB pages", "over 100 MB at 4,096 tokens", "s (N, 1) float32, int8, s",
                   "the 95% interval", "100% by construction", "x (N, I) -> (N, O)", "d_model / h",
                   "(§6.1: 5 for base)", "several times slower"):
        assert not caught(reason), reason
