"""aiayn as a built package, installed without a checkout beside it: the sdist and the wheel carry the
package and the data its code reads (the C kernels' sources and headers, the recipes) and nothing of the
checkout's (tests, caches, compiled kernels); the version is written once; every third-party module the
code imports comes with a dependency, or with the extra of the commands that need it."""
from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

import aiayn
from aiayn.cli import main
from aiayn.kernels.loader import HEADERS, SOURCES

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "src" / "aiayn"
NOT_SHIPPED = re.compile(r"(^|/)__pycache__/|\.(pyc|so)$")  # caches and compiled kernels of a working tree
# the modules that need an extra, by the extra: imported only inside the commands that use them
# (``aiayn serve`` says which extra to install where its import fails)
EXTRA_MODULES = {"aiayn/serve/app.py": "serve", "aiayn/serve/server.py": "serve", "aiayn/kernels/triton_loss.py": "gpu"}


def _package_files() -> set[str]:
    """The files of the package in the working tree, as the wheel names them (aiayn/...)."""
    files = {p.relative_to(PACKAGE.parent).as_posix() for p in PACKAGE.rglob("*") if p.is_file()}
    return {f for f in files if not NOT_SHIPPED.search(f)}


def _build(hook: str, source: Path, out: Path) -> Path:
    """setuptools' PEP 517 ``hook`` (build_sdist, build_wheel) run in ``source``, as pip and ``python -m
    build`` run it; the built file."""
    out.mkdir(exist_ok=True)
    done = subprocess.run([sys.executable, "-c", f"from setuptools import build_meta; print(build_meta.{hook}({str(out)!r}))"],
                          cwd=source, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out / done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    """(the sdist, the wheel built from it): the sdist from a copy of the checkout's files the build reads
    (and of tests/, which it must leave out), so the checkout gets no build/ or egg-info."""
    pytest.importorskip("setuptools", minversion="70.1")  # its own bdist_wheel (pyproject asks >= 68: the wheel package then)
    tmp = tmp_path_factory.mktemp("build")
    tree = tmp / "tree"
    shutil.copytree(PACKAGE, tree / "src" / "aiayn")  # caches and all: the build must leave them out
    shutil.copytree(REPO / "tests", tree / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "MANIFEST.in"):
        shutil.copy(REPO / name, tree / name)
    sdist = _build("build_sdist", tree, tmp / "dist")
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp / "unpacked", filter="data")
    wheel = _build("build_wheel", tmp / "unpacked" / sdist.name.removesuffix(".tar.gz"), tmp / "dist")
    return sdist, wheel


def test_the_wheel_holds_the_package_and_its_data(built):
    """Every file of src/aiayn (the kernels' C sources and headers, the recipes) and nothing more; the
    wheel is built from the sdist, so a file the sdist lacks is missing here too."""
    names = zipfile.ZipFile(built[1]).namelist()
    package = {n for n in names if n.startswith("aiayn/")}
    assert package == _package_files()
    for needed in (*SOURCES, *HEADERS):  # what loader.py compiles
        assert f"aiayn/kernels/{needed.name}" in package
    assert {f"aiayn/recipes/{p.name}" for p in (PACKAGE / "recipes").glob("*.json")} <= package
    assert {"aiayn/recipes/multi30k.json", "aiayn/recipes/multi30k-quick.json"} <= package  # the demo's defaults
    info = [n for n in names if not n.startswith("aiayn/")]
    assert all(n.startswith(f"aiayn-{aiayn.__version__}.dist-info/") for n in info), info


