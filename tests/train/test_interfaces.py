"""The training path's interfaces stay narrow, counted on the source of src/aiayn with ``ast``:

* the whole run configuration (``RunConfig``, model and train sections) is received by at most
  ``MAX_RUN_CONFIG_FILES`` files; every other part receives its section, or the values it needs;
* each ``TrainConfig`` field is read in at most ``MAX_FILES_PER_FIELD`` files;
* no function takes more than ``MAX_PARAMS`` parameters.

What counts (a simple pass, type-aware where the source says the type):

* A *TrainConfig expression*: a name annotated ``TrainConfig``; a parameter without an annotation
  named as this code names a TrainConfig (``CONVENTIONAL``); ``X.train`` that is not called
  (``model.train()`` is the module's mode) where ``X`` is not ``self``; ``TrainConfig(...)``;
  ``replace(E, ...)`` of one; a name or ``self.NAME`` assigned one (tuple assignments element by
  element). Names are followed within a function and into the functions nested in it;
  ``self.NAME`` within its class.
* A *field read*: ``E.F`` or ``getattr(E, "F")`` with ``E`` a TrainConfig expression and ``F`` a
  field of ``TrainConfig``. ``to_dict``, ``replace`` and ``fields`` go over every field and are not
  reads of one; nor is a key of a saved configuration's dict (a checkpoint's
  ``run_config["train"]``), which is the file's record, not the run's settings. train/config.py,
  which defines the fields, checks them and cuts sections out of them (``batching``), is not a
  reader; a section's fields (``Batching.accum_steps``) are the section's, read by the parts that
  receive it.
* A *RunConfig receiver*: a file with a function (a method, a constructor) that has a parameter
  annotated ``RunConfig``, or an unannotated one whose ``.train`` the function reads as a
  TrainConfig expression (``p.train.F``, ``t = p.train``), whose ``.model`` and ``.train`` it
  both reads, or that it passes on to a parameter annotated ``RunConfig`` of a package function.
  A file that makes one (``load_recipe``) and passes it on does not receive it.
* Parameters: positional, keyword-only, ``*args`` and ``**kwargs`` each count one; ``self`` and
  ``cls`` (the first parameter of a method that is not a staticmethod) do not.

What the pass cannot see by itself, a TrainConfig handed to a parameter that is neither annotated
nor conventionally named, ``test_train_configs_land_where_the_counter_looks`` finds: every call of a
package function or class that passes a TrainConfig expression must pass it to a parameter the
counter follows (the generic helpers of aiayn/config.py, ``replace`` and the like, aside).

Run this file as a script for the figures (``python tests/train/test_interfaces.py``).
"""
from __future__ import annotations

import ast
import dataclasses
from collections import defaultdict
from pathlib import Path

from aiayn.data.stream import Batching
from aiayn.train.config import TrainConfig, batching

SRC = Path(__file__).resolve().parents[2] / "src" / "aiayn"
DEFINITION = Path("train/config.py")
GENERIC = Path("config.py")  # replace, to_dict, apply_sets...: any configuration dataclass
FIELDS = frozenset(f.name for f in dataclasses.fields(TrainConfig))
CONVENTIONAL = frozenset({"t", "train_cfg"})  # unannotated parameters that hold a TrainConfig
MAX_RUN_CONFIG_FILES = 3
MAX_FILES_PER_FIELD = 2
MAX_PARAMS = 7
# Functions allowed more parameters, with why: {(file under src/aiayn, qualified name): reason}.
MANY_PARAMS = {
    (Path("kernels/triton_loss.py"), "_smoothed_ce_rows"):
        "a Triton kernel: its parameters are what it is launched with, pointers, a stride, sizes, scalars and "
        "constexprs, each of which Triton types and specializes on its own; a Python object that held them "
        "would have to be taken apart at the launch (smoothed_ce_rows, its 7-parameter caller, is that place)",
}


def _sources() -> list[tuple[Path, ast.Module]]:
    return [(p.relative_to(SRC), ast.parse(p.read_text(encoding="utf-8"))) for p in sorted(SRC.rglob("*.py"))]


