"""The ``aiayn`` command: one sub-command per module of ``aiayn.commands``.

Every command module exposes ``register(subparsers)``, which adds its parser and sets ``func``
to the function that runs it. The list below is explicit on purpose (no registry).

No parser takes an abbreviation of a long option (``allow_abbrev=False`` on each one, as
``add_parser`` does not pass it on): ``--train`` is never read as ``--train-lines``, so a misspelt
option, or one a later version adds, is an error instead of landing on another. ``--opt=value``
is read as always.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback


def _command_modules() -> list:
    """The command modules in the order ``aiayn --help`` lists them."""
    from aiayn.commands import (average, data, demo, ensemble, estimate, evaluate, export, import_, parse, plot,
                                prepare, presets, score, serve, train, translate, upgrade_checkpoint)
    return [presets, demo, train, average, ensemble, upgrade_checkpoint, estimate, prepare, data, score, evaluate,
            translate, parse, plot, serve, export, import_]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aiayn",
        description="The Transformer of 'Attention Is All You Need': prepare, train, translate, score, plot, serve.",
        allow_abbrev=False,
    )
    parser.add_argument("-V", "--version", action=PrintVersion,
                        help="the version of aiayn, where it is installed, and the torch and Python it runs on")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for mod in _command_modules():
        mod.register(sub)
    for name, command in sub.choices.items():
        _command_options(command, name in PROGRESS_COMMANDS)
    _describe(parser)
    return parser


def _describe(parser: argparse.ArgumentParser) -> None:
    """Each command's ``--help`` opens with a description: where its module gives none, the line that
    ``aiayn --help`` lists it with (for commands below commands too)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            said = {a.dest: a.help for a in action._choices_actions}
            for name, command in action.choices.items():
                if command.description is None and said.get(name):
                    command.description = said[name][0].upper() + said[name][1:] + "."
                _describe(command)


