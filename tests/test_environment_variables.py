"""Every ``AIAYN_*`` environment variable that aiayn's code or scripts read is named in the docs, and
every one the docs name is read somewhere (a variable nobody reads would be a setting that does nothing)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"\bAIAYN_[A-Z0-9_]*[A-Z0-9]\b")
HEADER_GUARD = re.compile(r"_H$")  # the C kernels' include guards (AIAYN_BF16_H), not variables


def _names(paths) -> set[str]:
    return {n for p in paths for n in NAME.findall(p.read_text(encoding="utf-8")) if not HEADER_GUARD.search(n)}


def _code() -> list[Path]:
    return [*ROOT.glob("src/aiayn/**/*.py"), *(p for p in ROOT.glob("scripts/**/*") if p.is_file())]


def _docs() -> list[Path]:
    return [*ROOT.glob("docs/*.md"), ROOT / "README.md"]


def test_every_variable_the_code_reads_is_documented():
    assert sorted(_names(_code()) - _names(_docs())) == []


def test_every_documented_variable_is_read():
    read = _names(_code()) | _names(ROOT.glob("tests/**/*.py"))  # the tests' own switches among them
    assert sorted(_names(_docs()) - read) == []