def _annotated(node: ast.expr | None, name: str) -> bool:
    """Whether an annotation names ``name`` (``TrainConfig``, ``"TrainConfig"``, ``config.TrainConfig | None``)."""
    for n in ast.walk(node) if node is not None else ():
        if isinstance(n, ast.Name) and n.id == name or isinstance(n, ast.Attribute) and n.attr == name:
            return True
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            try:
                if _annotated(ast.parse(n.value, mode="eval").body, name):
                    return True
            except SyntaxError:
                pass
    return False


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.arg]:
    a = fn.args
    return [*a.posonlyargs, *a.args, *a.kwonlyargs, *([a.vararg] if a.vararg else []),
            *([a.kwarg] if a.kwarg else [])]


def _follows(p: ast.arg) -> bool:
    """Whether the counter takes parameter ``p`` for a TrainConfig."""
    return _annotated(p.annotation, "TrainConfig") or p.arg in CONVENTIONAL and p.annotation is None


class _TrainReads(ast.NodeVisitor):
    """The TrainConfig field reads of one module: {field: [line, ...]}."""

    def __init__(self) -> None:
        self.reads: dict[str, list[int]] = defaultdict(list)
        self.names: list[set[str]] = [set()]  # TrainConfig names in scope, innermost last
        self.self_attrs: list[set[str]] = [set()]  # self.NAME holding a TrainConfig, per enclosing class
        self.self_assigned: set[str] = set()  # self.NAME assigned a TrainConfig in this module's methods
        self.passed: list[tuple[str, int | str, int]] = []  # (callee, argument's position or keyword, line)

    def is_train(self, e: ast.expr) -> bool:
        if isinstance(e, ast.Name):
            return e.id in self.names[-1]
        if isinstance(e, ast.Attribute):
            if isinstance(e.value, ast.Name) and e.value.id == "self":
                return e.attr in self.self_attrs[-1]
            return e.attr == "train"
        if isinstance(e, ast.Call):
            f = e.func
            callee = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            return callee == "TrainConfig" or callee == "replace" and bool(e.args) and self.is_train(e.args[0])
        return False

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        probe = _TrainReads()  # a first pass: which self.NAME the methods assign a TrainConfig
        probe.names = [set(self.names[-1])]
        for stmt in node.body:
            probe.visit(stmt)
        self.self_attrs.append(probe.self_assigned)
        for stmt in node.body:
            self.visit(stmt)
        self.self_attrs.pop()

    def visit_FunctionDef(self, node) -> None:
        names = set(self.names[-1])
        for p in _params(node):
            if _follows(p):
                names.add(p.arg)
            elif p.arg in names:
                names.discard(p.arg)  # shadowed
        self.names.append(names)
        for stmt in node.body:
            self.visit(stmt)
        self.names.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        for target, value in _pairs(node):
            if isinstance(target, ast.Name):
                (self.names[-1].add if self.is_train(value) else self.names[-1].discard)(target.id)
            elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                    and target.value.id == "self" and self.is_train(value):
                self.self_assigned.add(target.attr)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.generic_visit(node)
        if isinstance(node.target, ast.Name) and (_annotated(node.annotation, "TrainConfig")
                                                  or node.value is not None and self.is_train(node.value)):
            self.names[-1].add(node.target.id)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in FIELDS and isinstance(node.ctx, ast.Load) and self.is_train(node.value):
            self.reads[node.attr].append(node.lineno)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Attribute) and node.func.attr == "train":
            for child in (*node.args, *node.keywords):  # model.train(): not a TrainConfig; its arguments may read one
                self.visit(child)
            self.visit(node.func.value)
            return
        if isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and node.args[1].value in FIELDS \
                and self.is_train(node.args[0]):
            self.reads[node.args[1].value].append(node.lineno)
        if isinstance(node.func, ast.Name):
            self.passed += [(node.func.id, i, node.lineno) for i, a in enumerate(node.args) if self.is_train(a)]
            self.passed += [(node.func.id, k.arg, node.lineno) for k in node.keywords if self.is_train(k.value)]
        self.generic_visit(node)


def _pairs(node: ast.Assign):
    """(target, value) pairs of an assignment, tuples element by element."""
    for target in node.targets:
        if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple) \
                and len(target.elts) == len(node.value.elts):
            yield from zip(target.elts, node.value.elts)
        else:
            yield target, node.value


