"""The documents name code that exists. Two forms of reference are checked, in docs/*.md, README.md,
BENCHMARKS.md and bench/README.md:

* a file and the names in it, "`train/step.py`: `TrainStep.passes`, `update`": the file exists (under
  src/aiayn or the repository) and defines each name, at its top level or, for ``Class.member``, in
  the class's body (a method, or a field or attribute assigned there or in its methods as ``self.X``);
* a dotted name, "`aiayn.train.step.TrainStep`" (in the documents and in the package's docstrings):
  it imports, and each part after the module is an attribute of the one before.

A reference left behind by a move or a rename is a reader sent to code that is not there.
"""
from __future__ import annotations

import ast
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


def test_the_documents_reference_code_in_both_forms():
    """The patterns find what they are for (a pattern that matched nothing would pass any document)."""
    assert len(_file_references()) >= 20 and len(_dotted_references()) >= 100


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
