"""One source of truth per hyperparameter.

Every concern (model, data, train, decode, ...) is a frozen dataclass whose fields carry
their help text in ``field(metadata={"help": ...})``. The helpers here derive everything
else from those fields: ``--set section.field=value`` overrides, dict round trips for
checkpoints and run directories (unknown keys are errors), and argparse options.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import json
import re
import typing
from collections.abc import Callable
from types import UnionType
from typing import Any, TypeVar

T = TypeVar("T")


def param(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with its help text (the one place a hyperparameter is documented)."""
    return dataclasses.field(default=default, metadata={"help": help, **kw})


class ConfigError(ValueError):
    """A configuration key or value that cannot be used; the message names it."""


@functools.lru_cache(maxsize=None)
def _field_types(cls: type) -> dict[str, Any]:
    """A dataclass's field types, resolved once per class (``get_type_hints`` evaluates every
    annotation string; the service calls ``replace`` for every request)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def parse_value(text: str, typ: Any, name: str) -> Any:
    """Parse ``text`` as a value of the annotated type ``typ`` (bool, int, float, str, Optional, tuple)."""
    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    if origin is typing.Union or origin is UnionType:  # Optional[X] and X | None
        inner = [a for a in args if a is not type(None)]
        if text.lower() in ("none", "null", ""):
            return None
        return parse_value(text, inner[0], name)
    if typ is bool:
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name}: expected a boolean (true/false), got {text!r}")
    if origin is tuple:
        parts = [p for p in text.replace(",", " ").split() if p]
        return tuple(parse_value(p, args[0], name) for p in parts)
    try:
        if typ is int:  # "4096", or a whole number written otherwise ("1e2", "100.0"); never rounded
            try:
                return int(text)
            except ValueError:
                number = float(text)
                if not number.is_integer():
                    raise
                return int(number)
        if typ is float:
            return float(text)
    except ValueError as exc:
        raise ConfigError(f"{name}: expected {typ.__name__}, got {text!r}") from exc
    if typ is str:
        return text
    raise ConfigError(f"{name}: cannot parse a value of type {typ}")


def _coerce(value: Any, typ: Any, name: str) -> Any:
    if isinstance(value, str) and typ is not str:
        return parse_value(value, typ, name)
    if typing.get_origin(typ) is tuple and isinstance(value, list):
        return tuple(value)
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def unknown_field(key: str, known: Any, owner: str) -> str:
    """The words for a field ``owner`` lacks: the close name where there is one (a typo), else every known one."""
    return f"unknown field {key!r} in {owner}" + (did_you_mean(key, known) or f"; known: {', '.join(sorted(known))}")


def did_you_mean(key: Any, known: Any) -> str:
    """"; did you mean NAME?" for the known name closest to ``key`` (a typo, another case), else ""."""
    names = {str(k).lower(): k for k in known}
    close = difflib.get_close_matches(str(key).lower(), list(names), n=1)
    return f"; did you mean {names[close[0]]}?" if close else ""


def replace(cfg: T, **changes: Any) -> T:
    """``dataclasses.replace`` that rejects unknown fields, naming the close one or the known ones."""
    types = _field_types(type(cfg))
    for key in changes:
        if key not in types:
            raise ConfigError(unknown_field(key, types, type(cfg).__name__))
    coerced = {k: _coerce(v, types[k], k) for k, v in changes.items()}
    return dataclasses.replace(cfg, **coerced)


def to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-able dict of a (possibly nested) config dataclass."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            v = to_dict(v)
        elif isinstance(v, tuple):
            v = list(v)
        out[f.name] = v
    return out


def from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """Build ``cls`` from a dict; nested dataclass fields recurse; unknown keys are errors."""
    types = _field_types(cls)
    unknown = sorted(set(data) - set(types))
    if unknown:
        raise ConfigError(unknown_field(unknown[0], types, cls.__name__))
    kwargs = {}
    for key, value in data.items():
        typ = types[key]
        if dataclasses.is_dataclass(typ) and isinstance(value, dict):
            kwargs[key] = from_dict(typ, value)
        else:
            kwargs[key] = _coerce(value, typ, key)
    return cls(**kwargs)


def apply_sets(cfg: T, assignments: list[str], where: Callable[[str], str] = lambda key: f"--set {key}") -> T:
    """Apply ``section.field=value`` (or ``field=value`` for a flat config) overrides, all at once:
    each section is checked with every change made (two fields that must change together may be
    given in either order); a field given twice keeps its last value. ``where(key)`` names the
    source of an assignment in error messages (a recipe file gives its path and line instead of
    the default ``--set key``). An empty value is refused (``none`` is the word for none): an unset
    shell variable (``--set model.n_dec_layers=$N``) is not taken for a choice."""
    changes: dict[str, Any] = {}
    for item in assignments:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected section.field=value")
        key, value = item.split("=", 1)
        key = key.strip()
        if not value.strip():
            raise ConfigError(f"{where(key)}: no value (expected section.field=value; none for none)")
        _parse_into(changes, cfg, key.split("."), value.strip(), where(key))
    return _replaced(cfg, changes)


def option_sets(sets: list[str], options: list[tuple[str, str, Any]]) -> list[str]:
    """The assignments of named options that stand for a field, to apply after ``sets``: each option is
    (flag, "section.field", value), value None where it was not given (``("--max-steps", "train.max_steps",
    20)``). A field that ``sets`` also gives another value is refused: which of the two was meant is not
    known, and neither should win unseen."""
    out = []
    for flag, key, value in options:
        if value is None:
            continue
        for item in sets:
            name, sep, text = item.partition("=")
            if sep and name.strip() == key and text.strip() and parse_value(text.strip(), type(value), f"--set {key}") != value:
                raise ConfigError(f"--set {key}={text.strip()} and {flag} {value} disagree; give the field once")
        out.append(f"{key}={value}")
    return out


def _parse_into(changes: dict[str, Any], cfg: Any, path: list[str], value: str, label: str) -> None:
    """Parse ``value`` as the field ``path`` of ``cfg`` into ``changes``, nested as the sections are."""
    types = _field_types(type(cfg))
    head = path[0]
    if head not in types:
        raise ConfigError(f"{label}: {unknown_field(head, types, type(cfg).__name__)}")
    if len(path) == 1:
        if dataclasses.is_dataclass(types[head]):
            raise ConfigError(f"{label}: {head!r} is a section; name a field in it")
        changes[head] = parse_value(value, types[head], label)
        return
    sub = getattr(cfg, head)
    if not dataclasses.is_dataclass(sub):
        raise ConfigError(f"{label}: {head!r} is not a section")
    _parse_into(changes.setdefault(head, {}), sub, path[1:], value, label)


def check_json_fields(cls: type, data: dict[str, Any], where: Callable[[str], str]) -> None:
    """A ConfigError, at ``where(name)``, for the first value of ``data`` (a file's JSON object of fields of
    ``cls``) of another JSON type than its field: a string for a number (``"0.1"``: a file says what it means,
    and a quoted number is more often a mistake than a choice), a number for a boolean, a list for a string.
    A whole number written as a float (``1e2``) is an int's. An unknown field is refused as ``apply_sets``
    refuses it, in the order of ``data`` (the file's), so the first mistake in the file is the one named."""
    types = _field_types(cls)
    for name, value in data.items():
        if name not in types:
            raise ConfigError(f"{where(name)}: {unknown_field(name, types, cls.__name__)}")
        if not dataclasses.is_dataclass(types[name]) and not _json_fits(value, types[name]):
            raise ConfigError(f"{where(name)}: expected {_json_kind(types[name])}, got {json.dumps(value)}")


def _json_fits(value: Any, typ: Any) -> bool:
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin is typing.Union or origin is UnionType:
        return value is None or any(_json_fits(value, a) for a in args if a is not type(None))
    if origin is tuple:
        return isinstance(value, list) and all(_json_fits(v, args[0]) for v in value)
    if typ is bool or typ is str:
        return isinstance(value, typ)
    if typ is int or typ is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return True


def _json_kind(typ: Any) -> str:
    """A field type as a recipe writes its values: ``int | None`` -> "int (a number) or null"."""
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin is typing.Union or origin is UnionType:
        return " or ".join([_json_kind(a) for a in args if a is not type(None)] + ["null"])
    if origin is tuple:
        return f"a list of {_json_kind(args[0])}"
    return {bool: "a boolean (true or false)", int: "int (a whole number)", float: "float (a number)",
            str: "a string"}.get(typ, str(typ))


def _replaced(cfg: T, changes: dict[str, Any]) -> T:
    """``cfg`` with ``changes`` (a dict per changed section), each section built once. A section's
    own check names the section: ``train: best_metric=bleu needs valid_bleu=true``."""
    built = {}
    for k, v in changes.items():
        if not isinstance(v, dict):
            built[k] = v
            continue
        try:
            built[k] = _replaced(getattr(cfg, k), v)
        except ConfigError as exc:
            raise ConfigError(f"{k}: {exc}") from None
    return dataclasses.replace(cfg, **built)


def describe(cls: type) -> list[tuple[str, Any, str]]:
    """(name, default, help) for each field: for ``--help`` texts and documentation."""
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else None
        out.append((f.name, default, f.metadata.get("help", "")))
    return out


def sets_help(cls: type, section: str) -> str:
    """A help paragraph listing the ``--set section.field=value`` keys of a config class."""
    lines = [f"  {section}.{n} (default {d!r}): {h}" for n, d, h in describe(cls)]
    return "\n".join(lines)


def doc_help(doc: str | None) -> str:
    """A module docstring as a command's --help description: reStructuredText's ``code`` as `code`."""
    return (doc or "").replace("``", "`")


def add_arguments(parser: argparse.ArgumentParser, cls: type, defaults: Any = None,
                  only: tuple[str, ...] | None = None) -> None:
    """Add ``--field-name`` options for the fields of ``cls`` (help text from the field)."""
    types = _field_types(cls)
    for name, default, help_text in describe(cls):
        if only is not None and name not in only:
            continue
        if defaults is not None:
            default = getattr(defaults, name)
        typ = types[name]
        flag = "--" + name.replace("_", "-")
        extra = {"nargs": "?", "const": True} if typ is bool else {}  # `--flag` alone means true
        parser.add_argument(flag, dest=name, default=default, type=functools.partial(_option_value, typ, flag),
                            help=f"{help_text} (default: {default!r})", **extra)


def _option_value(typ: Any, flag: str, text: str) -> Any:
    """An option's value, or argparse's error naming the option and what it expected."""
    try:
        return parse_value(text, typ, flag)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{flag}: ")) from exc


def from_args(cls: type[T], ns: argparse.Namespace, base: T | None = None) -> T:
    """Collect the fields of ``cls`` that ``add_arguments`` put into ``ns``."""
    base = base if base is not None else cls()
    vals = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
    return replace_from_options(base, vals)


def replace_from_options(base: T, values: dict[str, Any]) -> T:
    """``replace(base, **values)`` where ``values`` came from command-line options: a refusal names
    the option (``--beam-size must be >= 1``), not the field (``beam_size``)."""
    try:
        return replace(base, **values)
    except ConfigError as exc:
        text = str(exc)
        for name in values:
            text = re.sub(rf"(?<![\w.-]){name}\b", "--" + name.replace("_", "-"), text)
        raise ConfigError(text) from None
