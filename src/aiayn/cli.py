"""The ``aiayn`` command: one sub-command per task, each defined next to the code it runs.

Every sub-command module exposes ``register(subparsers)``, which adds its parser and sets
``func`` to the function that runs it. The list below is explicit on purpose (no registry).
"""
from __future__ import annotations

import argparse
import logging
import sys


def _command_modules():
    from aiayn.model import cli as model_cli
    mods = [model_cli]
    # Each entry: (module path). Imported lazily so a missing optional dependency of one
    # command (e.g. the web stack for `serve`) does not break the others.
    import importlib
    for name in COMMAND_MODULES:
        mods.append(importlib.import_module(name))
    return mods


COMMAND_MODULES: list[str] = [
    "aiayn.demo",
    "aiayn.train.cli",
    "aiayn.train.estimate",
    "aiayn.data.cli",
    "aiayn.evaluate.cli",
    "aiayn.evaluate.evaluate_cli",
    "aiayn.decode.cli",
    "aiayn.parsing.cli",
    "aiayn.viz.cli",
    "aiayn.serve.cli",
    "aiayn.export",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aiayn",
        description="The Transformer of 'Attention Is All You Need': prepare, train, translate, score, plot, serve.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for mod in _command_modules():
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from aiayn.errors import UserError
    from aiayn.host.process import configure_process
    try:
        configure_process()  # huge pages, denormals, allocator: before the first tensor (aiayn/host/process.py)
    except UserError as exc:
        print(f"aiayn: error: {exc}", file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    from aiayn.config import ConfigError
    try:
        rc = args.func(args)
    except (UserError, ConfigError) as exc:  # bad input: one clear line, no traceback
        print(f"aiayn {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
