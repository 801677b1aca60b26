"""The documents name code that exists. Two forms of reference are checked, in docs/*.md, README.md,
BENCHMARKS.md and bench/README.md:

* a file and the names in it, "`train/step.py`: `TrainStep.passes`, `update`": the file exists (under
  src/aiayn or the repository) and defines each name, at its top level or, for ``Class.member``, in
  the class's body (a method, or a field or attribute assigned there or in its methods as ``self.X``);
* a dotted name, "`aiayn.train.step.TrainStep`" (in the documents and in the package's docstrings):
  it imports, and each part after the module is an attribute of the one before;
* a command line, "`aiayn translate --beam-size 4`" (in a code span, or a line of a code block with
  its continuations): each option after the command is one that command's parser takes;
* a setting, "`train.max_bad_steps`", "`--set model.d_ff=512`": a field of that section's dataclass;
* a bench command line, "`RESULTS=DIR bash bench/gpu_check.sh tests translate`", "`python
  bench/gpu_train.py --sizes base`" (also in the bench scripts' own usage text and shell lines): the script
  is there, each option is one its argparse (or benchlib's shared options) defines, and a shell script's
  stage words are ones its ``case`` or its table of parts takes;
* a results folder or file, "`bench/results/amd-epyc-zen5-2026-11-26/attention_sweep.json`": it is there.

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


def _joined(lines: list[str]) -> list[str]:
    """The lines, one ending in a backslash joined with the next."""
    out, joined = [], ""
    for line in lines:
        joined += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            out.append(joined)
            joined = ""
    return out


def _command_lines(text: str) -> list[str]:
    """The places a document writes a command: its code spans (one may wrap onto the paragraph's next
    line; a table's row is a paragraph of its own) and its code blocks' lines, a line ending in a
    backslash joined with the next."""
    lines, block, paragraph = [], None, []

    def spans(text: str) -> list[str]:
        return [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", text)]

    for line in [*text.splitlines(), ""]:
        if line.lstrip().startswith("```"):
            lines.extend(_joined(block) if block is not None else spans("\n".join(paragraph)))
            block, paragraph = ([] if block is None else None), []
        elif block is not None:
            block.append(line)
        elif line.strip() and not line.lstrip().startswith("|"):
            paragraph.append(line)
        else:
            lines.extend([*spans("\n".join(paragraph)), *spans(line)])
            paragraph = []
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


BENCH = ROOT / "bench"
# A bench script run: after an interpreter (python, .venv/bin/python, bash, $PY), or first on its line
# after any environment assignments (`RESULTS=DIR bench/gpu_check.sh env`); without its folder
# (`train_throughput.py --size base`) in bench/README.md, or where bench/ has a script of that name.
BENCH_COMMAND = re.compile(r"(?:(?<![\w./$-])(?:[\w./-]*python3?|bash|sh|\$PY)\s+|^\s*(?:[A-Za-z_]\w*=\S*\s+)*)"
                           r"(?:\./)?(bench/)?(\w+\.(?:py|sh))\b")
BENCH_FILE = re.compile(r"(?<![\w.-])bench/(\w+\.(?:py|sh))\b")
BENCH_OPTION = re.compile(r"(?<![\w-])(--?[a-zA-Z][\w-]*)")
BENCH_END = re.compile(COMMAND_END.pattern + r"|(?:^|\s)#")  # and a comment
SHELL_PART = re.compile(r'\[([\w-]+)\]="(\w+\.py)([^"]*)"')  # run_all.sh: [part]="script.py --size small"
# A results folder (machine and date) and what in it: `bench/results/amd-epyc-zen5-2026-11-26/x.json`.
RESULTS = re.compile(r"(?<![\w/-])(?:bench/results/)?([a-z][a-z0-9-]*-20\d\d-\d\d-\d\d)(/[\w.*{},/-]*)?")


def _shell_lines(text: str) -> list[str]:
    """A bench shell script as command lines: its comments' usage lines uncommented, an array's words in
    place of ``"${NAME[@]}"`` (every definition's, for a name defined twice), and each entry of a table
    from a word to the bench script it runs (``[part]="script.py --size small"``) as a line of its own."""
    arrays: dict[str, str] = {}
    for name, words in re.findall(r"\b(\w+)=\(([^()]*)\)", text):
        arrays[name] = f"{arrays.get(name, '')} {' '.join(words.split())}"
    text = re.sub(r'"?\$\{(\w+)\[[@*]\]\}"?', lambda m: arrays.get(m.group(1), m.group(0)), text)
    parts = [f"python bench/{script}{args}" for _, script, args in SHELL_PART.findall(text)]
    return [*_joined([re.sub(r"^\s*#", "", line) for line in text.splitlines()]), *parts]


def _bench_texts() -> list[tuple[str, list[str]]]:
    """(where, command lines) of the documents, the bench Python scripts' docstrings and the bench shell
    scripts."""
    texts = [(str(doc.relative_to(ROOT)), _command_lines(doc.read_text(encoding="utf-8"))) for doc in DOCUMENTS]
    for path in sorted(BENCH.glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        texts.append((f"bench/{path.name}", _joined(doc.splitlines())))
    texts += [(f"bench/{p.name}", _shell_lines(p.read_text(encoding="utf-8"))) for p in sorted(BENCH.glob("*.sh"))]
    return texts


def _bench_commands(where: str, lines: list[str]) -> list[tuple[str, str, str]]:
    """(where, script, its arguments) for every command line that runs a bench script, up to the next
    command, pipe, redirection or comment."""
    found = []
    for line in lines:
        for m in BENCH_COMMAND.finditer(line):
            if not (m.group(1) or where == "bench/README.md" or (BENCH / m.group(2)).is_file()):
                continue
            rest = line[m.end():]
            found.append((where, m.group(2), rest[:end.start()] if (end := BENCH_END.search(rest)) else rest))
    return found


def _option_names(script: str, call: ast.Call) -> set[str]:
    names = set()
    for arg in call.args:
        if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
            raise AssertionError(f"bench/{script}:{call.lineno}: an option whose name is computed; write it literally")
        names |= {arg.value} if arg.value.startswith("-") else set()
    return names


@functools.cache
def _shared_options() -> dict[str, frozenset[str]]:
    """The functions of bench/benchlib.py that add options to a script's parser (``add_common_args``)."""
    tree = ast.parse((BENCH / "benchlib.py").read_text(encoding="utf-8"))
    shared = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            calls = [c for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                     and c.func.attr == "add_argument"]
            if calls:
                shared[node.name] = frozenset(n for c in calls for n in _option_names("benchlib.py", c))
    return shared


@functools.cache
def _script_options(script: str) -> frozenset[str]:
    """The options a bench Python script takes: the names its ``add_argument`` calls write, those of the
    benchlib functions it calls (``bl.add_common_args(ap)``) and -h/--help; none for a script that reads
    ``sys.argv`` by position."""
    options: set[str] = set()
    for node in ast.walk(ast.parse((BENCH / script).read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if called == "ArgumentParser":
                options |= {"-h", "--help"}
            elif called == "add_argument":
                options |= _option_names(script, node)
            options |= _shared_options().get(called, frozenset())
    return frozenset(options)


@functools.cache
def _shell_arguments(script: str) -> tuple[frozenset[str], frozenset[str]] | None:
    """The words (stages, parts) and options a bench shell script takes: the patterns of its
    ``case $1 in`` over its arguments, and the keys of a table from a word to the bench script it runs
    (run_all.sh's parts); None for a script that has neither (its arguments are values: a revision)."""
    text = (BENCH / script).read_text(encoding="utf-8")
    patterns = [p for block in re.findall(r'case "?\$1"? in\n(.*?)\besac', text, re.S)
                for m in re.finditer(r"^\s*([^\s()]+)\)", block, re.M) for p in m.group(1).split("|")]
    patterns += [part for part, _, _ in SHELL_PART.findall(text)]
    if not patterns:
        return None
    return (frozenset(p for p in patterns if not p.startswith("-") and "*" not in p),
            frozenset(p.split("=")[0] for p in patterns if p.startswith("-")))


def _wrong_bench_arguments(script: str, arguments: str) -> list[str]:
    """The options (and, for a shell script with stages, the words) ``arguments`` gives ``script`` that it
    does not take; a word right after an option is that option's value."""
    if not (BENCH / script).is_file():
        return ["(no such file)"]
    if script.endswith(".py"):
        return [o for o in BENCH_OPTION.findall(arguments) if o not in _script_options(script)]
    if (taken := _shell_arguments(script)) is None:
        return []
    (words, options), wrong, after_option = taken, [], False
    for token in arguments.replace("[", " ").replace("]", " ").split():
        name = token.split("=")[0]
        if BENCH_OPTION.fullmatch(name):
            wrong += [] if name in options else [name]
            after_option = "=" not in token
            continue
        if not after_option and re.fullmatch(r"[a-z][\w-]*", token) and token not in words:
            wrong.append(token)
        after_option = False
    return wrong


def _results_references(text: str) -> list[tuple[str, str]]:
    """(results folder, what in it: '' or a path, a glob or a ``{a,b}`` choice) named in code spans."""
    return [(m.group(1), (m.group(2) or "").strip("/.")) for line in _command_lines(text)
            for m in RESULTS.finditer(line)]


def _results_exist(folder: str, inside: str) -> bool:
    base = BENCH / "results" / folder
    if not inside:
        return base.is_dir()
    head, choices, tail = re.fullmatch(r"([^{]*)(?:\{([^}]*)\}(.*))?", inside).groups()
    paths = [head + c + tail for c in choices.split(",")] if choices is not None else [head]
    return all(any(base.glob(p)) for p in paths)


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


def test_bench_command_lines_exist():
    """Every command line that runs a bench script, in the documents and in the bench scripts' usage text,
    names a script that is there and gives it only options it takes (and a shell script's stages only
    words its ``case`` or its table of parts takes)."""
    commands = [c for where, lines in _bench_texts() for c in _bench_commands(where, lines)]
    assert len(commands) >= 100 and {"gpu_check.sh", "run_all.sh", "gpu_train.py"} <= {s for _, s, _ in commands}
    wrong = [f"{where}: bench/{script} {w}" for where, script, arguments in commands
             for w in _wrong_bench_arguments(script, arguments)]
    assert not wrong, "bench arguments the script does not take:\n" + "\n".join(sorted(set(wrong)))


def test_named_bench_files_exist():
    """Every bench script a document or a bench script names, in a command or in prose, is there."""
    texts = [(str(d.relative_to(ROOT)), d.read_text(encoding="utf-8")) for d in DOCUMENTS]
    scripts = sorted([*BENCH.glob("*.py"), *BENCH.glob("*.sh")])
    texts += [(f"bench/{p.name}", p.read_text(encoding="utf-8")) for p in scripts]
    missing = sorted({f"{where}: bench/{name}" for where, text in texts for name in BENCH_FILE.findall(text)
                      if not (BENCH / name).is_file()})
    assert not missing, "bench files that are not there:\n" + "\n".join(missing)


def test_named_results_exist():
    """Every results folder and file a document names (`bench/results/<machine>-<date>/x.json`) is there."""
    refs = [(str(d.relative_to(ROOT)), folder, inside) for d in DOCUMENTS
            for folder, inside in _results_references(d.read_text(encoding="utf-8"))]
    assert len(refs) >= 50
    missing = sorted({f"{doc}: {folder}/{inside}" for doc, folder, inside in refs
                      if not _results_exist(folder, inside)})
    assert not missing, "results that are not there:\n" + "\n".join(missing)


def test_a_wrong_bench_argument_is_caught():
    """The bench checks themselves: options come from a script's add_argument calls and benchlib's shared
    ones, a shell script's words from its ``case``; environment assignments in front, a comment, an
    option's value and a placeholder are not arguments; a results file is judged by its folder."""
    text = ("Run `AIAYN_HEAP_TRIM=always python bench/heap_trim_ab.py --data d --steps 4 --no-such`,\n\n```bash\n"
            "RESULTS=DIR bash bench/gpu_check.sh env tests --minutes 6 trian  # then demo --members\n"
            "BENCH_RESULTS=bench/results/x bash bench/run_all.sh translate_small translate_big\n"
            ".venv/bin/python bench/translate_throughput.py --size small --reps 2 \\\n    --beam-width 4\n"
            "bash bench/gpu_check.sh demo [--set SECTION.FIELD=VALUE] && python bench/nothing.py\n```\n"
            "then `bench/results/intel-xeon-amx-2026-11-25/alpha_choice_en-de.json`, "
            "`bench/results/intel-xeon-amx-2026-11-25/no_such.json`, `amd-epyc-zen5-2026-11-26`.\n")
    commands = _bench_commands("x.md", _command_lines(text))
    assert [s for _, s, _ in commands] == ["heap_trim_ab.py", "gpu_check.sh", "run_all.sh", "translate_throughput.py",
                                         "gpu_check.sh", "nothing.py"]
    assert [_wrong_bench_arguments(s, a) for _, s, a in commands] == [
        ["--no-such"], ["trian"], ["translate_big"], ["--beam-width"], [], ["(no such file)"]]
    assert {"--reps", "--budget-s"} <= _script_options("translate_throughput.py")  # benchlib.add_common_args
    assert _script_options("decode_ab.py") == frozenset()  # sys.argv by position
    assert _shell_arguments("beam_attention_ab.sh") is None  # its argument is a revision
    bare = ["train_throughput.py --size base --no-such", "loader.py --no-such"]  # without bench/
    assert [(s, _wrong_bench_arguments(s, a)) for _, s, a in _bench_commands("bench/README.md", bare)] == [
        ("train_throughput.py", ["--no-such"]), ("loader.py", ["(no such file)"])]
    assert [s for _, s, _ in _bench_commands("x.md", bare)] == ["train_throughput.py"]  # loader.py: not bench's
    assert [r for r in _results_references(text) if not _results_exist(*r)] == [
        ("intel-xeon-amx-2026-11-25", "no_such.json")]
