"""No ``aiayn`` command takes an abbreviated long option: argparse's prefix matching would read
``aiayn demo --train a.en`` as ``--train-lines a.en``, so a misspelt option, or one a later
version adds, would land silently on another. Every parser of the tree is walked, so a command
added later without ``allow_abbrev=False`` fails here."""
from __future__ import annotations

import argparse

import pytest

from aiayn.cli import build_parser, main


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("aiayn",)):
    """``(path, parser)`` for ``parser`` and every sub-command parser below it, depth first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def _abbreviation(option: str, taken: set[str]) -> str | None:
    """The longest proper prefix of the long ``option`` that is no option of its own (None: every one is)."""
    for end in range(len(option) - 1, 2, -1):
        if option[:end] not in taken:
            return option[:end]
    return None


def _long_options(parser: argparse.ArgumentParser) -> list[str]:
    return [s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"]


ALL = list(_parsers(build_parser()))


def test_the_walk_reaches_nested_commands():
    names = {" ".join(path) for path, _ in ALL}
    assert {"aiayn", "aiayn demo", "aiayn parse demo", "aiayn data multi30k", "aiayn plot lr"} <= names
    assert len(ALL) > 25


@pytest.mark.parametrize("path,parser", ALL, ids=[" ".join(path) for path, _ in ALL])
def test_every_long_option_refuses_its_abbreviation(path, parser):
    for action in parser._actions:  # nothing required, so the one option given is all that is judged
        action.required = False
    taken = set(parser._option_string_actions)
    for option in _long_options(parser):
        abbrev = _abbreviation(option, taken)
        if abbrev is None:
            continue
        try:
            _, extras = parser.parse_known_args([abbrev])
        except SystemExit:  # it took the abbreviation for the option and wanted a value
            pytest.fail(f"{' '.join(path)}: {abbrev} was read as {option}")
        assert extras == [abbrev], f"{' '.join(path)}: {abbrev} was read as {option}"


def test_demo_train_is_not_train_lines(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--train", "a.en"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument --train: expected 2 arguments" in err  # its own option (your files), not --train-lines
    args = build_parser().parse_args(["demo", "--train", "a.en", "a.de"])
    assert (args.train, args.train_lines) == (["a.en", "a.de"], 0)


def test_option_equals_value_is_still_read():
    args = build_parser().parse_args(["demo", "--train-lines=5", "--out=runs/x", "--set=train.seed=2"])
    assert (args.train_lines, args.out, args.set) == (5, "runs/x", ["train.seed=2"])
    args = build_parser().parse_args(["parse", "demo", "--minutes=1.5"])
    assert args.minutes == 1.5


@pytest.mark.parametrize("argv, said", [
    (["translate", "--checkpoint", "m.pt", "--beam-size", "four"], "argument --beam-size: expected int, got 'four'"),
    (["translate", "--checkpoint", "m.pt", "--alpha", "abc"], "argument --alpha: expected float, got 'abc'"),
    (["translate", "--checkpoint", "m.pt", "--c-kernels", "maybe"],
     "argument --c-kernels: expected a boolean (true/false), got 'maybe'"),
    (["serve", "--checkpoint", "m.pt", "--port", "abc"], "argument --port: expected int, got 'abc'")])
def test_a_bad_option_value_names_what_the_option_expects(argv, said, capsys):
    """Options made from a config's fields say what they expected, as argparse's own types do."""
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2
    assert f"error: {said}\n" in capsys.readouterr().err


@pytest.mark.parametrize("path, parser", ALL, ids=[" ".join(p) for p, _ in ALL])
def test_help_shows_no_docstring_markup(path, parser):
    """A description taken from a module docstring shows `code`, not reStructuredText's ``code``."""
    assert "``" not in parser.format_help()


def test_every_command_help_opens_with_a_description():
    """``aiayn train --help`` (and presets, average, export, import) listed options alone: what the
    command does was said only by ``aiayn --help``."""
    assert [" ".join(path) for path, parser in ALL if not parser.description] == []