class PrintVersion(argparse.Action):
    """``--version``: ``version_line()`` on one line (argparse's own version action wraps it to the terminal's
    width), then exit."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


def version_line() -> str:
    """What ``aiayn --version`` prints: ``aiayn VERSION from PACKAGE_DIR (torch VERSION, Python VERSION)``."""
    import platform

    import torch

    import aiayn
    return (f"aiayn {aiayn.__version__} from {os.path.dirname(os.path.abspath(aiayn.__file__))} "
            f"(torch {torch.__version__}, Python {platform.python_version()})")


def _command_options(command: argparse.ArgumentParser, progress: bool) -> None:
    """``--debug`` (and ``--quiet`` where there is a progress bar) after the command's name too, at
    every level (`aiayn translate ... --debug`, `aiayn data ptb-sample --quiet ...`); the parser is
    kept in the arguments (``command_parser``: the deepest one wins) so that an unknown option is
    reported by the command it was given to."""
    command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    if progress:
        command.add_argument("--quiet", action="store_true", default=argparse.SUPPRESS,
                             help="no progress bar (there is none either when stderr is not a terminal)")
    command.set_defaults(command_parser=command)
    for action in command._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _command_options(sub, progress)


DEBUG_HELP = "on an error (bad input, out of memory), the Python traceback instead of one line"
PROGRESS_COMMANDS = ("translate", "evaluate", "prepare", "average", "data", "demo")  # with bars (aiayn/progress.py)


def main(argv: list[str] | None = None) -> int:
    """The command line ``argv`` (None: the process's) run; the exit status. Ctrl-C before the
    command has started (while Python loads its modules, a second or two) is one line too. A process
    that joined a process group (a rank of torchrun's) ends here, with that status (``_leave``)."""
    try:
        rc = _main(argv)
    except KeyboardInterrupt:
        if "--debug" in (sys.argv[1:] if argv is None else argv):
            raise
        if not _other_rank():  # (Ctrl-C reaches every rank: said once)
            print("aiayn: interrupted", file=sys.stderr)
        rc = 130
    except Exception:  # a traceback (a defect, or --debug's): a rank still ends at once, so that torchrun
        if not _joined():  # names it as the one that failed first, not the peer it left waiting
            raise
        traceback.print_exc()
        rc = 1
    if _joined():
        _leave(rc)
    return rc


def _joined() -> bool:
    """Whether this process joined a process group (``aiayn.train.runtime.JOINED``)."""
    runtime = sys.modules.get("aiayn.train.runtime")  # (imported, with torch, by a command that trains)
    return runtime is not None and runtime.JOINED


def _leave(rc: int) -> None:
    """End a rank's process with ``rc`` once its output is written, skipping the interpreter's exit:
    gloo's threads outlive the process group there (``aiayn.train.runtime.JOINED``) and can abort it
    (SIGABRT), and torchrun would then fail a run that succeeded. The run's files are already closed."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be said there
            pass
    os._exit(rc)


def _other_rank() -> bool:
    """Whether this process is a rank other than the first of a distributed run (torchrun's RANK):
    its info lines would repeat the main rank's, once a process."""
    try:
        return int(os.environ.get("RANK", "0")) > 0
    except ValueError:
        return False


def _first_on_node() -> bool:
    """Whether this process is the first of its machine in a torchrun (LOCAL_RANK 0)."""
    try:
        return int(os.environ.get("LOCAL_RANK", "0")) == 0
    except ValueError:
        return False


def _quiet_other_rank() -> None:
    """The main rank says what every rank would say alike, once; the others write their errors and the
    lines about their own state only (``MainRankLines``), Python's warnings (PyTorch's) among them, and
    the first process of each other machine its warnings too."""
    from aiayn.train.runtime import MainRankLines
    logging.captureWarnings(True)  # warnings.warn as records of the py.warnings logger, which the filter sees
    for handler in logging.getLogger().handlers:
        handler.addFilter(MainRankLines(node_first=_first_on_node()))


def _main(argv: list[str] | None) -> int:
    from aiayn.errors import UserError
    from aiayn.host.process import configure_process
    try:
        configure_process()  # huge pages, denormals, allocator: before the first tensor (aiayn/host/process.py)
    except UserError as exc:
        print(f"aiayn: error: {exc}", file=sys.stderr)
        return 2
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the command they were given to: `aiayn demo: error: unrecognized arguments: --eval`
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    other_rank = not args.verbose and _other_rank()
    if other_rank:
        _quiet_other_rank()
    from aiayn import progress
    from aiayn.config import ConfigError
    from aiayn.commands.oom import is_out_of_memory, out_of_memory_message
    progress.QUIET = getattr(args, "quiet", False)
    try:
        rc = args.func(args)
    except (UserError, ConfigError) as exc:  # bad input: one clear line, no traceback
        if args.debug:
            raise
        if other_rank and isinstance(exc, ConfigError):
            return 2  # every rank read the same settings: the main rank's line says it
        rank = f" (rank {os.environ['RANK']})" if _other_rank() else ""  # a rank's own: which rank
        print(f"aiayn {args.command}: error{rank}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:  # Ctrl-C: where it stopped and how to go on, in one line
        if args.debug:
            raise
        if not other_rank:  # Ctrl-C reaches every rank; the main rank says where the run resumes
            print(f"aiayn {args.command}: interrupted{_where_it_resumes(args)}", file=sys.stderr)
        return 130
    except (RuntimeError, MemoryError) as exc:
        if args.debug or not is_out_of_memory(exc):
            raise
        rank = f" (rank {os.environ['RANK']})" if _other_rank() else ""
        print(f"aiayn {args.command}: error{rank}: {out_of_memory_message(exc, args)}", file=sys.stderr)
        return 2
    return int(rc or 0)


def _where_it_resumes(args: argparse.Namespace) -> str:
    """What the same command does after an interruption: training resumes from ``last.pt`` (which a best
    validation may have written after the newest step checkpoint), else from that step checkpoint."""
    if args.command == "demo":  # (--overwrite again would delete what this run did)
        same = "the same command without --overwrite" if getattr(args, "overwrite", False) else "the same command"
        return f"; {same} resumes (prepare, train and average are skipped where done; training from its last checkpoint)"
    if args.command == "data":
        return "; the same command resumes the download (what arrived is kept in FILE.part)"
    if args.command != "train":
        return ""
    from pathlib import Path

    from aiayn.checkpoint import step_checkpoints
    last = Path(args.out) / "last.pt"
    saved = [last] if last.is_file() else step_checkpoints(args.out)
    if not saved:
        return f"; no checkpoint in {args.out} yet: the same command starts the run again"
    return f"; the same command resumes from {saved[-1]}"


if __name__ == "__main__":
    sys.exit(main())
