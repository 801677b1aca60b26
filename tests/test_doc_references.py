"""The documents name code that exists. Two forms of reference are checked, in docs/*.md, README.md,
BENCHMARKS.md and bench/README.md:

* a file and the names in it, "`train/step.py`: `TrainStep.passes`, `update`": the file exists (under
  src/aiayn or the repository) and defines each name, at its top level or, for ``Class.member``, in
  the class's body (a method, or a field or attribute assigned there or in its methods as ``self.X``);
* a dotted name, "`aiayn.train.step.TrainStep`" (in the documents and in the package's docstrings):
  it imports, and each part after the module is an attribute of the one before;
* a command line, "`aiayn translate --beam-size 4`" (in a code span, or a line of a code block with
  its continuations): each option after the command is one that command's parser takes;
* a setting, "`train.max_bad_steps`", "`--set model.d_ff=512`": a field of that section's dataclass.

A reference left behind by a move or a rename is a reader sent to code that is not there.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "aiayn"
DOCUMENTS = sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "bench" / "README.md"])
FILE_AND_NAMES = re.compile(r"`([\w/]+\.py)`:((?:\s*`[\w.]+`,?)+)")
DOTTED = re.compile(r"`{1,2}(aiayn(?:\.\w+)+)(?:\(\))?`{1,2}")
NOT_CODE = {"json", "md", "txt", "pt"}  # `aiayn.json`: a file's name


@functools.cache
def _defined(path: Path) -> frozenset[str]:
    """The names ``path`` defines: top-level functions, classes and assignments, and ``Class.member``
    for the members of its classes (methods, class-level assignments, ``self.X`` in methods)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()

    def targets(node) -> list[str]:
        if isinstance(node, ast.Assign):
            return [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            return [node.target.id]
        return []

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        names.update(targets(node))
        if isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(f"{node.name}.{member.name}")
                names.update(f"{node.name}.{n}" for n in targets(member))
            for n in ast.walk(node):
                if (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
                        and n.value.id == "self"):
                    names.add(f"{node.name}.{n.attr}")
    return frozenset(names)


def _file_references() -> list[tuple[str, str, str]]:
    refs = []
    for doc in DOCUMENTS:
        for m in FILE_AND_NAMES.finditer(doc.read_text(encoding="utf-8")):
            refs.extend((doc.name, m.group(1), name) for name in re.findall(r"`([\w.]+)`", m.group(2)))
    return refs


def _dotted_references() -> list[tuple[str, str]]:
    sources = [*DOCUMENTS, *sorted(SRC.rglob("*.py"))]
    refs = {(str(f.relative_to(ROOT)), m.group(1)) for f in sources for m in DOTTED.finditer(f.read_text(encoding="utf-8"))
            if m.group(1).rsplit(".", 1)[-1] not in NOT_CODE}
    return sorted(refs)


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True
    return False


COMMAND = re.compile(r"(?<![\w-])aiayn(?:\.cli)?\s+([a-z][\w-]*)(?:\s+([a-z][\w-]*))?")
OPTION = re.compile(r"(?<![\w-])(--[a-z][\w-]*)")
COMMAND_END = re.compile(r"\|\||&&|;|(?<!\\)\|\s|[<>]\s|(?<![\w-])aiayn(?:\.cli)?\s")  # another command, a pipe, a redirection
# An option a document names on purpose as one the command refuses.
REFUSED_ON_PURPOSE = {("commands.md", "demo", "--eval")}
SETTING = re.compile(r"(?<![\w/.-])(model|train|decode|serve|demo)\.([a-z_][a-z0-9_]*)\b(?![./(-])")  # not a call
NOT_A_FIELD = {"py", "json", "jsonl", "md", "pt", "sh", "log", "txt", "en", "de", "fr", "src", "lock",
               "safetensors"}  # files: `train.en`, `model.safetensors`


def _command_lines(text: str) -> list[str]:
    """The places a document writes a command: its code spans and its code blocks' lines, a line
    ending in a backslash joined with the next."""
    lines, block, joined = [], False, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            block, joined = not block, ""
            continue
        if block:
            joined += line.rstrip("\\") + " "
            if not line.rstrip().endswith("\\"):
                lines.append(joined)
                joined = ""
        else:
            lines.extend(re.findall(r"`([^`]+)`", line))
    return lines


@functools.cache
def _parsers() -> dict[tuple[str, ...], set[str]]:
    """The options of every ``aiayn`` parser, by its command path (``("parse", "demo")``)."""
    from aiayn.cli import build_parser

    found = {}

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]):
        found[path] = set(parser._option_string_actions)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, (*path, name))
    walk(build_parser(), ())
    return found