def test_the_wheels_metadata_is_pyprojects(built):
    """Its version is ``aiayn.__version__`` (the one place it is written), its requirements and extras
    pyproject's, its command ``aiayn``."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wheel = zipfile.ZipFile(built[1])
    info = f"aiayn-{aiayn.__version__}.dist-info"
    meta = wheel.read(f"{info}/METADATA").decode()
    assert f"\nVersion: {aiayn.__version__}\n" in meta
    assert f"\nRequires-Python: {project['requires-python']}\n" in meta
    requires = [line.removeprefix("Requires-Dist: ") for line in meta.splitlines() if line.startswith("Requires-Dist: ")]
    assert [r for r in requires if "extra ==" not in r] == project["dependencies"]
    assert {line.removeprefix("Provides-Extra: ") for line in meta.splitlines() if line.startswith("Provides-Extra: ")} \
        == set(project["optional-dependencies"])
    assert "aiayn = aiayn.cli:main" in wheel.read(f"{info}/entry_points.txt").decode()


def test_the_sdist_holds_no_tests(built):
    """The tests need the whole checkout (docs/, scripts/, bench/): none travel in the sdist."""
    with tarfile.open(built[0]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert not any(n == "tests" or n.startswith("tests/") for n in names), sorted(n for n in names if "tests" in n)
    assert {"pyproject.toml", "README.md", "src/aiayn/cli.py", "src/aiayn/kernels/bf16.h",
            "src/aiayn/recipes/multi30k.json"} <= names
    assert not any(NOT_SHIPPED.search(n) for n in names)


def test_the_installed_package_runs_without_a_checkout(built, tmp_path):
    """The wheel's files on the path before the checkout's, run from a folder with no recipes/: the
    version names the installed package, and the docs' ``recipes/NAME.json`` is the installed recipe."""
    site = tmp_path / "site"
    zipfile.ZipFile(built[1]).extractall(site)
    work = tmp_path / "work"
    work.mkdir()
    code = ("import sys; from aiayn.cli import main; from aiayn.train.config import load_recipe; "
            "print(load_recipe('recipes/multi30k-quick.json').train.max_time_min); sys.exit(main(['--version']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=work, capture_output=True, text=True, timeout=120,
                          env=os.environ | {"PYTHONPATH": str(site)})
    assert done.returncode == 0, done.stderr[-3000:]
    minutes, version = done.stdout.splitlines()
    assert float(minutes) > 0
    assert version.startswith(f"aiayn {aiayn.__version__} from {site / 'aiayn'} (torch ")


def test_version_says_which_aiayn_runs(capsys):
    for flag in ("--version", "-V"):
        with pytest.raises(SystemExit) as done:
            main([flag])
        assert done.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"aiayn {aiayn.__version__} from {os.path.dirname(os.path.abspath(aiayn.__file__))} (torch ")
        assert out.count("\n") == 1  # one line, however long the path (argparse's version action wraps it)
        assert f", Python {sys.version_info.major}.{sys.version_info.minor}." in out


def test_the_version_is_written_once():
    """pyproject.toml takes it from ``aiayn.__version__`` (no second copy to fall behind)."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "aiayn.__version__"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(requirements: list[str]) -> set[str]:
    """The distributions ``requirements`` bring (normalized names), with what they require in turn (their
    own extras aside), as installed here; one not installed counts as itself."""
    seen: set[str] = set()
    todo = [re.match(r"[A-Za-z0-9._-]+", r).group() for r in requirements]
    while todo:
        name = _norm(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += [re.match(r"[A-Za-z0-9._-]+", r).group() for r in importlib.metadata.requires(name) or []
                     if "extra ==" not in r]
        except importlib.metadata.PackageNotFoundError:
            pass
    return seen


def _third_party_imports(path: Path) -> list[tuple[str, bool]]:
    """(top-level module, imported at the module's top level) of each import of ``path`` outside the
    standard library and aiayn; an import inside a function runs only when that function does."""
    found = []

    def walk(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((a.name.split(".")[0], top) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.append((child.module.split(".")[0], top))
            walk(child, top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
    walk(ast.parse(path.read_text()), True)
    return [(m, top) for m, top in found if m not in sys.stdlib_module_names and m not in ("aiayn", "__future__")]


def test_every_import_comes_with_a_dependency_or_its_extra():
    """A plain ``pip install aiayn`` imports every module but those of ``EXTRA_MODULES``, which import only
    what their extra brings (``pip install 'aiayn[serve]'`` serves); an import inside a function needs a
    dependency or some extra; no module imports an extra's module at its top level."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = _closure(project["dependencies"])
    extras = {name: _closure(reqs) for name, reqs in project["optional-dependencies"].items() if name != "test"}
    dists = {m: {_norm(d) for d in ds} for m, ds in importlib.metadata.packages_distributions().items()}
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE.parent).as_posix()
        extra = EXTRA_MODULES.get(name)
        for module, top in _third_party_imports(path):
            brought = dists.get(module, {_norm(module)})
            allowed = core | (extras[extra] if extra else set()) if top else core.union(*extras.values())
            if not brought & allowed:
                wrong.append(f"{name}: {module} ({'top level' if top else 'in a function'})")
        for node in ast.parse(path.read_text()).body:  # top-level imports of an extra's module, from outside them
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            for module in modules:
                if module.replace(".", "/") + ".py" in EXTRA_MODULES and not extra:
                    wrong.append(f"{name}: imports {module} at its top level")
    assert not wrong, wrong