def train_field_reads() -> dict[str, dict[Path, list[int]]]:
    """{TrainConfig field: {file under src/aiayn: [line of each read]}}, train/config.py left out."""
    out: dict[str, dict[Path, list[int]]] = defaultdict(dict)
    for path, tree in _sources():
        if path == DEFINITION:
            continue
        v = _TrainReads()
        v.visit(tree)
        for name, lines in v.reads.items():
            out[name][path] = lines
    return dict(out)


def _defs() -> dict[str, list[list[ast.arg]]]:
    """{name: the parameters of each package function or class (its ``__init__``, ``self`` left out)
    of that name}, the generic helpers of aiayn/config.py aside."""
    defs: dict[str, list[list[ast.arg]]] = defaultdict(list)
    for path, tree in _sources():
        if path == GENERIC:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                init = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
                if init is not None:
                    defs[node.name].append(_params(init)[1:])
        for name, fn, is_method in _functions(tree):
            if not is_method:
                defs[name.rpartition(".")[2]].append(_params(fn))
    return defs


def _argument_of(params: list[ast.arg], where: int | str) -> ast.arg | None:
    """The parameter an argument lands in: by position (``int``) or keyword (``str``)."""
    named = [p for p in params if p.arg == where] if isinstance(where, str) else params[where:where + 1]
    return named[0] if named else None


def _receives_run_config(fn, p: ast.arg, defs: dict[str, list[list[ast.arg]]] | None = None) -> bool:
    if _annotated(p.annotation, "RunConfig"):
        return True
    if p.annotation is not None:
        return False
    nodes = list(ast.walk(fn))
    is_p = lambda e: isinstance(e, ast.Name) and e.id == p.arg  # noqa: E731
    aliases = {target.id for n in nodes if isinstance(n, ast.Assign) for target, value in _pairs(n)
               if isinstance(target, ast.Name) and isinstance(value, ast.Attribute) and value.attr == "train"
               and is_p(value.value)}  # t = p.train
    sections = {n.attr for n in nodes
                if isinstance(n, ast.Attribute) and n.attr in ("train", "model") and is_p(n.value)}
    for n in nodes:
        if isinstance(n, ast.Attribute) and n.attr in FIELDS and (
                isinstance(n.value, ast.Attribute) and n.value.attr == "train" and is_p(n.value.value)
                or isinstance(n.value, ast.Name) and n.value.id in aliases):
            return True  # p.train.F, t.F
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and defs:  # passed on to a RunConfig parameter
            given = [*enumerate(n.args), *((k.arg, k.value) for k in n.keywords if k.arg is not None)]  # (**kw: no one parameter)
            for params in defs.get(n.func.id, []):
                for where, a in given:
                    q = _argument_of(params, where)
                    if is_p(a) and q is not None and _annotated(q.annotation, "RunConfig"):
                        return True
    return sections == {"train", "model"}


def _functions(tree: ast.Module):
    """(qualified name, function node, whether it is a method) of every function of a module."""
    def walk(node, prefix, in_class):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{prefix}{child.name}", child, in_class
                yield from walk(child, f"{prefix}{child.name}.", False)
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.", True)
            else:
                yield from walk(child, prefix, in_class)
    yield from walk(tree, "", False)


def run_config_receivers() -> dict[Path, list[str]]:
    """{file under src/aiayn: [function.parameter, ...]} of the parameters that receive a RunConfig."""
    out: dict[Path, list[str]] = defaultdict(list)
    defs = _defs()
    for path, tree in _sources():
        for name, fn, _ in _functions(tree):
            out[path] += [f"{name}.{p.arg}" for p in _params(fn) if _receives_run_config(fn, p, defs)]
    return {k: v for k, v in out.items() if v}


def parameter_counts() -> dict[tuple[Path, str], int]:
    """{(file under src/aiayn, function's qualified name): its parameters, ``self``/``cls`` not counted}."""
    out = {}
    for path, tree in _sources():
        for name, fn, is_method in _functions(tree):
            n = len(_params(fn))
            static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
            if is_method and not static and (fn.args.posonlyargs or fn.args.args):
                n -= 1
            out[path, name] = n
    return out


def test_run_config_received_by_few_files():
    receivers = run_config_receivers()
    assert len(receivers) <= MAX_RUN_CONFIG_FILES, receivers