def _command_options(doc: str, text: str) -> list[tuple[str, tuple[str, ...], str]]:
    """(document, command path, option) for every option written after an ``aiayn`` command."""
    parsers, refs = _parsers(), []
    for line in _command_lines(text):
        for m in COMMAND.finditer(line):
            path = (m.group(1), m.group(2)) if (m.group(1), m.group(2)) in parsers else (m.group(1),)
            if path not in parsers:
                continue
            rest = line[m.end(len(path)):]
            rest = rest[:m2.start()] if (m2 := COMMAND_END.search(rest)) else rest
            refs.extend((doc, path, option) for option in OPTION.findall(rest))
    return refs


def _settings(text: str) -> list[tuple[str, str]]:
    return [(section, field) for section, field in SETTING.findall(text) if field not in NOT_A_FIELD]


@functools.cache
def _fields() -> dict[str, set[str]]:
    from aiayn.decode.config import DecodeConfig
    from aiayn.demo.config import DemoConfig
    from aiayn.model.config import ModelConfig
    from aiayn.serve.config import ServeConfig
    from aiayn.train.config import TrainConfig
    return {section: {f.name for f in dataclasses.fields(cls)} for section, cls in
            (("model", ModelConfig), ("train", TrainConfig), ("decode", DecodeConfig), ("serve", ServeConfig),
             ("demo", DemoConfig))}


def test_the_documents_reference_code_in_both_forms():
    """The patterns find what they are for (a pattern that matched nothing would pass any document)."""
    assert len(_file_references()) >= 20 and len(_dotted_references()) >= 100
    texts = [(doc.name, doc.read_text(encoding="utf-8")) for doc in DOCUMENTS]
    assert sum(len(_command_options(name, text)) for name, text in texts) >= 200
    assert sum(len(_settings(text)) for _, text in texts) >= 200


def test_command_options_exist():
    """Every option a document gives an ``aiayn`` command is one that command takes."""
    parsers, wrong = _parsers(), []
    for doc in DOCUMENTS:
        for name, path, option in _command_options(doc.name, doc.read_text(encoding="utf-8")):
            if option not in parsers[path] and (name, " ".join(path), option) not in REFUSED_ON_PURPOSE:
                wrong.append(f"{name}: aiayn {' '.join(path)} {option}")
    assert not wrong, "options the command does not take:\n" + "\n".join(sorted(set(wrong)))


def test_settings_are_fields():
    """Every ``section.field`` a document or recipe names is a field of that section's dataclass."""
    fields, wrong = _fields(), []
    for doc in [*DOCUMENTS, *sorted(ROOT.glob("recipes/*.json"))]:
        for section, field in _settings(doc.read_text(encoding="utf-8")):
            if field not in fields[section]:
                wrong.append(f"{doc.name}: {section}.{field}")
    assert not wrong, "settings that are no field:\n" + "\n".join(sorted(set(wrong)))


def test_named_files_define_the_names():
    missing = []
    for doc, rel, name in _file_references():
        path = next((p for p in (SRC / rel, ROOT / rel) if p.is_file()), None)
        if path is None:
            missing.append(f"{doc}: `{rel}` (no such file)")
        elif name not in _defined(path):
            missing.append(f"{doc}: `{rel}`: `{name}`")
    assert not missing, "references to code that is not there:\n" + "\n".join(missing)


@pytest.mark.parametrize("where, dotted", _dotted_references())
def test_dotted_names_import(where, dotted):
    assert _resolves(dotted), f"{where}: `{dotted}` does not import"


def test_a_moved_name_is_caught(tmp_path):
    """The checks themselves: what a file defines, members by their class; a dotted name that moved, or
    whose module is not there, does not resolve."""
    f = tmp_path / "m.py"
    f.write_text("class A:\n    x: int = 0\n    def f(self):\n        self.y = 1\n\ndef g():\n    pass\n")
    assert _defined(f) == {"A", "A.x", "A.f", "A.y", "g"}
    assert _resolves("aiayn.train.updates.update") and _resolves("aiayn.checkpoint.run.RunCheckpoints.save")
    assert not _resolves("aiayn.train.loop.make_step") and not _resolves("aiayn.train.no_such_module.f")


def test_a_wrong_option_or_setting_is_caught():
    """The command-line and setting checks themselves: an option is judged by the command it follows
    (a continued line of a code block too), not by one after a pipe; a file's name is no setting."""
    text = ("Run `aiayn translate --beam-size 4 | aiayn score --ref r.de` or\n\n```bash\n"
            "aiayn parse demo --out d \\\n    --beam-size 4\n```\nthen `train.max_bad_steps`, `train.en`, `model.encode(src)`.\n")
    refs = _command_options("x.md", text)
    assert [(p, o) for _, p, o in refs] == [(("translate",), "--beam-size"), (("score",), "--ref"),
                                            (("parse", "demo"), "--out"), (("parse", "demo"), "--beam-size")]
    assert "--beam-size" in _parsers()[("translate",)] and "--beam-size" not in _parsers()[("score",)]
    assert _settings(text) == [("train", "max_bad_steps")]
    assert "max_bad_steps" in _fields()["train"] and "max_bad_step" not in _fields()["train"]
