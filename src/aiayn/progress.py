"""Progress bars of the long commands (translate, evaluate, prepare, average, downloads): tqdm on
stderr with its rate (lines/s, B/s), drawn only when stderr is a terminal and ``--quiet`` was not
given, so pipes, logs and tests see nothing of them."""
from __future__ import annotations

import sys

QUIET = False  # the CLI's --quiet (aiayn/cli.py), for every bar of the command


def progress_shown(quiet: bool = False) -> bool:
    """Whether ``progress_bar`` draws: stderr a terminal, and neither ``--quiet`` nor ``quiet``."""
    return not (quiet or QUIET) and _is_terminal(sys.stderr)


def progress_bar(total: int | None = None, *, unit: str, desc: str | None = None, initial: int = 0,
                 unit_scale: bool = False, quiet: bool = False):
    """A tqdm bar on stderr; a bar that draws nothing under ``--quiet``, ``quiet`` or a stderr that
    is not a terminal. ``total`` None: a count and a rate without a percentage."""
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, unit=unit, unit_scale=unit_scale, desc=desc, file=sys.stderr,
                disable=not progress_shown(quiet), dynamic_ncols=True, mininterval=0.5, leave=False)


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