def test_each_train_field_read_in_few_files():
    wide = {f: sorted(map(str, files)) for f, files in train_field_reads().items() if len(files) > MAX_FILES_PER_FIELD}
    assert not wide, wide


def test_no_function_takes_many_parameters():
    many = {k: n for k, n in parameter_counts().items() if n > MAX_PARAMS and k not in MANY_PARAMS}
    assert not many, many


def test_exceptions_still_needed():
    counts = parameter_counts()
    assert all(counts.get(k, 0) > MAX_PARAMS for k in MANY_PARAMS), "remove the entries that no longer apply"


def test_train_configs_land_where_the_counter_looks():
    """Each call of a package function (or class) by name that passes a TrainConfig expression passes
    it to a parameter the counter follows (annotated ``TrainConfig``, or ``CONVENTIONAL``)."""
    defs, unseen = _defs(), []
    for path, tree in _sources():
        v = _TrainReads()
        v.visit(tree)
        for callee, where, line in v.passed:
            for params in defs.get(callee, []):
                p = _argument_of(params, where)
                if p is not None and not _follows(p):
                    unseen.append(f"{path}:{line}: {callee}({p.arg}=...)")
    assert not unseen, unseen


def test_batching_is_the_train_fields_of_its_names():
    """The batches' section holds the TrainConfig fields of the same names, each copied (values
    other than the defaults, so that a field left at its default would show)."""
    names = [f.name for f in dataclasses.fields(Batching)]
    assert set(names) <= FIELDS
    t = TrainConfig(max_src_tokens=11, max_tgt_tokens=12, accum_steps=3, seed=14, max_epochs=5, bpe_dropout=0.25,
                    bpe_dropout_target=False)
    assert {n: getattr(batching(t), n) for n in names} == {n: getattr(t, n) for n in names}
    assert all(getattr(t, n) != getattr(TrainConfig(), n) for n in names)


def test_counter_sees_the_forms_it_documents():
    """The counter on a module written for it: each documented form is found, the look-alikes are not."""
    code = '''
def a(t, cfg: "RunConfig", other):
    cfg.train.seed                    # read: X.train.F
    t.max_steps                       # read: the conventional t
    other.device                      # not: unknown type
    model.train()                     # not: a module's mode
def b(x: TrainConfig):
    y = x
    return y.eps_ls, getattr(x, "keep_last")
def c(run):
    tt, m = run.train, run.model
    return tt.threads
class D:
    def __init__(self, t):
        self.t = t
    def e(self):
        return self.t.patience
def f(t: int):
    return t.real
def g(train_cfg, n):
    return train_cfg.local_sgd_period, n.seed
def h(run_cfg):
    train(1, run_cfg)                 # passed on to a RunConfig parameter
def train(n, cfg: RunConfig):
    pass
'''
    v = _TrainReads()
    tree = ast.parse(code)
    v.visit(tree)
    assert set(v.reads) == {"seed", "max_steps", "eps_ls", "keep_last", "threads", "patience", "local_sgd_period"}
    assert v.reads["seed"] == [3]  # not n.seed
    fns = {name: fn for name, fn, _ in _functions(tree)}
    defs = {name: [_params(fn)] for name, fn in fns.items()}
    receives = {name: [p.arg for p in _params(fn) if _receives_run_config(fn, p, defs)] for name, fn in fns.items()}
    assert {name: args for name, args in receives.items() if args} == {"a": ["cfg"], "c": ["run"], "h": ["run_cfg"],
                                                                       "train": ["cfg"]}


if __name__ == "__main__":
    print("RunConfig received in:")
    for path, where in sorted(run_config_receivers().items()):
        print(f"  {path}: {', '.join(where)}")
    print(f"TrainConfig fields read in more than {MAX_FILES_PER_FIELD} files:")
    for name, files in sorted(train_field_reads().items()):
        if len(files) > MAX_FILES_PER_FIELD:
            print(f"  {name}: {', '.join(map(str, sorted(files)))}")
    print(f"functions of more than {MAX_PARAMS} parameters:")
    for (path, name), n in sorted(parameter_counts().items()):
        if n > MAX_PARAMS:
            print(f"  {path}: {name} ({n})")
