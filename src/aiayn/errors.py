"""Errors a user can fix: the CLI prints their message (naming file and line) and exits 2."""
from __future__ import annotations


class UserError(Exception):
    """Bad input, a missing file, an inconsistent checkpoint: anything the user can act on."""


class InputError(UserError):
    """Bad content in an input file; the message names the file and the 1-based line."""

    def __init__(self, path, line: int | None, message: str):
        self.path = str(path)
        self.line = line
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {message}")


class WriteError(UserError):
    """An output that could not be written (a full disk, a folder gone); the message names the file.
    What was there before is intact."""
